"""Pipeline parallel on the real GPT/Llama models: loss and every gradient equal the
single-process model's on the same batch (gloo, CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from models import build_model, get_config
from models.state import full_grads
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.pipeline_toy import toy_batch

MBS, SEQ = 2, 8


def _batch(cfg, m: int, seed: int = 3) -> list[dict]:
    return toy_batch(m, MBS, SEQ, seed=seed, vocab=cfg.vocab_size)


def _reference(cfg, microbatches) -> tuple[float, dict[str, torch.Tensor]]:
    """The whole model on one process: mean of the microbatch losses, one backward."""
    model = build_model(cfg, ParallelState.single_process(), seed=0)
    loss = sum(model(mb["input_ids"], mb["labels"], sample_ids=mb["sample_ids"], step=5) for mb in microbatches)
    loss = loss / len(microbatches)
    loss.backward()
    return loss.item(), full_grads(model)


def _case(rank, world, tp, pp, model_name, overrides, schedule, m, v, pp_layers, sp, recompute):
    pstate = ParallelState(Topology(tp=tp, pp=pp, dp=world // (tp * pp)))
    cfg = get_config(model_name, fused_kernels=False, **overrides)
    ranges = stage_layer_ranges(partition_layers(cfg, pp, v, pp_layers), pp, pstate.coord("pp"))
    chunks = [build_model(cfg, pstate, seed=0, layer_range=r, sequence_parallel=sp, recompute=recompute)
              for r in ranges]
    engine = PipelineEngine(chunks, pstate, schedule=schedule, num_microbatches=m, micro_batch_size=MBS,
                            seq_len=SEQ, hidden_size=cfg.hidden_size, sequence_parallel=sp)
    microbatches = _batch(cfg, m)
    result = engine.run_step(microbatches, step=5)
    ref_loss, ref_grads = _reference(cfg, microbatches)
    errors = {}
    for chunk in chunks:
        for name, grad in full_grads(chunk).items():
            ref = ref_grads[name]
            errors[name] = ((grad - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    names = {n for c in chunks for n, _ in c.named_parameters()}
    # The tied copies stay identical after an identical update (the optimizer's part, done here by hand).
    tied = None
    if pstate.in_embedding_group and cfg.tie_embeddings and pp > 1:
        with torch.no_grad():
            for chunk in chunks:
                if chunk.embedding is not None and getattr(chunk.embedding.word.weight, "tied_embedding", False):
                    w = chunk.embedding.word.weight
                    tied = (w - 0.1 * w.grad).clone()
    return {"errors": errors, "graded": names, "stage": pstate.coord("pp"), "tp_rank": pstate.coord("tp"),
            "loss_err": None if result.loss is None else abs(result.loss - ref_loss) / ref_loss,
            "peak": result.peak_live_activations, "tied": tied}


# tp, pp, model, overrides, schedule, m, v, pp_layers, sequence_parallel, recompute
CASES_2 = [
    (1, 2, "gpt_tiny", {}, "1f1b", 1, 1, None, False, "none"),  # m < p
    (1, 2, "gpt_tiny", {"dropout": 0.1}, "gpipe", 3, 1, [3, 1], False, "none"),  # m > p, uneven, dropout
    (1, 2, "llama_tiny", {}, "interleaved_1f1b", 2, 2, None, False, "selective"),  # m = p
    (1, 2, "llama_tiny", {}, "1f1b", 4, 1, None, False, "full"),
]
CASES_4 = [
    (1, 4, "gpt_tiny", {"num_layers": 6}, "1f1b", 2, 1, None, False, "none"),  # m < p, uneven default split
    (1, 4, "llama_tiny", {}, "gpipe", 4, 1, None, False, "none"),  # m = p
    (1, 4, "gpt_tiny", {"num_layers": 8}, "interleaved_1f1b", 8, 2, None, False, "none"),  # m > p
    (2, 2, "gpt_tiny", {"dropout": 0.1}, "1f1b", 3, 1, None, True, "none"),  # tp x pp, sequence parallel
    (2, 2, "llama_tiny", {}, "interleaved_1f1b", 2, 2, None, False, "none"),
    (2, 2, "llama_tiny", {"num_layers": 5}, "gpipe", 1, 1, [2, 3], True, "full"),
]


def _run(rank, world, cases):
    return [_case(rank, world, *case) for case in cases]


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["pp2", "pp4_and_tp2pp2"])
def test_pipeline_matches_single_process_model(world, cases):
    results = run_on_ranks(_run, world, cases, timeout=240)
    for case, per_rank in zip(cases, zip(*results)):
        tp, pp, schedule, m = case[0], case[1], case[4], case[5]
        covered = set().union(*(r["graded"] for r in per_rank))
        ref_names = set().union(*(r["errors"].keys() for r in per_rank))
        assert covered == ref_names, f"{case}: parameters without a gradient: {covered - ref_names}"
        for r in per_rank:
            for name, err in r["errors"].items():
                assert err < 1e-5, f"{case} stage {r['stage']}: grad of {name} off by {err:.2e}"
            if r["stage"] == pp - 1:
                assert r["loss_err"] < 1e-5, f"{case}: loss off by {r['loss_err']:.2e}"
            limit = {"1f1b": min(pp - r["stage"], m), "gpipe": m}.get(schedule)
            if limit is not None:
                assert r["peak"] <= limit
        tied = [r for r in per_rank if r["tied"] is not None]
        if case[2].startswith("gpt"):
            for t in range(tp):
                ends = [r["tied"] for r in tied if r["tp_rank"] == t]
                assert len(ends) == 2 and torch.equal(ends[0], ends[1]), f"{case}: tied copies diverged"
