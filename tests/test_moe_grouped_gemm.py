"""Grouped GEMM: every backend equals the loop over experts, forward and backward, fp32 and bf16,
with experts that receive no rows; the Triton kernel runs in the interpreter; the pipeline's
split backward runs only the input-gradient GEMM in B and only the weight-gradient GEMMs in W.

Shapes, group counts and sizes (including zeros, and all rows in one group) are generated.
The independent reference is per-group ``F.linear`` in float64.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import run_interpreted
from parallel3d.moe import grouped_gemm
from parallel3d.moe.grouped_gemm import grouped_linear, resolve_backend
from tests.moe_cases import poisoned_empty

TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _case(seed: int, aligned: bool) -> tuple[list[int], int, int]:
    rng = random.Random(seed)
    groups = rng.randint(1, 6)
    sizes = [rng.choice([0, 0, 1, 3, 7, 17]) for _ in range(groups)]
    if seed % 5 == 0:
        sizes = [0] * groups
        sizes[rng.randrange(groups)] = 9  # every row in one group
    dims = [8, 16, 24] if aligned else [3, 5, 12]
    return sizes, rng.choice(dims), rng.choice(dims)


def _tensors(sizes: list[int], k: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=g).to(dtype)
    weights = [torch.randn(n, k, generator=g).to(dtype) for _ in sizes]
    cot = torch.randn(sum(sizes), n, generator=g).to(dtype)
    return x, weights, cot


def _run(backend: str, sizes, x, weights, cot):
    x = x.clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in weights]
    y = grouped_linear(x, ws, sizes, backend)
    (y.float() * cot.float()).sum().backward()
    return [y.detach(), x.grad] + [w.grad for w in ws]


def _reference(sizes, x, weights, cot):
    """Per-group F.linear in float64."""
    x = x.double().requires_grad_(True)
    ws = [w.double().requires_grad_(True) for w in weights]
    parts, start = [], 0
    for size, w in zip(sizes, ws):
        parts.append(F.linear(x[start:start + size], w))
        start += size
    y = torch.cat(parts) if parts else x.new_zeros(0, weights[0].shape[0])
    (y * cot.double()).sum().backward()
    return [y.detach(), x.grad] + [w.grad for w in ws]


def _assert_close(got, want, tol: float, what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (what, i)
        assert torch.isfinite(a).all(), f"{what}: tensor {i} has non-finite values"
        scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
        err = (a.double() - b.double()).abs().max().item() if b.numel() else 0.0
        assert err <= tol * scale, f"{what}: tensor {i} off by {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_backends_equal_float64_reference(backend: str, dtype: torch.dtype) -> None:
    """Under NaN-poisoned allocation: a row or weight gradient left unwritten shows up as NaN."""
    for seed in range(12):
        sizes, k, n = _case(seed, aligned=True)
        x, weights, cot = _tensors(sizes, k, n, dtype, seed)
        with poisoned_empty():
            got = _run(backend, sizes, x, weights, cot)
        _assert_close(got, _reference(sizes, x, weights, cot), TOL[dtype],
                      f"{backend} {dtype} case {seed} sizes={sizes} k={k} n={n}")


def test_auto_falls_back_to_the_loop_when_grouped_mm_cannot_take_the_shapes(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(4, 5)
    assert resolve_backend("auto", x, torch.zeros(3, 5)) == "loop"  # 5 fp32 = 20 bytes: not 16-byte aligned
    assert resolve_backend("auto", torch.zeros(4, 8), torch.zeros(4, 8)) == "grouped_mm"
    f64 = torch.zeros(4, 8, dtype=torch.float64)
    assert resolve_backend("auto", f64, f64) == "loop"
    for seed in range(6):
        sizes, k, n = _case(seed, aligned=False)
        x, weights, cot = _tensors(sizes, k, n, torch.float32, seed)
        _assert_close(_run("auto", sizes, x, weights, cot), _reference(sizes, x, weights, cot), 2e-6, f"auto {seed}")


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match=r"group sizes \[2, 2\] must be >= 0 and sum to the 3 rows"):
        grouped_linear(torch.zeros(3, 4), [torch.zeros(4, 4)] * 2, [2, 2])
    with pytest.raises(ValueError, match="moe.gemm_backend='cublas': allowed auto, grouped_mm, triton, loop"):
        grouped_linear(torch.zeros(3, 4), [torch.zeros(4, 4)], [3], backend="cublas")


def _triton_vs_loop(dtype_name: str, seeds: list[int]) -> list[tuple[str, float, float]]:
    """Runs in the interpreter worker: Triton backend and loop on the same tensors, small blocks."""
    import kernels.grouped_gemm as kg

    saved, kg.DEFAULT_BLOCKS = kg.DEFAULT_BLOCKS, (16, 16, 16)  # several tiles per group and K steps here
    try:
        return _compare_triton(dtype_name, seeds)
    finally:
        kg.DEFAULT_BLOCKS = saved


def _compare_triton(dtype_name: str, seeds: list[int]) -> list[tuple[str, float, float]]:
    dtype = getattr(torch, dtype_name)
    out = []
    for seed in seeds:
        for aligned in (True, False):
            sizes, k, n = _case(seed, aligned)
            k, n = k + 17, n + 9  # past one block
            x, weights, cot = _tensors(sizes, k, n, dtype, seed)
            with poisoned_empty():
                got = _run("triton", sizes, x, weights, cot)
            want = _reference(sizes, x, weights, cot)
            for i, (a, b) in enumerate(zip(got, want)):
                scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
                err = (a.double() - b).abs().max().item() if b.numel() else 0.0
                finite = bool(torch.isfinite(a).all())
                out.append((f"seed {seed} aligned={aligned} sizes={sizes} tensor {i}", err / scale, float(finite)))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernel_equals_reference_in_interpreter(dtype: str) -> None:
    tol = TOL[getattr(torch, dtype)]
    for what, err, finite in run_interpreted(_triton_vs_loop, dtype, [0, 1, 5], timeout=300):
        assert finite == 1.0 and err <= tol, f"triton {dtype} {what}: relative error {err:.3g}"


@pytest.mark.parametrize("layout", ["back_to_back", "interleaved", "reversed"])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_weights_sharing_one_storage_equal_the_reference(backend: str, layout: str) -> None:
    """Weights that are slots of one block (``GroupedExperts``: read as a view, no copy) and weights that share
    a storage out of order (e.g. a flat ZeRO buffer holding w1, w3 of each expert in turn): both exact."""
    for seed in range(6):
        sizes, k, n = _case(seed, aligned=True)
        x, weights, cot = _tensors(sizes, k, n, torch.float32, seed)
        g = len(sizes)
        block = torch.randn(2 * g, n, k)
        slots = {"back_to_back": range(g), "interleaved": range(0, 2 * g, 2), "reversed": range(g - 1, -1, -1)}[layout]
        ws = [torch.nn.Parameter(block[i]) for i in slots]  # views of one storage
        xg = x.clone().requires_grad_(True)
        (grouped_linear(xg, ws, sizes, backend) * cot).sum().backward()
        got = [grouped_linear(x, ws, sizes, backend).detach(), xg.grad] + [w.grad for w in ws]
        _assert_close(got, _reference(sizes, x, [w.detach() for w in ws], cot), 2e-6, f"{backend} {layout} {seed}")


def test_grouped_experts_weights_are_read_without_a_copy() -> None:
    """``GroupedExperts`` lays each weight kind of its experts back to back: the GEMM's stack is a view."""
    from parallel3d.moe.experts import GroupedExperts
    from parallel3d.moe.grouped_gemm import stacked_weights

    experts = GroupedExperts(8, 16, 32, first=2, num_local=4, prefix="m", etp_rank=1, etp_size=2)
    for kind in ("w1", "w3", "w2"):
        ws = [getattr(m, kind) for m in experts.values()]
        stacked = stacked_weights(ws)
        assert stacked.data_ptr() == ws[0].data_ptr() and torch.equal(stacked, torch.stack(ws)), kind
