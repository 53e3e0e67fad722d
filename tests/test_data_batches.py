"""DistributedBatchIterator: layout-independent global batches, resume, and a gloo run of 4 ranks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from parallel3d.data import DataError, DistributedBatchIterator, GPTDataset, write_indexed_dataset
from parallel3d.context_parallel.load_balance import split_batch_for_cp
from parallel3d.pipeline.microbatch import INPUT_IDS, LABELS, SAMPLE_IDS, ids_share_step_buffer, stage_keys
from tests.harness import run_on_ranks

SEQ = 8


@pytest.fixture
def dataset(tmp_path) -> GPTDataset:
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 300, size=int(rng.integers(5, 30)))) + [0] for _ in range(40)]
    return GPTDataset(write_indexed_dataset(tmp_path / "d", docs), None, SEQ, seed=1)


def _global_step(dataset: GPTDataset, step_start: int, g: int, mb: int, dp: int) -> dict[str, torch.Tensor]:
    """Concatenate all DP ranks' microbatches of one step, in rank then microbatch order."""
    parts = []
    for r in range(dp):
        parts += next(DistributedBatchIterator(dataset, g, mb, r, dp, start_sample=step_start))
    return {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels", "sample_ids")}


def test_global_batch_is_layout_independent(dataset):
    g = 12
    reference = torch.from_numpy(dataset.get_samples(np.arange(g, 2 * g)))  # step 1, straight from the dataset
    for mb, dp in ((12, 1), (1, 1), (3, 2), (2, 3), (1, 4)):
        batch = _global_step(dataset, g, g, mb, dp)
        assert torch.equal(batch["input_ids"], reference[:, :-1])
        assert torch.equal(batch["labels"], reference[:, 1:])
        assert torch.equal(batch["sample_ids"], torch.arange(g, 2 * g))


def test_microbatch_shapes_and_count(dataset):
    it = DistributedBatchIterator(dataset, 16, 2, dp_rank=1, dp_size=2)
    step = next(it)
    assert it.num_microbatches == len(step) == 4
    for j, mb in enumerate(step):
        assert mb["input_ids"].shape == mb["labels"].shape == (2, SEQ)
        assert mb["input_ids"].dtype == mb["labels"].dtype == mb["sample_ids"].dtype == torch.int64
        assert mb["sample_ids"].tolist() == [8 + 2 * j, 9 + 2 * j]
    for first, last in itertools.product((False, True), repeat=2):
        keys = stage_keys(first, last)
        step = next(DistributedBatchIterator(dataset, 16, 2, 1, 2, keys=keys))
        assert [set(mb) for mb in step] == [set(keys)] * 4
        if last:  # a last stage's labels are the same whether or not it also reads input_ids
            assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(step, next(
                DistributedBatchIterator(dataset, 16, 2, 1, 2))))


def test_resume_continues_with_the_next_unseen_sample(dataset):
    run = DistributedBatchIterator(dataset, 6, 3, 0, 1)
    straight = [next(run) for _ in range(25)]  # > 2 epochs of 40-ish samples: crosses epoch boundaries
    first = DistributedBatchIterator(dataset, 6, 3, 0, 1)
    for _ in range(10):
        next(first)
    state = first.state_dict()
    assert state["next_sample"] == 60
    resumed = DistributedBatchIterator(dataset, 6, 3, 0, 1)
    resumed.load_state_dict(state)
    for step in straight[10:]:
        got = next(resumed)
        for a, b in zip(step, got):
            for k in a:
                assert torch.equal(a[k], b[k])
    # Resuming with another dp / micro-batch size continues the same global sample stream.
    other = DistributedBatchIterator(dataset, 6, 1, 1, 2)
    other.load_state_dict(state)
    assert torch.cat([m["sample_ids"] for m in next(other)]).tolist() == [63, 64, 65]


def test_errors(dataset, tmp_path):
    multiple = r"global_batch_size=10 must be a multiple of micro_batch_size \* dp_size = 2 \* 3"
    with pytest.raises(DataError, match=multiple):
        DistributedBatchIterator(dataset, 10, 2, 0, 3)
    with pytest.raises(DataError, match=r"dp_rank=2 must be in \[0, dp_size=2\)"):
        DistributedBatchIterator(dataset, 4, 1, 2, 2)
    with pytest.raises(DataError, match="micro_batch_size=0"):
        DistributedBatchIterator(dataset, 4, 0, 0, 1)
    with pytest.raises(DataError, match="start_sample=-3"):
        DistributedBatchIterator(dataset, 4, 1, 0, 1, start_sample=-3)
    it = DistributedBatchIterator(dataset, 4, 1)
    changed = GPTDataset(dataset.datasets, None, SEQ, seed=2)
    with pytest.raises(DataError, match="differs from this run's"):
        DistributedBatchIterator(changed, 4, 1).load_state_dict(it.state_dict())
    DistributedBatchIterator(changed, 4, 1).load_state_dict(it.state_dict(), strict=False)
    with pytest.raises(DataError, match="no 'next_sample'"):
        it.load_state_dict({})


@pytest.mark.parametrize("change, named", [
    ({"seed": 2}, "train.seed: 1 there, 2 here"),
    ({"seq_len": SEQ // 2}, f"train.seq_len: {SEQ} there, {SEQ // 2} here"),  # its chunks follow: not named
    ({"split": "train", "valid_fraction": 0.25}, "data.valid_fraction: None there, 0.25 here"),
])
def test_a_refused_resume_names_the_setting_that_changed(dataset, change, named):
    """A command-line user cannot pass strict=False: the refusal names the config key that differs, as the
    checkpoint had it and as this run has it, and nothing that only followed from it."""
    saved = DistributedBatchIterator(dataset, 4, 1).state_dict()
    kwargs = {"seq_len": SEQ, "seed": 1, **change}
    changed = GPTDataset(dataset.datasets, None, kwargs.pop("seq_len"), **kwargs)
    with pytest.raises(DataError) as err:
        DistributedBatchIterator(changed, 4, 1).load_state_dict(saved)
    message = str(err.value)
    assert f"({named})" in message or f"({named};" in message or f"; {named})" in message, message
    assert "samples per dataset" not in message and "strict=False" not in message


def test_a_resume_with_other_data_names_the_data(dataset, tmp_path):
    saved = DistributedBatchIterator(dataset, 4, 1).state_dict()
    other = GPTDataset(write_indexed_dataset(tmp_path / "o", [[1, 2, 3, 0] * 30]), None, SEQ, seed=1)
    with pytest.raises(DataError) as err:
        DistributedBatchIterator(other, 4, 1).load_state_dict(saved)
    assert "(samples per dataset (the data: data.paths, " in str(err.value)
    assert f"{saved['dataset']['chunks']} there, {other.fingerprint()['chunks']} here)" in str(err.value)


def test_for_rank_gives_each_stage_the_keys_the_engine_reads(dataset):
    from parallel3d.parallel_state import ParallelState
    from parallel3d.topology import Topology

    topology = Topology(tp=1, pp=3, dp=2)
    for rank in range(topology.world_size):
        pstate = ParallelState.without_groups(topology, rank)
        step = next(DistributedBatchIterator.for_rank(dataset, pstate, 8, 2))
        want = {"sample_ids"} | ({"input_ids"} if pstate.coord("pp") == 0 else set()) | (
            {"labels"} if pstate.coord("pp") == 2 else set())
        assert [set(mb) for mb in step] == [want] * 2
        first = 4 * pstate.coord("dp")
        assert torch.cat([mb["sample_ids"] for mb in step]).tolist() == list(range(first, first + 4))


def _ranks_read_batches(rank: int, world_size: int, cache_dir: str) -> dict:
    from parallel3d.data import build_default_corpus
    from parallel3d.parallel_state import ParallelState
    from parallel3d.topology import Topology

    pstate = ParallelState(Topology(tp=2, pp=1, dp=2))
    # Only global rank 0 builds; the others wait for its completion marker.
    prefix, tok = build_default_corpus(cache_dir, 512, is_builder=(rank == 0), wait_timeout_s=60)
    dataset = GPTDataset(prefix, None, 16, seed=5, model_vocab_size=512)
    it = DistributedBatchIterator.for_rank(dataset, pstate, 8, 2, start_sample=8)
    steps = [next(it) for _ in range(2)]
    return {
        "dp": pstate.coord("dp"), "tp": pstate.coord("tp"), "prefix": prefix,
        "vocab": tok.vocab_size, "steps": steps, "state": it.state_dict()["next_sample"],
    }


@pytest.mark.slow
def test_four_ranks_tp_dp(tmp_path):
    """Real ranks: one builds the corpus while the others wait; DP slices and TP copies are right."""
    results = run_on_ranks(_ranks_read_batches, 4, str(tmp_path / "cache"), timeout=120)
    assert len({r["prefix"] for r in results}) == 1
    assert all(r["state"] == 24 for r in results)
    reference = GPTDataset(results[0]["prefix"], None, 16, seed=5)
    for r in results:
        for t, step in enumerate(r["steps"]):
            ids = torch.cat([mb["sample_ids"] for mb in step])
            first = 8 + 8 * t + 4 * r["dp"]
            assert ids.tolist() == list(range(first, first + 4))
            tokens = torch.from_numpy(reference.get_samples(ids.numpy()))
            assert torch.equal(torch.cat([mb["input_ids"] for mb in step]), tokens[:, :-1])
            assert torch.equal(torch.cat([mb["labels"] for mb in step]), tokens[:, 1:])
    # TP ranks of one replica read identical batches.
    by_coord = {(r["dp"], r["tp"]): r for r in results}
    for (dp, tp), r in by_coord.items():
        other = by_coord[(dp, 1 - tp)]
        for a, b in zip(r["steps"], other["steps"]):
            for x, y in zip(a, b):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_document_ids_reach_every_stage(dataset):
    """data.document_mask: every stage (a middle one reads no tokens) gets the whole sequence's
    document ids, cut at the EOD token (id 0 here) of the input tokens."""
    from parallel3d.context_parallel.documents import document_ids

    middle = next(DistributedBatchIterator(dataset, 16, 2, 0, 1, keys=("sample_ids", "document_ids"), eod_id=0))
    full = next(DistributedBatchIterator(dataset, 16, 2, 0, 1))
    assert [set(mb) for mb in middle] == [{"sample_ids", "document_ids"}] * len(full)
    for m, f in zip(middle, full):
        assert torch.equal(m["document_ids"], document_ids(f["input_ids"], 0))
    assert any(int(m["document_ids"].max()) > 0 for m in middle)  # the sample holds document boundaries
    with pytest.raises(DataError, match="eod_id"):
        DistributedBatchIterator(dataset, 16, 2, 0, 1, keys=("sample_ids", "document_ids"))


def test_document_mask_takes_the_eod_id_from_the_data_tokenizer():
    """data.document_mask reads the end-of-document id from the data's tokenizer, and a masked job without one
    fails with a DataError naming the key to set (not an AttributeError on None)."""
    from parallel3d.data import ByteTokenizer, document_eod_id

    tok = ByteTokenizer()
    assert document_eod_id(True, tok) == tok.eod_id
    assert document_eod_id(False, tok) is None and document_eod_id(False, None) is None
    with pytest.raises(DataError, match="data.tokenizer_file"):
        document_eod_id(True, None)


@pytest.mark.parametrize("mb,cp", list(itertools.product((1, 2, 3), (1, 2))))
def test_ids_and_labels_share_the_step_buffer_where_the_rule_says(dataset, mb, cp):
    """The data path's real storages (cut for cp as ``Trainer._to_device`` cuts them) against
    ``ids_share_step_buffer``, which the dry run and the planner count by."""
    step = next(DistributedBatchIterator(dataset, 6 * mb, mb, 0, 1))
    cut = [split_batch_for_cp(m, cp, cp - 1, keep_whole=(SAMPLE_IDS,)) if cp > 1 else m for m in step]
    ptrs = {m[k].untyped_storage().data_ptr() for m in cut for k in (INPUT_IDS, LABELS)}
    assert (len(ptrs) == 1) == ids_share_step_buffer(mb, cp), (mb, cp, len(ptrs))
