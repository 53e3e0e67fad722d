"""Which tokens of a sequence each context-parallel rank holds (causal load balance).

The sequence (length ``s``, divisible by ``2 * cp``) is cut into ``2 * cp`` equal chunks;
cp-rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that order. Under a causal
mask chunk ``i`` attends to ``i + 1`` chunks, so every rank does the same work
(``r + 1 + 2 * cp - r = 2 * cp + 1`` chunk pairs).

Everything that describes a token is split the same way: inputs, labels, position ids
(RoPE) and document ids travel with their token. Labels are shifted on the whole
sequence *before* the split (``shift_labels``), so the last token of a chunk keeps the
first token of the next chunk as its target even though that token lives on another rank.

Tensors are split along ``seq_dim`` (default 1: ``[b, s, ...]``); the ``cp`` ranks are
those of one cp group, ``cp_rank`` this rank's index in it.
"""

from __future__ import annotations

import torch

from parallel3d.context_parallel.segments import Segment

IGNORE_INDEX = -100


def check_divisible(seq_len: int, cp: int) -> int:
    """The chunk length ``seq_len / (2 cp)``; a ValueError naming both when it does not divide."""
    if cp < 1:
        raise ValueError(f"context parallel size cp={cp} must be >= 1")
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2*cp = {2 * cp} (cp={cp}) for the causal load balance"
        )
    return seq_len // (2 * cp)


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * cp``) held by ``cp_rank``."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is not in [0, {cp})")
    return cp_rank, 2 * cp - 1 - cp_rank


def rank_segments(seq_len: int, cp: int, cp_rank: int) -> list[Segment]:
    """Global segments of ``cp_rank``'s share, in the order its local tensor holds them."""
    chunk = check_divisible(seq_len, cp)
    return [Segment(i * chunk, chunk) for i in chunk_ids(cp, cp_rank)]


def local_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions ``[s / cp]`` of ``cp_rank``'s tokens (int64)."""
    parts = [torch.arange(seg.start, seg.end, device=device) for seg in rank_segments(seq_len, cp, cp_rank)]
    return torch.cat(parts)


def split_for_cp(x: torch.Tensor, cp: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """``cp_rank``'s share of ``x`` along ``seq_dim`` (a new contiguous tensor when cp > 1)."""
    if cp == 1:
        return x
    chunk = check_divisible(x.shape[seq_dim], cp)
    first, second = chunk_ids(cp, cp_rank)
    return torch.cat([x.narrow(seq_dim, first * chunk, chunk), x.narrow(seq_dim, second * chunk, chunk)], seq_dim)


def unsplit_from_cp(shares: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """Undo ``split_for_cp``: the full sequence from every rank's share (in cp-rank order)."""
    cp = len(shares)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, share in enumerate(shares):
        first, second = share.chunk(2, dim=seq_dim)
        i, j = chunk_ids(cp, rank)
        chunks[i], chunks[j] = first, second
    return torch.cat(chunks, seq_dim)


def shift_labels(tokens: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets ``[b, s]`` of ``tokens [b, s]``; the last position gets ``ignore_index``.

    Call on the whole sequence, then split: shifting a share would pair a chunk's last
    token with the first token of the rank's *other* chunk."""
    labels = torch.full_like(tokens, ignore_index)
    labels[:, :-1] = tokens[:, 1:]
    return labels


def split_batch_for_cp(
    batch: dict[str, torch.Tensor], cp: int, cp_rank: int, seq_dim: int = 1,
    keep_whole: tuple[str, ...] = ("document_ids",),
) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` split the same way, except the keys in ``keep_whole``.

    Document ids stay whole by default: the context-parallel attention needs every
    position's document (it receives other ranks' keys); ``split_for_cp`` gives a share."""
    return {key: t if key in keep_whole else split_for_cp(t, cp, cp_rank, seq_dim) for key, t in batch.items()}
