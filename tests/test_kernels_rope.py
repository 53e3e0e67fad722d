"""RoPE Triton kernel (Triton interpreter on CPU) vs the float64 eager rotate-half reference.

Checks q_rot, k_rot and both gradients, with grouped-query heads (hq != hk), odd half-dims
(d/2 not a power of two), a single token, q/k that are strided views of one fused qkv
tensor, and a loss that uses only q (k's gradient then arrives as None and must be zero).
"""

from __future__ import annotations

import pytest
import torch

from kernels.testing import run_interpreted

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (batch, seq, q heads, kv heads, head dim)
SHAPES = [(1, 1, 1, 1, 2), (2, 5, 6, 2, 10), (1, 3, 4, 4, 32)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _rope_case(shape: tuple, dtype: torch.dtype, seed: int) -> dict:
    from kernels.rope import apply_rope, apply_rope_reference

    b, s, hq, hk, d = shape
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, hq + 2 * hk, d, generator=g).to(dtype)
    q = qkv[:, :, :hq].detach().requires_grad_()  # strided views, as a fused projection gives
    k = qkv[:, :, hq : hq + hk].detach().requires_grad_()
    angles = torch.rand(s, d // 2, generator=g) * 50
    cos, sin = angles.cos(), angles.sin()
    dq_out, dk_out = torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    gq, gk = torch.autograd.grad((q_rot, k_rot), (q, k), (dq_out, dk_out))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    q_ref, k_ref = apply_rope_reference(q64, k64, cos.double(), sin.double())
    rq, rk = torch.autograd.grad((q_ref, k_ref), (q64, k64), (dq_out.double(), dk_out.double()))
    assert q_rot.dtype == dtype and q_rot.shape == q.shape and k_rot.shape == k.shape
    return {"q": rel_err(q_rot, q_ref), "k": rel_err(k_rot, k_ref), "dq": rel_err(gq, rq), "dk": rel_err(gk, rk)}


def _rope_only_q_used(seed: int) -> tuple[float, float]:
    from kernels.rope import apply_rope, apply_rope_reference

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 2, 6, generator=g, requires_grad=True)
    k = torch.randn(2, 3, 1, 6, generator=g, requires_grad=True)
    angles = torch.randn(3, 3, generator=g)
    q_rot, _ = apply_rope(q, k, angles.cos(), angles.sin())
    gq, gk = torch.autograd.grad(q_rot.square().sum(), (q, k), allow_unused=True)
    q64 = q.detach().double().requires_grad_()
    q_ref, _ = apply_rope_reference(q64, k.detach().double(), angles.cos().double(), angles.sin().double())
    (rq,) = torch.autograd.grad(q_ref.square().sum(), (q64,))
    return rel_err(gq, rq), 0.0 if gk is None else gk.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rope_matches_float64_reference(dtype: torch.dtype) -> None:
    for i, shape in enumerate(SHAPES):
        errors = run_interpreted(_rope_case, shape, dtype, seed=200 + i)
        bad = {k: v for k, v in errors.items() if not v < TOL[dtype]}
        assert not bad, f"rope {dtype} {shape}: rel errors {bad} >= {TOL[dtype]}"


def test_rope_gradient_when_only_q_reaches_the_loss() -> None:
    dq_err, dk_max = run_interpreted(_rope_only_q_used, seed=3)
    assert dq_err < 1e-5 and dk_max == 0.0


def test_rope_shape_errors() -> None:
    from kernels.rope import apply_rope

    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match=r"cos shape \(4, 8\) must be \[s, d/2\] = \(4, 4\)"):
        apply_rope(q, k, torch.randn(4, 8), torch.randn(4, 4))
    with pytest.raises(ValueError, match="d=7 must be even"):
        apply_rope(torch.randn(1, 4, 2, 7), torch.randn(1, 4, 1, 7), torch.randn(4, 3), torch.randn(4, 3))
    with pytest.raises(ValueError, match="must share b, s and d"):
        apply_rope(q, torch.randn(1, 5, 1, 8), torch.randn(4, 4), torch.randn(4, 4))
