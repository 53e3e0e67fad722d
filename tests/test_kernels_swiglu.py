"""SwiGLU Triton kernel (Triton interpreter on CPU) vs float64 ``silu(gate) * up``.

Checks the output and both gradients for sizes that leave a partial last block, a
single element, several blocks, and a 3-d activation; and that forward keeps only the
two inputs for backward (no silu/sigmoid intermediate).
"""

from __future__ import annotations

import pytest
import torch

from kernels.testing import run_interpreted

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SHAPES = [((1,), None), ((3, 37), 16), ((2, 5, 24), None)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _swiglu_case(shape: tuple, block: int | None, dtype: torch.dtype, seed: int) -> dict:
    from kernels.swiglu import swiglu, swiglu_reference

    g = torch.Generator().manual_seed(seed)
    gate = (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_()
    up = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype)
    y = swiglu(gate, up, block_size=block)
    dg, du = torch.autograd.grad(y, (gate, up), dy)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    y64 = swiglu_reference(g64, u64)
    rg, ru = torch.autograd.grad(y64, (g64, u64), dy.double())
    assert y.dtype == dtype and y.shape == gate.shape
    return {"y": rel_err(y, y64), "d_gate": rel_err(dg, rg), "d_up": rel_err(du, ru)}


def _saved_tensors() -> list[int]:
    from kernels.swiglu import swiglu

    gate, up = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    y = swiglu(gate, up)
    return [t.data_ptr() for t in y.grad_fn.saved_tensors] + [gate.data_ptr(), up.data_ptr()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_swiglu_matches_float64_reference(dtype: torch.dtype) -> None:
    for i, (shape, block) in enumerate(SHAPES):
        errors = run_interpreted(_swiglu_case, shape, block, dtype, seed=300 + i)
        bad = {k: v for k, v in errors.items() if not v < TOL[dtype]}
        assert not bad, f"swiglu {dtype} {shape}: rel errors {bad} >= {TOL[dtype]}"


def test_swiglu_saves_only_its_inputs() -> None:
    saved0, saved1, gate_ptr, up_ptr = run_interpreted(_saved_tensors)
    assert (saved0, saved1) == (gate_ptr, up_ptr)


def test_swiglu_mismatched_inputs_error() -> None:
    from kernels.swiglu import swiglu

    with pytest.raises(ValueError, match="must have the same shape"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))
