"""Evaluation: the forward-only schedule as data, the runner against one process, validation sets, blends.

The layout matrix (tests/layout_matrix.py) also compares every case's ``eval_loss`` with
the single-process run's through the real Trainer.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from models import build_model
from models.config import ModelConfig
from parallel3d.data import DataError, GPTDataset, write_indexed_dataset
from parallel3d.data.blend import BlendError, resolve_blend
from parallel3d.data.indexed import IndexedDataset, stats_path
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.actions import Action, ScheduleError
from parallel3d.pipeline.forward_only import ForwardOnlyRunner
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.pipeline.schedules import build_forward_schedule, check_coalesced_progress, validate_schedule
from parallel3d.topology import Topology
from tests.harness import run_on_ranks

# ---- the schedule -------------------------------------------------------------------------------


def _shapes():
    for p, m, v in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 6, 8), (1, 2, 3)):
        if v == 1 or (p > 1 and m % p == 0):
            yield p, m, v


@pytest.mark.parametrize("coalesced", [False, True])
def test_forward_schedule_meets_the_contract_and_progresses(coalesced):
    for p, m, v in _shapes():
        schedule = build_forward_schedule(p, m, v, coalesced_p2p=coalesced)
        for stage, actions in schedule.items():
            fwd = [(a.microbatch, a.chunk) for a in actions if a.kind == "F"]
            assert sorted(fwd) == sorted(itertools.product(range(m), range(v))), (p, m, v, stage)
            assert not any(a.kind in ("B", "SEND_GRAD", "RECV_GRAD") for a in actions)
        # What the runner executes: NCCL batches with no receive ahead, gloo with two ahead.
        check_coalesced_progress(schedule, prefetch=0 if coalesced else 2, coalesced=coalesced,
                                 wait_sent_activations=False)


def test_forward_only_validation_refuses_backwards():
    schedule = build_forward_schedule(2, 2)
    schedule[1] = schedule[1] + [Action("B", 0)]
    with pytest.raises(ScheduleError, match="forward-only"):
        validate_schedule(schedule, forward_only=True)


# ---- the runner against one process ---------------------------------------------------------------

CFG = ModelConfig(name="eval_gpt", arch="gpt", num_layers=8, hidden_size=32, num_heads=4, vocab_size=96,
                  max_seq_len=16, dropout=0.2, kernel_backend="torch")
MBS, SEQ, M = 2, 16, 4


def _microbatches(seed: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (M * MBS, SEQ + 1), generator=g)
    ids = torch.arange(M * MBS)
    return [{"input_ids": tokens[i * MBS:(i + 1) * MBS, :-1], "labels": tokens[i * MBS:(i + 1) * MBS, 1:],
             "sample_ids": ids[i * MBS:(i + 1) * MBS]} for i in range(M)]


def _reference_loss() -> float:
    """The whole model on one process, eval mode (no dropout): mean of the microbatch losses."""
    model = build_model(CFG, ParallelState.single_process(), seed=5).eval()
    with torch.no_grad():
        return float(np.mean([model(mb["input_ids"], mb["labels"], sample_ids=mb["sample_ids"]).item()
                              for mb in _microbatches()]))


def _runner_case(rank: int, world: int, tp: int, pp: int, v: int, emulate_nccl: bool) -> tuple[float | None, bool]:
    pstate = ParallelState(Topology(tp=tp, pp=pp, dp=world // (tp * pp)), emulate_nccl=emulate_nccl)
    ranges = partition_layers(CFG, pp, v, None, seq_len=SEQ)
    last = len(ranges) - 1
    chunks = []
    for c, layer_range in enumerate(stage_layer_ranges(ranges, pp, pstate.coord("pp"))):
        k = pstate.coord("pp") + c * pp
        chunks.append(build_model(CFG, pstate, seed=5, layer_range=layer_range, pre_process=k == 0,
                                  post_process=k == last))
    runner = ForwardOnlyRunner(chunks, pstate, num_microbatches=M, micro_batch_size=MBS, seq_len=SEQ,
                               hidden_size=CFG.hidden_size)
    loss = runner.run(_microbatches(), step=7)
    return loss, all(c.training for c in chunks)  # modes restored


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,v,emulate_nccl", [(1, 2, 1, False), (2, 2, 2, True), (1, 4, 2, False)])
def test_forward_only_loss_equals_one_process(tp, pp, v, emulate_nccl):
    ref = _reference_loss()
    results = run_on_ranks(_runner_case, tp * pp, tp, pp, v, emulate_nccl, timeout=240)
    losses = [loss for loss, _ in results if loss is not None]
    assert len(losses) == tp  # the last stage's ranks
    for loss in losses:
        assert abs(loss - ref) / ref < 1e-5, (loss, ref)
    assert all(restored for _, restored in results)


def test_forward_only_turns_dropout_off_and_takes_no_graph():
    pstate = ParallelState.single_process()
    model = build_model(CFG, pstate, seed=5)
    runner = ForwardOnlyRunner([model], pstate, num_microbatches=M, micro_batch_size=MBS, seq_len=SEQ,
                               hidden_size=CFG.hidden_size)
    loss = runner.run(_microbatches(), step=1)
    assert abs(loss - _reference_loss()) < 1e-6
    assert model.training and all(p.grad is None for p in model.parameters())
    train_mode = float(np.mean([model(mb["input_ids"], mb["labels"], sample_ids=mb["sample_ids"], step=1).item()
                                for mb in _microbatches()]))
    assert abs(train_mode - loss) > 1e-4  # dropout 0.2 would change it


# ---- validation sets ----------------------------------------------------------------------------


def _dataset(tmp_path, name="d", docs=40, vocab=200, seed=0) -> str:
    rng = np.random.default_rng(seed)
    return write_indexed_dataset(str(tmp_path / name),
                                 [rng.integers(0, vocab, rng.integers(5, 60)) for _ in range(docs)])


def test_held_out_split_is_disjoint_and_cut_at_a_document(tmp_path):
    prefix = _dataset(tmp_path)
    ds = IndexedDataset(prefix)
    train = GPTDataset(prefix, seq_len=8, seed=1, split="train", valid_fraction=0.2)
    valid = GPTDataset(prefix, seq_len=8, seed=1, split="valid", valid_fraction=0.2)
    n = ds.num_tokens
    cut = len(train.streams[0])
    assert cut + len(valid.streams[0]) == n
    doc_starts = np.concatenate([[0], np.cumsum(ds.sequence_lengths)])[:-1]
    assert cut in doc_starts and abs(cut - 0.8 * n) < 60  # the nearest document boundary
    np.testing.assert_array_equal(valid.streams[0], ds.tokens[cut:])
    assert train.fingerprint() != GPTDataset(prefix, seq_len=8, seed=1).fingerprint()
    # Samples read only their side.
    assert valid.get_samples(np.arange(valid.samples_per_epoch)).size


def test_held_out_split_refuses_a_side_without_a_sample(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "small"), [np.arange(20)])
    with pytest.raises(DataError, match="valid_fraction"):
        GPTDataset(prefix, seq_len=8, split="valid", valid_fraction=0.1)


def test_vocab_check_reads_the_sidecar_at_start_and_samples_lazily(tmp_path):
    prefix = _dataset(tmp_path, vocab=300)
    assert IndexedDataset(prefix).max_token_id == int(IndexedDataset(prefix).tokens.max())
    with pytest.raises(DataError, match="model vocab_size=100"):
        GPTDataset(prefix, seq_len=8, model_vocab_size=100)
    os.remove(stats_path(prefix))  # e.g. written by megatron-core: no sidecar, a bounded sample at start
    with pytest.raises(DataError, match="model vocab_size=100"):
        GPTDataset(prefix, seq_len=8, model_vocab_size=100)


def test_stale_sidecar_is_ignored(tmp_path):
    prefix = _dataset(tmp_path, vocab=50)
    old_sidecar = open(stats_path(prefix)).read()
    write_indexed_dataset(prefix, [np.arange(30) % 50])  # the data rewritten, the old sidecar put back
    with open(stats_path(prefix), "w") as fh:
        fh.write(old_sidecar)
    assert IndexedDataset(prefix).max_token_id is None


def test_blend_spellings_agree():
    want = (["a", "b"], [0.3, 0.7])
    assert resolve_blend(["a", "b"], [0.3, 0.7], None) == want
    assert resolve_blend(["0.3", "a", "0.7", "b"], None, None) == want
    assert resolve_blend([], None, "0.3 a 0.7 b") == want
    assert resolve_blend([], None, "a b") == (["a", "b"], None)
    for paths, weights, blend, match in [
        (["0.3", "a", "b"], None, None, "pairs"),
        (["0.3", "a", "0.7", "b"], [1.0, 1.0], None, "already carries weights"),
        (["a"], None, "0.5 b", "once"),
        (["0", "a"], None, None, "> 0"),
        (["a", "b"], [1.0], None, "one positive weight"),
    ]:
        with pytest.raises(BlendError, match=match):
            resolve_blend(paths, weights, blend)


def test_megatron_blend_reaches_the_config(tmp_path):
    from parallel3d.config import ConfigError, data_blends, job_from_dict, resolve

    a, b = _dataset(tmp_path, "a"), _dataset(tmp_path, "b", seed=1)
    job = job_from_dict({"data": {"source": "indexed", "paths": [0.25, a, 0.75, b]},
                         "train": {"seq_len": 8, "device": "cpu"}}, model="gpt_tiny")
    resolve(job, 1)
    assert data_blends(job.data)[0] == ([a, b], [0.25, 0.75])
    bad = job_from_dict({"data": {"source": "indexed", "blend": f"0.5 {a} {b}"},
                         "train": {"seq_len": 8, "device": "cpu"}}, model="gpt_tiny")
    with pytest.raises(ConfigError, match=r"^data\.blend="):
        resolve(bad, 1)
