"""``kernels.dispatch``: backend resolution, clear errors, and Triton == torch through dispatch.

The per-op numerics are in the other test_kernels_* files; here every dispatch entry point
runs once with ``backend="auto"`` inside the Triton interpreter (where auto must pick
Triton) and once with ``backend="torch"``, and the results and gradients must agree.
"""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels.runtime import BackendUnavailableError, resolve_backend
from kernels.testing import run_interpreted


def test_auto_is_torch_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(2)
    assert resolve_backend("auto", "rms_norm", x, apex_has_op=True) == "torch"
    assert resolve_backend("torch", "rms_norm", x) == "torch"
    # apex has no RoPE kernel: "apex" then means the auto choice for that op.
    assert resolve_backend("apex", "apply_rope", x, apex_has_op=False) == "torch"


def test_unavailable_or_unknown_backend_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(3, 4), torch.ones(4)
    with pytest.raises(BackendUnavailableError, match="kernels.backend='triton' cannot run rms_norm on a cpu tensor"):
        dispatch.rms_norm(x, w, 1e-6, backend="triton")
    with pytest.raises(BackendUnavailableError, match="kernels.backend='apex' for layer_norm"):
        dispatch.layer_norm(x, w, None, 1e-5, backend="apex")
    with pytest.raises(ValueError, match="kernels.backend='fast' is not one of auto, triton, apex, torch"):
        dispatch.swiglu(x, x, backend="fast")


def test_interpreter_env_set_after_triton_import_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton  # noqa: F401  (imported here in compiled mode, as in a normal process)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(BackendUnavailableError, match="set TRITON_INTERPRET=1 before the process imports triton"):
        resolve_backend("auto", "swiglu", torch.zeros(2))


def _raise_in_worker() -> None:
    raise ValueError("raised inside the interpreter worker")


def test_worker_errors_keep_their_type() -> None:
    with pytest.raises(ValueError, match="raised inside the interpreter worker"):
        run_interpreted(_raise_in_worker)


def _run_all_ops(backend: str, seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 24, generator=g, requires_grad=True)
    w = torch.randn(24, generator=g, requires_grad=True)
    b = torch.randn(24, generator=g, requires_grad=True)
    q = torch.randn(2, 3, 4, 6, generator=g, requires_grad=True)
    k = torch.randn(2, 3, 2, 6, generator=g, requires_grad=True)
    angles = torch.randn(3, 3, generator=g)
    logits = torch.randn(2, 3, 19, generator=g, requires_grad=True)
    targets = torch.randint(0, 19, (2, 3), generator=g)
    targets[0, 1] = -100
    outs = {
        "rms_norm": dispatch.rms_norm(x, w, 1e-6, backend=backend),
        "layer_norm": dispatch.layer_norm(x, w, b, 1e-5, backend=backend),
        "rope": torch.cat([t.flatten() for t in dispatch.apply_rope(q, k, angles.cos(), angles.sin(), backend=backend)]),
        "swiglu": dispatch.swiglu(x, x.flip(-1), backend=backend),
        "cross_entropy": dispatch.cross_entropy(logits, targets, -100, backend=backend),
    }
    result = {}
    for name, out in outs.items():
        probe = torch.randn(out.shape, generator=g)
        inputs = [t for t in (x, w, b, q, k, logits)]
        grads = torch.autograd.grad((out * probe).sum(), inputs, allow_unused=True)
        result[name] = [out.detach()] + [gr for gr in grads if gr is not None]
    result["chosen"] = resolve_backend(backend, "rms_norm", x)
    return result


def test_dispatch_triton_matches_torch_for_every_op() -> None:
    fused = run_interpreted(_run_all_ops, "auto", seed=9)
    ref = _run_all_ops("torch", seed=9)
    assert fused.pop("chosen") == "triton" and ref.pop("chosen") == "torch"
    for name in ref:
        assert len(fused[name]) == len(ref[name]), name
        for i, (a, b) in enumerate(zip(fused[name], ref[name])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} tensor {i}: {m}")
