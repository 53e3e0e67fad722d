"""``train.on_nonfinite`` when only some ranks see the non-finite value (``parallel3d/divergence.py``, session 43).

A NaN or inf injected for one step on ONE rank of a two-rank job (the loss of one dp rank, the last pp stage only,
an inf gradient under a finite loss, ZeRO-3 with cpu offload, a MoE router): every rank must reach the same end,
``stop`` at the same step with nothing of it saved, or ``skip`` the same step and go on, never hang (the harness's
timeout), and what is saved and kept must be finite and, on dp replicas, identical. The reference for a verdict is
the other rank's: the ranks agree or the test fails. Real gloo ranks through the real ``Trainer`` (tests/harness.py).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from parallel3d.checkpoint import complete_checkpoints
from parallel3d.config import job_from_dict, resolve
from parallel3d.divergence import TrainingDiverged
from parallel3d.parallel_state import ParallelState
from parallel3d.trainer import Trainer
from parallel3d.zero.owned import STATE_KINDS
from tests.harness import run_on_ranks
from tests.layout_run import silenced

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")
STEPS, POISONED = 4, 2  # step 2 of 4 sees the NaN / inf; step 1 is saved before it (save_every=1)


def _values(out: str, cache: str, parallel: dict, policy: str) -> dict:
    return {"train": {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32, "seed": 7,
                      "out_dir": out, "save_every": 1, "keep_last": STEPS, "device": "cpu", "eval_iters": 0,
                      "resume": "none", "on_nonfinite": policy},
            "parallel": parallel, "optimizer": {"lr": 1e-3, "warmup_steps": 1},
            "data": {"cache_dir": cache}, "logging": {"log_every": 1}}


def _poison(trainer: Trainer, where: str) -> None:
    """Make step ``POISONED`` non-finite on this rank only, at ``where`` (the weights stay finite)."""
    now = lambda: trainer.step == POISONED - 1  # noqa: E731 - the step being computed is trainer.step + 1
    modules = [m for c in trainer.chunks for m in c.modules()]
    if where == "output":  # the last norm's output: the loss (and every gradient behind it) is NaN here
        norm = next(m for c in trainer.chunks for n, m in c.named_children() if n == "final_norm")
        norm.register_forward_hook(lambda m, a, out: out * float("nan") if now() else out)
    elif where == "gradient":  # one layer weight's gradient is inf (not the embedding: tied, it is shared); loss finite
        weight = next(p for c in trainer.chunks for n, p in c.named_parameters() if n.startswith("layers."))
        weight.register_hook(lambda g: g * float("inf") if now() else g)
    elif where == "router":  # the tokens a router scores are NaN: NaN logits, scores, routing weights
        from parallel3d.moe.router import TopKRouter

        router = next(m for m in modules if isinstance(m, TopKRouter))
        router.register_forward_pre_hook(lambda m, args: (args[0] * float("nan"), *args[1:]) if now() else None)
    else:
        raise ValueError(where)


def _end_on_rank(rank: int, world: int, values: dict, model: str, where: str, poisoned_rank: int) -> dict:
    """``run_on_ranks`` target: train with ``where`` poisoned on ``poisoned_rank``; how this rank ended."""
    rj = resolve(job_from_dict(values, model=model), world)
    trainer = Trainer(rj, ParallelState(rj.topology))
    if rank == poisoned_rank:
        _poison(trainer, where)
    records, ended = [], "finished"
    with silenced(True):
        try:
            result = trainer.train()
            records = result.records
        except TrainingDiverged as exc:
            ended = f"stopped at {trainer.step}" + (" (says why)" if exc.says_why else "")
    # ZeRO-3 frees the parameters' storage between uses: read its weights from the master shards instead.
    params = [p.detach() for c in trainer.chunks for p in c.parameters()] if rj.job.parallel.zero_stage < 3 else []
    buffers = [b for c in trainer.chunks for b in c.buffers() if b.is_floating_point()]  # the MoE expert bias
    state = [seg.state(kind) for seg in trainer.optimizer.owned_segments() for kind in STATE_KINDS]
    return {"ended": ended, "records": records,
            "finite": all(bool(torch.isfinite(t).all()) for t in params + buffers + state),
            "weights": [t.clone() for t in params + buffers],
            "saved": [s for s, _ in complete_checkpoints(os.path.join(rj.job.train.out_dir, "checkpoints"))]}


CASES = {  # name: (model, parallel, where, poisoned rank, dp replicas: whose weights must be equal)
    "loss_nan_on_one_dp_rank": ("gpt_tiny", {"dp": 2}, "output", 1, True),
    "nan_on_the_last_pp_stage_only": ("gpt_tiny", {"pp": 2}, "output", 1, False),
    "inf_gradient_finite_loss": ("gpt_tiny", {"dp": 2}, "gradient", 0, True),
    # No data carries stage 0's gradient to stage 1: only the norm's reduction over pp tells the last stage.
    "inf_gradient_on_the_first_pp_stage_only": ("gpt_tiny", {"pp": 2}, "gradient", 0, False),
    "zero3_cpu_offload": ("gpt_tiny", {"dp": 2, "zero_stage": 3, "offload": "cpu"}, "output", 1, False),
    "moe_router": ("deepseek_tiny", {"dp": 2, "ep": 2}, "router", 1, False),
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


@pytest.mark.parametrize("policy", ["stop", "skip"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_poisoned_rank_ends_every_rank_the_same_way(case, policy, tmp_path, cache_dir):
    model, parallel, where, poisoned, replicas = CASES[case]
    ends = run_on_ranks(_end_on_rank, 2, _values(str(tmp_path / "run"), cache_dir, parallel, policy), model, where,
                        poisoned, timeout=240)
    described = [e["ended"] for e in ends]
    if policy == "stop":
        # Same step on both ranks; exactly one of them (the logging rank) carries the full line; step 1 kept.
        assert sorted(described) == sorted([f"stopped at {POISONED}", f"stopped at {POISONED} (says why)"]), described
        assert all(e["saved"] == [POISONED - 1] for e in ends), [e["saved"] for e in ends]
        return
    assert described == ["finished", "finished"], described
    records = next(e["records"] for e in ends if e["records"])
    assert [r["step"] for r in records if r["skipped"]] == [POISONED], records
    if where == "gradient":  # the loss of that step was finite: only its gradient was not
        assert math.isfinite(next(r["loss"] for r in records if r["step"] == POISONED))
    assert all(math.isfinite(r["loss"]) for r in records if r["step"] != POISONED), records
    assert all(e["finite"] for e in ends) and all(e["saved"] == list(range(1, STEPS + 1)) for e in ends)
    if replicas:  # dp replicas hold the same weights after the skipped step and the steps after it
        assert all(torch.equal(a, b) for a, b in zip(*(e["weights"] for e in ends)))
