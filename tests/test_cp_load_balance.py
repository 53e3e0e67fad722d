"""The causal load balance (rank r holds chunks r and 2cp-1-r), labels shifted before the
split, positions travelling with their tokens, and packed-document ids / positions."""

from __future__ import annotations

import random

import pytest
import torch

from parallel3d.context_parallel import (
    document_ids, document_position_ids, local_positions, shift_labels, split_batch_for_cp, split_for_cp,
    unsplit_from_cp,
)
from parallel3d.context_parallel.load_balance import IGNORE_INDEX


def _cases(count: int, seed: int):
    rng = random.Random(seed)
    return [(rng.randint(1, 6), rng.randint(1, 4), rng.randint(1, 3)) for _ in range(count)]


@pytest.mark.parametrize("cp,chunk,batch", _cases(8, 0))
def test_split_is_a_partition_with_equal_causal_work_and_undoes(cp: int, chunk: int, batch: int) -> None:
    s = 2 * cp * chunk
    x = torch.randn(batch, s, 3)
    shares = [split_for_cp(x, cp, r) for r in range(cp)]
    assert torch.equal(unsplit_from_cp(shares), x)
    positions = [local_positions(s, cp, r) for r in range(cp)]
    for r, (share, pos) in enumerate(zip(shares, positions)):
        assert torch.equal(share, x[:, pos])  # the share holds exactly the tokens at its positions
        assert pos.tolist() == [*range(r * chunk, (r + 1) * chunk), *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
    assert sorted(torch.cat(positions).tolist()) == list(range(s))
    # Causal work of a query at position p is p + 1 keys: every rank gets the same total.
    assert len({int((pos + 1).sum()) for pos in positions}) == 1
    # Other dims split the same way (seq_dim=0).
    assert torch.equal(split_for_cp(x[0], cp, cp - 1, seq_dim=0), shares[-1][0])


@pytest.mark.parametrize("cp,chunk,batch", _cases(6, 1))
def test_labels_are_shifted_before_the_split(cp: int, chunk: int, batch: int) -> None:
    s = 2 * cp * chunk
    tokens = torch.randint(0, 1000, (batch, s))
    labels = shift_labels(tokens)
    for r in range(cp):
        pos = local_positions(s, cp, r)
        got = split_for_cp(labels, cp, r)
        want = torch.where(pos + 1 < s, tokens[:, (pos + 1).clamp_max(s - 1)], IGNORE_INDEX)
        assert torch.equal(got, want)  # each token's target is the next token of the *whole* sequence
    if cp > 1:  # shifting a share instead pairs a chunk's last token with the rank's other chunk
        assert not torch.equal(shift_labels(split_for_cp(tokens, cp, 0)), split_for_cp(labels, cp, 0))


def test_split_batch_keeps_document_ids_whole() -> None:
    tokens = torch.randint(0, 5, (2, 8))
    batch = {"tokens": tokens, "labels": shift_labels(tokens), "document_ids": document_ids(tokens, 0)}
    out = split_batch_for_cp(batch, 2, 1)
    assert torch.equal(out["tokens"], tokens[:, [2, 3, 4, 5]]) and torch.equal(out["document_ids"], batch["document_ids"])


def _documents_by_loop(row: list[int], eod: int) -> tuple[list[int], list[int]]:
    docs, positions, doc, pos = [], [], 0, 0
    for token in row:
        docs.append(doc)
        positions.append(pos)
        pos += 1
        if token == eod:
            doc, pos = doc + 1, 0
    return docs, positions


@pytest.mark.parametrize("seed", range(4))
def test_document_ids_and_positions_restart_after_each_eod(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (3, 17), generator=g)  # EOD = 0: documents of random lengths, some empty
    tokens[0, 0] = tokens[1, -1] = 0
    ids, pos = document_ids(tokens, 0), document_position_ids(tokens, 0)
    for row in range(3):
        want_ids, want_pos = _documents_by_loop(tokens[row].tolist(), 0)
        assert ids[row].tolist() == want_ids and pos[row].tolist() == want_pos
