"""The fused kernels' saved tensors on meta, so the dry run counts what the job's GPU kernels keep.

On the meta device ``kernels.dispatch`` picks the torch reference ops (Triton runs on CUDA only),
whose autograd saves more than the fused kernels the job runs on its accelerator: RMSNorm keeps
fp32 copies of its input and its normalised output (8 bytes per element instead of the input's 2),
SwiGLU keeps ``silu(gate)`` too, rotary keeps its inputs' halves, and attention's grouped-query
heads are repeated before the kernel, and the full-vocabulary cross entropy keeps an fp32
log-softmax. ``fused_kernels_on_meta`` routes meta calls of
``dispatch.rms_norm``, ``layer_norm``, ``swiglu`` and ``apply_rope`` to autograd functions that save
exactly what ``kernels.rmsnorm`` / ``layernorm`` / ``swiglu`` / ``rope`` save (the input and fp32
per-row statistics; gate and up; cos and sin), ``cross_entropy`` to the kernels' own sharded cross
entropy over one shard (its torch branch saves what the Triton one does: the logits in their dtype and
fp32 per-row statistics), and attention to one that saves q, k and v at their
own (unrepeated) size, the output and the per-head log-sum-exp, as a flash kernel with native GQA
does. The values are meta (none exist); gradients have the inputs' shapes and dtypes.
Invariant: calls with any non-meta tensor run unchanged, and every function is restored on exit.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from kernels import dispatch
from parallel3d.dryrun.fake_world import runs_on_nccl

__all__ = ["fused_kernels_on_meta", "job_runs_fused_kernels"]


def job_runs_fused_kernels(backend: str, device: str) -> bool:
    """Whether the job's kernels are the fused ones: any backend but ``torch``, on the accelerator
    (``fake_world.runs_on_nccl``: not pinned to the CPU, where ``auto`` means the torch reference ops;
    a dry run of a cluster job happens on a machine without the accelerator, so ``auto`` counts as it)."""
    return backend != "torch" and runs_on_nccl(device)


class _Norm(torch.autograd.Function):
    """RMSNorm (``stats=1``: rstd) or LayerNorm (``stats=2``: mean, rstd): input and fp32 row stats."""

    @staticmethod
    def forward(ctx, x, weight, bias, stats: int):
        rows = x.reshape(-1, x.shape[-1])  # a view: the kernels keep the input's own storage
        kept = [x.new_empty(rows.shape[0], dtype=torch.float32) for _ in range(stats)]
        ctx.save_for_backward(rows, weight, *kept)
        ctx.shape, ctx.has_bias = x.shape, bias is not None
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        rows, weight = ctx.saved_tensors[:2]
        dbias = torch.empty_like(weight) if ctx.has_bias else None
        return rows.new_empty(ctx.shape), torch.empty_like(weight), dbias, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return torch.empty_like(gate)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return torch.empty_like(gate), torch.empty_like(up)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.shapes = (q.shape, q.dtype, k.shape, k.dtype)
        return torch.empty_like(q), torch.empty_like(k)

    @staticmethod
    def backward(ctx, dq, dk):
        qs, qt, ks, kt = ctx.shapes
        cos = ctx.saved_tensors[0]
        return (torch.empty(qs, dtype=qt, device=cos.device), torch.empty(ks, dtype=kt, device=cos.device),
                None, None)


class _Attention(torch.autograd.Function):
    """Causal flash attention with native grouped-query heads: q, k, v, the output, fp32 lse per head."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        # [b, h, s, d] over [b, s, h, d] storage, as flash returns it: the caller's transpose and
        # reshape back to [b, s, h*d] is then a view, not a second copy the out-projection keeps
        out = q.new_empty(*q.shape[:-3], q.shape[-2], q.shape[-3], v.shape[-1]).transpose(-3, -2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _on_meta(*tensors) -> bool:
    return all(t is None or t.device.type == "meta" for t in tensors)


def _route(original: Callable, fused: Callable, inputs: int) -> Callable:
    """``original`` with calls whose first ``inputs`` arguments are all meta sent to ``fused``."""

    @functools.wraps(original)
    def routed(*args, **kwargs):
        return fused(*args, **kwargs) if _on_meta(*args[:inputs]) else original(*args, **kwargs)

    return routed


def _rms(x, weight, eps=1e-6, backend="auto"):
    return _Norm.apply(x, weight, None, 1)


def _layer(x, weight, bias, eps=1e-5, backend="auto"):
    return _Norm.apply(x, weight, bias, 2)


def _swiglu(gate, up, backend="auto"):
    return _SwiGLU.apply(gate, up)


def _rope(q, k, cos, sin, backend="auto"):
    return _RoPE.apply(q, k, cos, sin)


def _cross_entropy(logits, targets, ignore_index=-100, backend="auto", *, label_smoothing=0.0):
    """The fused full-vocabulary cross entropy is the vocab-sharded one over a single shard: it keeps
    the logits in their dtype and fp32 per-row statistics (``kernels.cross_entropy.cross_entropy``)."""
    v = logits.shape[-1]
    rows = dispatch.vocab_sharded_cross_entropy(
        logits.reshape(-1, v), targets.reshape(-1), vocab_start=0, vocab_size=v, all_reduce_max=_same,
        all_reduce_sum=_same, ignore_index=ignore_index, label_smoothing=label_smoothing, backend="torch")
    return rows.sum() / (targets.reshape(-1) != ignore_index).sum()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _sdpa(original: Callable) -> Callable:
    @functools.wraps(original)
    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if _on_meta(query, key, value) and attn_mask is None and not dropout_p:
            return _Attention.apply(query, key, value, is_causal)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    return routed


@contextmanager
def fused_kernels_on_meta() -> Iterator[None]:
    """Inside: meta calls of the fused ops and of attention save what the fused kernels save (module
    doc). Module attributes are replaced for the duration, not a thread-local mode: full recompute
    re-runs the forward inside backward, where the recomputed tensors must match the forward's."""
    swaps = [(dispatch, "rms_norm", _route(dispatch.rms_norm, _rms, 1)),
             (dispatch, "layer_norm", _route(dispatch.layer_norm, _layer, 1)),
             (dispatch, "swiglu", _route(dispatch.swiglu, _swiglu, 2)),
             (dispatch, "apply_rope", _route(dispatch.apply_rope, _rope, 2)),
             (dispatch, "cross_entropy", _route(dispatch.cross_entropy, _cross_entropy, 1)),
             (F, "scaled_dot_product_attention", _sdpa(F.scaled_dot_product_attention))]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, fn in swaps:
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
