"""The pipeline executor on a toy model: gradients equal the single-process model's."""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.engine import PipelineEngine, split_batch
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.pipeline.placement import placement_for
from parallel3d.pipeline.tied import sync_tied_embedding_grads
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.pipeline_toy import HIDDEN, ToyModel, toy_batch

MBS, SEQ = 2, 4


def _reference(num_layers: int, microbatches: list[dict], tied: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean loss over microbatches and its gradients, computed in one graph in float64."""
    model = ToyModel(num_layers, tied=tied).double()
    loss = sum(model(mb["input_ids"], mb["labels"]) for mb in microbatches) / len(microbatches)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    if tied:
        grads["head"] = grads["embedding"]
    return loss.item(), grads


def _pipeline_case(rank, world, pp, schedule, m, v, num_layers, pp_layers, tied, emulate_nccl=False):
    pstate = ParallelState(Topology(tp=1, pp=pp, dp=world // pp), emulate_nccl=emulate_nccl)
    cfg = ModelConfig(num_layers=num_layers, hidden_size=HIDDEN, num_heads=1, vocab_size=32)
    ranges = partition_layers(cfg, pp, v, pp_layers)
    chunks = [
        ToyModel(num_layers, r, pre_process=(r[0] == 0), post_process=(r[1] == num_layers), tied=tied,
                 deferral=pstate.weight_grads)
        for r in stage_layer_ranges(ranges, pp, pstate.coord("pp"), placement_for(schedule, pp, v))
    ]
    engine = PipelineEngine(
        chunks, pstate, schedule=schedule, num_microbatches=m, micro_batch_size=MBS, seq_len=SEQ, hidden_size=HIDDEN
    )
    microbatches = toy_batch(m, MBS, SEQ)
    result = engine.run_step(microbatches, account_activations=True)
    ref_loss, ref_grads = _reference(num_layers, microbatches, tied)
    errors = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            ref = ref_grads[name]
            errors[name] = ((param.grad - ref).norm() / ref.norm()).item()
    loss_err = None if result.loss is None else abs(result.loss - ref_loss) / abs(ref_loss)
    return {
        "errors": errors,
        "loss_err": loss_err,
        "peak": result.peak_live_activations,
        "bytes": result.peak_activation_bytes,
        "stage": pstate.coord("pp"),
        "pp_bytes": pstate.comm_stats.total("pp"),
        "timed_actions": sorted(str(a) for a, _, _ in result.timeline) == sorted(str(a) for a in engine.actions),
        "times_ok": 0 < result.busy_time <= result.step_time and 0 <= result.bubble_fraction < 1,
        # the step's time splits into computing, p2p waits, the closing collectives and the executor's own
        # work; its CPU share is a thread's CPU time inside the loop (so at most the loop's wall time)
        "split_ok": (result.finalize_time > 0 and result.wait_time >= 0
                     and result.busy_time + result.wait_time + result.finalize_time <= result.step_time
                     and 0 < result.executor_cpu_time <= result.step_time - result.finalize_time),
    }


CASES = [
    # pp, schedule, m, v, num_layers, pp_layers, tied
    (2, "1f1b", 1, 1, 4, None, False),  # m < p
    (2, "1f1b", 2, 1, 4, None, True),  # m = p, tied embedding
    (2, "gpipe", 3, 1, 3, None, False),  # m > p, uneven
    (2, "interleaved_1f1b", 4, 2, 4, None, True),
    (4, "1f1b", 2, 1, 6, None, False),  # m < p, uneven default split
    (4, "1f1b", 6, 1, 6, [1, 2, 2, 1], True),  # explicit uneven split, tied
    (4, "gpipe", 4, 1, 4, None, False),
    (4, "interleaved_1f1b", 4, 2, 8, None, False),
    (1, "1f1b", 3, 1, 2, None, True),  # pp = 1: plain gradient accumulation
]


def _check_against_reference(cases, results) -> None:
    for case, per_rank in zip(cases, zip(*results)):
        pp, schedule, m = case[0], case[1], case[2]
        for r in per_rank:
            for name, err in r["errors"].items():
                assert err < 1e-5, f"{case} stage {r['stage']}: grad of {name} off by {err:.2e}"
            if r["stage"] == pp - 1:
                assert r["loss_err"] < 1e-6, f"{case}: loss off by {r['loss_err']:.2e}"
            else:
                assert r["loss_err"] is None
            limit = {"1f1b": min(pp - r["stage"], m), "gpipe": m, "zb_h1": min(pp, m), "zbv": min(2 * pp, 2 * m)}.get(schedule)
            if limit is not None:
                assert r["peak"] <= limit, f"{case} stage {r['stage']}: {r['peak']} live activations > {limit}"
            assert r["bytes"] > 0
            assert r["timed_actions"] and r["times_ok"] and r["split_ok"]
            if pp > 1:
                assert r["pp_bytes"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_grads_match_single_process(world):
    cases = [c for c in CASES if c[0] <= world and world % c[0] == 0 and (c[0] == world or c[0] == 1 and world == 2)]
    _check_against_reference(cases, run_on_ranks(_run_cases, world, cases, timeout=120))


def _emulated_nccl_cases(pp: int) -> list[tuple]:
    """Every schedule at pp stages: m below, at and above pp; uneven splits; tied and untied."""
    cases = []
    for i, (schedule, m, v) in enumerate(
        [("gpipe", max(1, pp - 1), 1), ("gpipe", pp + 1, 1), ("1f1b", max(1, pp - 1), 1), ("1f1b", 2 * pp + 1, 1),
         ("interleaved_1f1b", pp, 2), ("interleaved_1f1b", 2 * pp, 2)]
    ):
        cases.append((pp, schedule, m, v, pp * v + i % 2, None, i % 2 == 0, True))  # (..., tied, emulate_nccl)
    return cases


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_pipeline_grads_match_single_process_under_emulated_nccl(pp):
    """One Work per batch and FIFO batches (as on GPUs): same grads, no deadlock, no lost receive."""
    cases = _emulated_nccl_cases(pp)
    _check_against_reference(cases, run_on_ranks(_run_cases, pp, cases, timeout=120))


def _run_cases(rank, world, cases):
    return [_pipeline_case(rank, world, *case) for case in cases]


def test_split_batch_rejects_non_dividing_micro_batch():
    batch = toy_batch(1, 6, SEQ)[0]
    assert len(split_batch(batch, 3)) == 2
    with pytest.raises(ValueError, match="micro_batch_size=4 does not divide the batch of 6"):
        split_batch(batch, 4)


def test_engine_rejects_wrong_microbatch_count_and_shape():
    pstate = ParallelState.single_process()
    engine = PipelineEngine(
        [ToyModel(2)], pstate, num_microbatches=2, micro_batch_size=MBS, seq_len=SEQ, hidden_size=HIDDEN
    )
    with pytest.raises(ValueError, match="got 1 microbatches"):
        engine.run_step(toy_batch(1, MBS, SEQ))
    with pytest.raises(ValueError, match=r"input_ids has shape \(3, 4\)"):
        engine.run_step(toy_batch(2, 3, SEQ))
    with pytest.raises(ValueError, match="num_microbatches divisible by num_stages"):
        PipelineEngine([ToyModel(2)] * 2, ParallelState.without_groups(Topology(tp=1, pp=2, dp=1), 0),
                       schedule="interleaved_1f1b", num_microbatches=3, micro_batch_size=MBS, seq_len=SEQ,
                       hidden_size=HIDDEN)


class RecordingGradSync:
    """Records the engine's calls to the ZeRO hook (the hook is not what is under test)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def prepare(self, is_last_microbatch: bool) -> None:
        self.calls.append(("prepare", is_last_microbatch))

    def finalize(self) -> None:
        self.calls.append(("finalize",))


def _grad_sync_case(rank, world):
    pstate = ParallelState(Topology(tp=1, pp=2, dp=1))
    cfg = ModelConfig(num_layers=4, hidden_size=HIDDEN, num_heads=1, vocab_size=32)
    ranges = stage_layer_ranges(partition_layers(cfg, 2, 2), 2, pstate.coord("pp"))
    chunks = [ToyModel(4, r, tied=True) for r in ranges]
    sync = RecordingGradSync()
    # Plain interleaved 1F1B: one prepare per backward. With the drain split (the default) each split
    # backward also announces its W (engine module doc), which this count leaves out.
    engine = PipelineEngine(chunks, pstate, schedule="interleaved_1f1b", num_microbatches=4, micro_batch_size=MBS,
                            seq_len=SEQ, hidden_size=HIDDEN, grad_sync=sync, split_drain=False)
    microbatches = toy_batch(4, MBS, SEQ)
    engine.run_step(microbatches)
    backwards = [a for a in engine.actions if a.kind == "B"]
    _, ref = _reference(4, microbatches, tied=True)
    tied = [p for c in chunks for p in c.parameters() if getattr(p, "tied_embedding", False)]
    before = [((p.grad - ref["embedding"]).norm() / ref["embedding"].norm()).item() for p in tied]
    sync_tied_embedding_grads(chunks, pstate)  # what a real grad_sync's finalize does (ZeRO: on its pieces)
    after = [((p.grad - ref["embedding"]).norm() / ref["embedding"].norm()).item() for p in tied]
    return sync.calls, [(a.microbatch, a.chunk) for a in backwards], before, after


def test_grad_sync_prepared_per_backward_and_finalized_once():
    """The engine announces every backward and calls ``finalize`` once, last: gradient finalisation
    (tied embeddings included) belongs to the grad_sync it was given."""
    for calls, backwards, before, after in run_on_ranks(_grad_sync_case, 2):
        assert len(calls) == len(backwards) + 1 and calls[-1] == ("finalize",)
        flags = [c[1] for c in calls[:-1]]
        # True exactly on the backward that completes each chunk's accumulation (microbatch 3 of each chunk).
        assert [bw for bw, flag in zip(backwards, flags) if flag] == [(3, 1), (3, 0)]
        assert len(before) == 1 and before[0] > 1e-3  # not synced inside run_step when grad_sync is given
        assert after[0] < 1e-5


def _free_sent_case(rank, world, free):
    pstate = ParallelState(Topology(tp=1, pp=world, dp=1))
    num_layers, m = 4, 6
    cfg = ModelConfig(num_layers=num_layers, hidden_size=HIDDEN, num_heads=1, vocab_size=32)
    (r,) = stage_layer_ranges(partition_layers(cfg, world, 1), world, pstate.coord("pp"))
    chunk = ToyModel(num_layers, r)
    engine = PipelineEngine([chunk], pstate, schedule="1f1b", num_microbatches=m, micro_batch_size=MBS,
                            seq_len=SEQ, hidden_size=HIDDEN, free_sent_activations=free)
    result = engine.run_step(toy_batch(m, MBS, SEQ), account_activations=True)
    return {"stage": pstate.coord("pp"), "bytes": result.peak_activation_bytes,
            "grads": {n: p.grad.clone() for n, p in chunk.named_parameters()}}


def test_free_sent_activations_drops_peak_bytes_keeps_grads():
    """Megatron's trick: same gradients, and the peak loses exactly the outputs already sent."""
    world = 4
    output_bytes = MBS * SEQ * HIDDEN * 4
    kept = run_on_ranks(_free_sent_case, world, False)
    freed = run_on_ranks(_free_sent_case, world, True)
    for k, f in zip(kept, freed):
        for name, grad in k["grads"].items():
            assert torch.equal(f["grads"][name], grad), f"stage {k['stage']}: {name} differs when freeing"
        # 1F1B: stage s holds p - s outputs at its peak; freeing keeps only the newest (unsent) one.
        must_free = (world - k["stage"] - 1) * output_bytes
        assert k["bytes"] - f["bytes"] == must_free, f"stage {k['stage']}: {k['bytes']} -> {f['bytes']}"


# ---- the activation peak through the Trainer, measured by the kernel (peak RSS of fresh ranks) --
FEW, MANY = 4, 12  # microbatches per step
# Activations of one microbatch (16 x 64 tokens, attention probabilities, 4 MiB of logits on the
# last stage) dwarf its pipeline messages (128 KiB): what a schedule keeps per microbatch shows.
RSS_PIPE_MODEL = dict(num_layers=4, hidden_size=32, num_heads=4, max_seq_len=64)
RSS_MBS = 16


def test_activation_peak_rss_does_not_grow_with_the_microbatch_count(tmp_path):
    """pp=2 through the real Trainer: the peak RSS of every rank (counted by the kernel in fresh
    processes, not by the engine) at MANY microbatches per step against FEW. GPipe keeps every
    microbatch's activations until its backward, by design: its growth is the yardstick of
    MANY - FEW microbatches' activations. Every other schedule bounds the microbatches in flight:
    its growth must stay under a quarter of that (two microbatches' worth), where a schedule that
    leaked every microbatch's activations (zb_h1 once did) grows like GPipe."""
    from parallel3d.pipeline.options import MULTI_CHUNK
    from parallel3d.pipeline.schedules import SCHEDULE_NAMES
    from tests.peak_rss import job_values, peak_rss_of_job, token_file

    tokens = token_file(str(tmp_path))
    growth = {}
    for schedule in SCHEDULE_NAMES:
        parallel = {"pp": 2, "schedule": schedule, "virtual_stages": 2 if schedule in MULTI_CHUNK else 1}
        few, many = (peak_rss_of_job(job_values(tokens, str(tmp_path / f"{schedule}-{m}"), RSS_PIPE_MODEL, parallel,
                                                {"seq_len": 64, "global_batch_size": RSS_MBS * m,
                                                 "micro_batch_size": RSS_MBS}), 2)
                     for m in (FEW, MANY))
        growth[schedule] = [b - a for a, b in zip(few, many)]
    print("\npeak RSS growth per rank from", FEW, "to", MANY, "microbatches (MiB):",
          {s: [round(g / 2**20, 1) for g in per_rank] for s, per_rank in growth.items()})
    yardstick = growth.pop("gpipe")
    assert min(yardstick) > 2 * (MANY - FEW) * 2**20, yardstick  # activations of a microbatch: MiBs
    for schedule, per_rank in growth.items():
        for rank, (grew, gpipe) in enumerate(zip(per_rank, yardstick)):
            assert grew < gpipe / 4, (schedule, rank, grew / 2**20, gpipe / 2**20)
