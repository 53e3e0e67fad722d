"""Attention on meta tensors as a fused kernel, so the dry run's activation count matches the job's.

On the meta device ``F.scaled_dot_product_attention`` falls back to its math form, which saves
the ``s x s`` attention probabilities for backward; the real job's fused kernels (flash on GPU,
flash-for-CPU on CPU) save only the output and its log-sum-exp. ``FusedAttentionOnMeta`` routes
meta calls without a mask or dropout to ``_scaled_dot_product_flash_attention_for_cpu`` (it has a
meta kernel and autograd), so what autograd saves is a fused kernel's. Grouped-query calls repeat
the kv heads first (saved as the repeated copies: a slight over-count of k and v).
Invariant: calls with any non-meta tensor run unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class FusedAttentionOnMeta(TorchFunctionMode):
    """``with FusedAttentionOnMeta():`` meta attention saves what a fused kernel saves (module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            routed = self._fused(*args, **kwargs)
            if routed is not None:
                return routed
        return func(*args, **kwargs)

    @staticmethod
    def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False) -> torch.Tensor | None:
        if query.device.type != "meta" or attn_mask is not None or dropout_p:
            return None
        repeat = query.shape[-3] // key.shape[-3]
        if repeat > 1 and enable_gqa:
            key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
        return _flash(query, key, value, 0.0, is_causal, scale=scale)[0]
