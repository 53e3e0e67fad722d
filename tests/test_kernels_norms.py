"""RMSNorm and LayerNorm Triton kernels (run by Triton's interpreter on CPU) vs float64 torch.

Every case checks the forward output and every gradient (x, weight, bias) against the torch
reference evaluated in float64 on the same inputs. Shapes are awkward on purpose: a single
row, non-power-of-two widths, more rows than reduction programs (partial dw sums), and
rows longer than one block (``block_size`` forces the multi-block path).
"""

from __future__ import annotations

import pytest
import torch

from kernels.testing import run_interpreted

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (rows shape, hidden, block_size): block_size < hidden runs the several-blocks-per-row path.
SHAPES = [((1,), 7, None), ((3, 5), 37, None), ((2, 3), 100, 32), ((11,), 64, None)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _norm_case(kind: str, lead: tuple, n: int, block: int | None, dtype: torch.dtype, seed: int) -> dict:
    from kernels.layernorm import layer_norm, layer_norm_reference
    from kernels.rmsnorm import rms_norm, rms_norm_reference

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n, generator=g).mul(2).add(0.5).to(dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(*lead, n, generator=g).to(dtype)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    if kind == "rms":
        y, inputs = rms_norm(x, w, 1e-6, block_size=block), (x, w)
        y_ref, ref_inputs = rms_norm_reference(x64, w64, 1e-6), (x64, w64)
    else:
        y, inputs = layer_norm(x, w, b, 1e-5, block_size=block), (x, w, b)
        y_ref, ref_inputs = layer_norm_reference(x64, w64, b64, 1e-5), (x64, w64, b64)
    grads = torch.autograd.grad(y, inputs, dy)
    ref_grads = torch.autograd.grad(y_ref, ref_inputs, dy.double())
    errors = {"y": rel_err(y, y_ref)}
    for name, got, want in zip(("dx", "dw", "db"), grads, ref_grads):
        assert got.dtype == dtype and got.shape == want.shape, (name, got.dtype, got.shape)
        errors[name] = rel_err(got, want)
    assert y.dtype == dtype and y.shape == x.shape
    return errors


def _layer_norm_without_bias(seed: int) -> dict:
    from kernels.layernorm import layer_norm

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 24, generator=g, requires_grad=True)
    w = torch.randn(24, generator=g, requires_grad=True)
    y = layer_norm(x, w, None)
    gx, gw = torch.autograd.grad(y.square().sum(), (x, w))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = torch.nn.functional.layer_norm(x64, (24,), w64, None, 1e-5)
    rx, rw = torch.autograd.grad(y64.square().sum(), (x64, w64))
    return {"y": rel_err(y, y64), "dx": rel_err(gx, rx), "dw": rel_err(gw, rw)}


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_norm_matches_float64_reference(kind: str, dtype: torch.dtype) -> None:
    for i, (lead, n, block) in enumerate(SHAPES):
        errors = run_interpreted(_norm_case, kind, lead, n, block, dtype, seed=100 + i)
        bad = {k: v for k, v in errors.items() if not v < TOL[dtype]}
        assert not bad, f"{kind} norm {dtype} x{lead + (n,)} block={block}: rel errors {bad} >= {TOL[dtype]}"


def test_layer_norm_without_bias() -> None:
    errors = run_interpreted(_layer_norm_without_bias, seed=7)
    assert all(v < 1e-5 for v in errors.values()), errors


def test_norm_shape_errors_name_the_argument() -> None:
    from kernels.layernorm import layer_norm
    from kernels.rmsnorm import rms_norm

    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight shape \(7,\)"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match=r"bias shape \(9,\)"):
        layer_norm(x, torch.ones(8), torch.zeros(9))
    with pytest.raises(ValueError, match="block_size=12 must be a power of two"):
        rms_norm(x, torch.ones(8), block_size=12)
