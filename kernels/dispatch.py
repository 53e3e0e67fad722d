"""One entry point per fused op; picks Triton, apex or the torch reference per call.

Conventions (shared by every backend):
- ``rms_norm(x, weight, eps)`` / ``layer_norm(x, weight, bias, eps)``: normalise the last dim.
- ``apply_rope(q, k, cos, sin)``: q ``[b, s, hq, d]``, k ``[b, s, hk, d]``, cos/sin ``[s, d/2]``;
  the "rotate half" convention of HF Llama: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``
  with ``x1 = x[..., :d/2]``, ``x2 = x[..., d/2:]``. Returns ``(q_rot, k_rot)``.
- ``swiglu(gate, up) = silu(gate) * up``.
- ``cross_entropy(logits, targets, ignore_index=-100)``: mean over non-ignored tokens (fp32).
- ``vocab_sharded_cross_entropy(...)``: per-row loss over a tensor-parallel vocab shard.
- ``adamw_step(...)``: in-place AdamW on flat fp32 buffers (``kernels.adamw``).

``backend`` (``kernels.backend``): ``auto`` = Triton on CUDA tensors or under
``TRITON_INTERPRET=1`` (set before triton is imported), else the torch reference;
``triton``; ``apex`` (apex's fused norms and Adam; ops apex lacks use the ``auto`` choice);
``torch``. Choosing a backend that cannot run raises ``BackendUnavailableError``; an unknown
name raises ``ValueError``. The choice is always an argument: nothing here is module state.
Kernel modules are imported on first use, so the torch paths of the norm, RoPE, SwiGLU and
full-vocab cross-entropy functions never import triton.
"""

from __future__ import annotations

import torch

from kernels.reference import apply_rope_reference, layer_norm_reference, rms_norm_reference, swiglu_reference
from kernels.runtime import BackendUnavailableError, resolve_backend

__all__ = [
    "BackendUnavailableError", "rms_norm", "layer_norm", "apply_rope", "swiglu", "cross_entropy",
    "vocab_sharded_cross_entropy", "adamw_step",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str = "auto") -> torch.Tensor:
    chosen = resolve_backend(backend, "rms_norm", x, apex_has_op=True)
    if chosen == "triton":
        from kernels.rmsnorm import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    if chosen == "apex":
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine

        return fused_rms_norm_affine(x, weight, (x.shape[-1],), eps)
    return rms_norm_reference(x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5, backend: str = "auto"
) -> torch.Tensor:
    chosen = resolve_backend(backend, "layer_norm", x, apex_has_op=True)
    if chosen == "triton":
        from kernels.layernorm import layer_norm as triton_layer_norm

        return triton_layer_norm(x, weight, bias, eps)
    if chosen == "apex":
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine

        # apex's affine LayerNorm always adds a bias: a constant zero one stands in for None.
        b = torch.zeros_like(weight) if bias is None else bias
        return fused_layer_norm_affine(x, weight, b, (x.shape[-1],), eps)
    return layer_norm_reference(x, weight, bias, eps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    if resolve_backend(backend, "apply_rope", q) == "triton":
        from kernels.rope import apply_rope as triton_apply_rope

        return triton_apply_rope(q, k, cos, sin)

    return apply_rope_reference(q, k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    if resolve_backend(backend, "swiglu", gate) == "triton":
        from kernels.swiglu import swiglu as triton_swiglu

        return triton_swiglu(gate, up)
    return swiglu_reference(gate, up)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, backend: str = "auto", *,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Mean loss over non-ignored rows of ``logits [..., V]`` (full vocabulary), fp32."""
    if resolve_backend(backend, "cross_entropy", logits) == "triton":
        from kernels.cross_entropy import cross_entropy as triton_cross_entropy

        return triton_cross_entropy(logits, targets, ignore_index, label_smoothing=label_smoothing)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )


def vocab_sharded_cross_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int,
    all_reduce_max, all_reduce_sum, ignore_index: int = -100, label_smoothing: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-row fp32 loss ``[N]`` over this rank's vocab shard; see ``kernels.cross_entropy``.

    ``all_reduce_max``/``all_reduce_sum`` reduce a ``[N]`` fp32 tensor over the tp group and
    return it. The torch backend computes the same statistics with torch ops.
    """
    from kernels.cross_entropy import vocab_sharded_cross_entropy as sharded

    chosen = resolve_backend(backend, "vocab_sharded_cross_entropy", logits_shard)
    return sharded(
        logits_shard, targets, vocab_start=vocab_start, vocab_size=vocab_size, all_reduce_max=all_reduce_max,
        all_reduce_sum=all_reduce_sum, ignore_index=ignore_index, label_smoothing=label_smoothing,
        use_triton=chosen == "triton",
    )


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, **kwargs) -> None:
    """``kernels.adamw.adamw_step`` (keyword arguments, including ``backend``)."""
    from kernels.adamw import adamw_step as fused_adamw_step

    fused_adamw_step(param, grad, exp_avg, exp_avg_sq, **kwargs)
