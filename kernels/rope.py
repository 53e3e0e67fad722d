"""Rotary position embedding on q and k (HF Llama "rotate half" convention).

Shapes: ``q [b, s, hq, d]``, ``k [b, s, hk, d]`` (d even; any float dtype; the last dim must
be contiguous, other strides are free, so views of a fused qkv projection work without a
copy), ``cos``/``sin [s, d/2]``. With ``x1 = x[..., :d/2]``, ``x2 = x[..., d/2:]``:
``out = (x1*cos - x2*sin, x2*cos + x1*sin)``, computed in fp32 and stored in x's dtype.
One program per token rotates all heads of q and k. The backward is the inverse rotation
(sin -> -sin) of the incoming gradients; cos/sin are constants (no gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import apply_rope_reference  # noqa: F401 (re-exported)
from kernels.runtime import next_power_of_2


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, QO, KO, S, HQ, HK, HALF,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh, cos_s, sin_s,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, INVERSE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b = token // S
    t = token % S
    dims = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(COS + t * cos_s + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * sin_s + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    # q heads, then k heads: one launch for both keeps cos/sin loaded once per token.
    _rotate_heads(Q + b * q_sb + t * q_ss, QO + b * qo_sb + t * qo_ss, q_sh, qo_sh, HQ, HALF, c, s, dims, BLOCK_HQ)
    _rotate_heads(K + b * k_sb + t * k_ss, KO + b * ko_sb + t * ko_ss, k_sh, ko_sh, HK, HALF, c, s, dims, BLOCK_HK)


@triton.jit
def _rotate_heads(SRC, DST, src_sh, dst_sh, H, HALF, c, s, dims, BLOCK_H: tl.constexpr):
    """Rotate the ``H`` heads of one token: ``SRC``/``DST`` point at its first head."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < H) & (dims < HALF)
    src = SRC + heads * src_sh + dims
    dst = DST + heads * dst_sh + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * c - x2 * s).to(DST.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(DST.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rotate(q, k, cos, sin, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
    b, s, hq, d = q.shape
    hk = k.shape[2]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = d // 2
    block_d = next_power_of_2(half)
    if b * s > 0:
        _rope_kernel[(b * s,)](
            q, k, cos, sin, qo, ko, s, hq, hk, half,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
            cos.stride(0), sin.stride(0),
            BLOCK_HQ=next_power_of_2(hq), BLOCK_HK=next_power_of_2(hk), BLOCK_D=block_d, INVERSE=inverse,
            num_warps=4 if next_power_of_2(max(hq, hk)) * block_d <= 4096 else 8,
        )
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.q_shape, ctx.q_dtype = q.shape, q.dtype
        ctx.k_shape, ctx.k_dtype = k.shape, k.dtype
        return _rotate(q, k, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        # An output that did not reach the loss arrives as None: its gradient is zero.
        dq = torch.zeros(ctx.q_shape, dtype=ctx.q_dtype, device=cos.device) if dq is None else dq
        dk = torch.zeros(ctx.k_shape, dtype=ctx.k_dtype, device=cos.device) if dk is None else dk
        gq, gk = _rotate(dq, dk, cos, sin, inverse=True)
        return gq, gk, None, None


def check_rope_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be [b, s, heads, d], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must share b, s and d")
    d = q.shape[-1]
    if d % 2:
        raise ValueError(f"apply_rope: head dim d={d} must be even")
    want = (q.shape[1], d // 2)
    for key, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(f"apply_rope: {key} shape {tuple(t.shape)} must be [s, d/2] = {want}")


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton RoPE returning new ``(q_rot, k_rot)`` (differentiable in q and k); see module doc."""
    check_rope_args(q, k, cos, sin)
    return RoPEFunction.apply(q, k, cos, sin)
