"""Stages 1-2 with ``overlap_param_gather``: the post-step all-gather is really asynchronous (works
pending after ``step()``, each waited for by the forward pre-hook of the first layer reading its
bucket) and every public reader sees the gathered values, equal to torch's AdamW on one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from tests.harness import run_on_ranks

WIDTH, DEPTH, ROWS, LR, WD = 8, 4, 4, 1e-2, 0.1


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference(steps: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """Parameters after each step of torch AdamW on the global batch (the mean of the ranks' means)."""
    model = _model()
    params = list(model.parameters())  # ZeroOptimizer does not decay 1-D tensors (biases)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=LR)
    out = []
    for step in range(steps):
        x = torch.cat([_batch(step, r) for r in range(dp)])
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _close(params: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((params[n] - w).abs().max()) for n, w in want.items())


def _overlap_run(rank: int, world: int, stage: int, ref: list[dict[str, torch.Tensor]]) -> dict:
    ps = ParallelState(Topology(tp=1, pp=1, dp=world))
    model = _model()
    # One bucket per Linear (weight + bias = 72 fp32 elements), so each layer waits for its own.
    opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=LR, weight_decay=WD, betas=(0.9, 0.999),
                        bucket_size_mb=72 * 4 / 2**20,
                        overlap_param_gather=True)
    buckets = len(opt.layouts[0].buckets)
    seen: list[tuple[int, int, float]] = []  # (layer, gathers in flight, error of its weights) at its pre-hook

    def probe(layer: int, step: int):
        def hook(module, args):  # registered after the optimizer's hook, so it runs after the wait
            if step_ref[0] is not None:
                err = float(max((module.weight.detach() - step_ref[0][f"{layer}.weight"]).abs().max(),
                                (module.bias.detach() - step_ref[0][f"{layer}.bias"]).abs().max()))
                seen.append((layer, opt.param_gathers_in_flight, err))
        return hook

    step_ref: list = [None]
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(probe(i, 0))
    out: dict = {"buckets": buckets}
    # Step 0, then read through the forward (hooks); step 1, then through state_dict(); step 2,
    # then owned_segments / gathered_params; every time right after step() returned.
    for step in range(3):
        model(_batch(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        out.setdefault("in_flight_after_step", []).append(opt.param_gathers_in_flight)
        if step == 0:
            step_ref[0] = ref[0]
            model(_batch(step + 100, rank))  # an evaluation-like forward without backward
            step_ref[0] = None
            out["forward"] = list(seen)
            out["after_forward"] = opt.param_gathers_in_flight
        elif step == 1:
            sd = model.state_dict()
            out["state_dict_in_flight"] = opt.param_gathers_in_flight
            out["state_dict_err"] = _close({k: v for k, v in sd.items()}, ref[1])
        else:
            segments = opt.owned_segments()
            out["segments_in_flight"] = opt.param_gathers_in_flight
            with opt.gathered_params():
                out["final_err"] = _close(dict(model.named_parameters()), ref[2])
            out["segments_err"] = max(
                float((s.master - ref[2][s.name].reshape(-1)[s.start:s.start + s.length]).abs().max())
                for s in segments)
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_overlapped_param_gather_is_async_and_exact(stage):
    ref = _reference(3, 2)
    for rank, out in enumerate(run_on_ranks(_overlap_run, 2, stage, ref, timeout=120)):
        n = out["buckets"]
        assert n == DEPTH
        assert out["in_flight_after_step"] == [n, n, n], "step() must leave every bucket's gather pending"
        layers = [layer for layer, _, _ in out["forward"]]
        assert layers == list(range(DEPTH))
        # Layer i's pre-hook waited for its own bucket only: the later layers' gathers still pending.
        assert [flight for _, flight, _ in out["forward"]] == [DEPTH - 1 - i for i in range(DEPTH)], out["forward"]
        assert max(err for _, _, err in out["forward"]) < 1e-6, f"rank {rank}: a layer read stale weights"
        assert out["after_forward"] == 0
        assert out["state_dict_in_flight"] == 0 and out["state_dict_err"] < 1e-6
        assert out["segments_in_flight"] == 0 and out["segments_err"] < 1e-6
        assert out["final_err"] < 1e-6


def test_overlap_param_gather_is_a_config_key_on_by_default():
    from tests.test_config import _resolve_fast

    assert _resolve_fast([]).job.parallel.overlap_param_gather is True
    assert _resolve_fast(["parallel.overlap_param_gather=false"]).job.parallel.overlap_param_gather is False
