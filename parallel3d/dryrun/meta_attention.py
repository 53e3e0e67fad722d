"""Attention on meta tensors as a fused kernel, so the dry run's activation count matches the job's.

On the meta device ``F.scaled_dot_product_attention`` falls back to its math form, which saves
the ``s x s`` attention probabilities for backward; the real job's fused kernels (flash on GPU,
flash-for-CPU on CPU) save only the output and its log-sum-exp. ``fused_attention_on_meta`` routes
meta calls without a mask or dropout to ``_scaled_dot_product_flash_attention_for_cpu`` (it has a
meta kernel and autograd), so what autograd saves is a fused kernel's. Grouped-query calls keep the
kv heads unrepeated (the kernel reads them so on meta as on CPU, and saves them so). Latent
attention's narrower value heads
(``models.mla``: v_head_dim < the q/k width) are padded to the q/k width for the kernel, which
takes one head size, and the output sliced back (an over-count of v and the output).
``block_attention_on_meta`` does the same for context parallelism's blocks (``context_parallel.block_compute``'s
math path, which meta tensors take): a block's ``(out, lse)`` and ``(dq, dk, dv)`` only flow into the caller's fp32
accumulators inside the variants' autograd Functions (nothing of a block is saved), so on meta only their shapes and
dtypes matter, and those come without the ~20 meta operators per block (softmax, masks, einsums in torch's Python
reference kernels: two thirds of a cp job's dry run, e.g. 1,024-rank Llama 3 405B at cp 4).
Invariant: calls with any non-meta tensor run unchanged.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from kernels.attention_math import compute_dtype
from parallel3d.context_parallel import block_compute

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
           enable_gqa=False) -> torch.Tensor | None:
    if query.device.type != "meta" or attn_mask is not None or dropout_p:
        return None
    # Grouped-query calls pass the kv heads unrepeated, as the real CPU kernel takes them (it keeps them
    # so for backward; repeating them here once over-counted k and v by the group size).
    dv = value.shape[-1]
    if dv != query.shape[-1]:  # latent attention (value heads narrower than query heads): pad, then slice
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - dv))
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return _flash(query, key, value, 0.0, is_causal, scale=scale)[0][..., :dv]
    return _flash(query, key, value, 0.0, is_causal, scale=scale)[0]


@contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """Inside: meta attention saves what a fused kernel saves (module doc). It replaces
    ``F.scaled_dot_product_attention`` for the duration (restored after), not a thread-local
    mode: full recompute re-runs the forward inside backward, where a mode may not be active,
    and the recomputed tensors must match the forward's."""
    original = F.scaled_dot_product_attention

    @functools.wraps(original)
    def routed(*args, **kwargs):
        out = _fused(*args, **kwargs)
        return original(*args, **kwargs) if out is None else out

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                   allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_forward_math``'s ``(out [b, hq, sq, dv], lse [b, hq, sq])``, shapes and dtype only."""
    b, hq, sq, _ = q.shape
    ct = compute_dtype(q.dtype)
    return q.new_empty((b, hq, sq, v.shape[-1]), dtype=ct), q.new_empty((b, hq, sq), dtype=ct)


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, *, scale: float,
                    allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_backward_math``'s ``(dq, dk, dv)``, shapes and dtype only."""
    ct = compute_dtype(q.dtype)
    return q.new_empty(q.shape, dtype=ct), k.new_empty(k.shape, dtype=ct), v.new_empty(v.shape, dtype=ct)


def _on_meta_only(original: Callable[..., Any], shapes: Callable[..., Any]) -> Callable[..., Any]:
    """``shapes`` where the first tensor is on meta, else ``original``."""
    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        return shapes(*args, **kwargs) if args[0].device.type == "meta" else original(*args, **kwargs)
    return routed


@contextmanager
def block_attention_on_meta() -> Iterator[None]:
    """Inside: context parallelism's math blocks on meta tensors give their results' shapes without computing them
    (module doc); restored after, and patched, not a mode, for full recompute's sake (``fused_attention_on_meta``)."""
    forward, backward = block_compute.attention_forward_math, block_compute.attention_backward_math
    block_compute.attention_forward_math = _on_meta_only(forward, _block_forward)
    block_compute.attention_backward_math = _on_meta_only(backward, _block_backward)
    try:
        yield
    finally:
        block_compute.attention_forward_math, block_compute.attention_backward_math = forward, backward
