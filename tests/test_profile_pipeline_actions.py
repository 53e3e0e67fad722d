"""``scripts/profile_pipeline_actions.py``'s bookkeeping: the plain 1F1B (the benchmark's base) is kept apart from
the split-drain 1F1B under the benchmark's own names, and the breakdown's parts add up to B + W - full B."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from profile_pipeline_actions import _PARTS, _breakdown, _layout  # noqa: E402


@pytest.mark.parametrize("schedule,split_drain", [("1f1b", False), ("1f1b", True), ("zb_h1", False), ("zbv", False)])
def test_layout_names_follow_the_benchmark(schedule, split_drain):
    engine = SimpleNamespace(schedule_name=schedule, split_drain=split_drain)
    # bench_pipeline_group's system name less "ours " (and a v > 1 suffix): the rows its ratio reads
    want = schedule + (" plain" if schedule == "1f1b" and not split_drain else "")
    assert _layout(engine) == want


def test_breakdown_adds_up_to_the_excess():
    gen = random.Random(0)
    for _ in range(100):
        full, b, w = ([gen.uniform(0, 1e-2) for _ in _PARTS] for _ in range(3))
        parts = _breakdown(full, b, w)
        assert sum(parts.values()) == pytest.approx(b[0] + w[0] - full[0], abs=1e-12)


def test_instrumentation_wraps_the_split_paths_own_calls(monkeypatch):
    """``_instrument`` replaces what the ranks' split path calls (the weight GEMMs, W's accumulation, the
    backward, StepRun's computations; a name the code no longer has would kill every rank at import), and a
    W through the wrapped accumulation still leaves a plain backward's gradient."""
    import torch

    import parallel3d.deferred_grads as deferred_grads
    import parallel3d.pipeline.engine as engine_mod
    import parallel3d.pipeline.step_run as step_run
    import parallel3d.tensor_parallel.deferrable_linear as deferrable_linear
    from parallel3d.param_meta import set_meta
    from profile_pipeline_actions import _instrument

    wrapped = [(deferrable_linear, "linear_weight_grads"), (deferred_grads, "accumulate_each"),
               (torch.autograd, "backward"), (engine_mod.PipelineEngine, "run_step"),
               *((step_run.StepRun, name) for name in ("forward", "backward", "weight_grad"))]
    before = {}
    for owner, name in wrapped:
        before[owner, name] = getattr(owner, name)
        monkeypatch.setattr(owner, name, before[owner, name])  # put back after the test
    _instrument()
    assert all(getattr(owner, name) is not before[owner, name] for owner, name in wrapped)
    w = set_meta(torch.nn.Parameter(torch.randn(3, 4)), wgrad_deferrable=True)
    b = set_meta(torch.nn.Parameter(torch.randn(3)), wgrad_deferrable=True)
    x = torch.randn(2, 4, requires_grad=True)
    deferrable_linear.deferrable_linear(x, w, b, None).tanh().sum().backward()
    want = (w.grad.clone(), b.grad.clone())
    w.grad = b.grad = None
    deferral = deferred_grads.WeightGradDeferral()
    with deferral.collecting() as work:
        deferrable_linear.deferrable_linear(x, w, b, deferral).tanh().sum().backward(inputs=[x])
    work.run()
    assert torch.equal(w.grad, want[0]) and torch.equal(b.grad, want[1])
