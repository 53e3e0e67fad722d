"""Fused AdamW step on flat buffers (the ZeRO optimizer's fp32 shards), one launch per buffer.

``adamw_step`` updates ``param``, ``exp_avg`` and ``exp_avg_sq`` in place, exactly as
``torch.optim.AdamW`` (decoupled weight decay, bias correction, no amsgrad):

    p  <- p * (1 - lr * wd)
    m  <- b1 * m + (1 - b1) * g
    v  <- b2 * v + (1 - b2) * g^2
    p  <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Invariants: ``param``, ``exp_avg``, ``exp_avg_sq`` are contiguous fp32 tensors of one
numel (views of a flat buffer are fine); ``grad`` has that numel in fp32, bf16 or fp16;
``step`` is the 1-based step count after this update. ``model_param_out`` (optional,
bf16/fp16/fp32, same numel) receives the updated parameter cast to its dtype in the same
launch, which is how the low-precision model copy is refreshed without another pass.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.runtime import resolve_backend

ADAMW_BLOCK = 1024  # 8 warps x 4 elements per thread: ~40 registers (ptxas -v, sm_90), full occupancy


def _check(param, grad, exp_avg, exp_avg_sq, model_param_out, step: int) -> None:
    n = param.numel()
    for key, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"adamw_step: {key} must be a contiguous fp32 tensor, got {t.dtype} "
                             f"(contiguous={t.is_contiguous()})")
    for key, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("model_param_out", model_param_out)):
        if t is not None and t.numel() != n:
            raise ValueError(f"adamw_step: {key} has {t.numel()} elements, param has {n}")
        if t is not None and t.device != param.device:
            raise ValueError(f"adamw_step: {key} is on {t.device}, param on {param.device}")
    if model_param_out is not None and not model_param_out.is_contiguous():
        raise ValueError("adamw_step: model_param_out must be contiguous")
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"adamw_step: step={step!r} must be an int >= 1 (the count after this update)")


def adamw_step_reference(
    param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, model_param_out=None
) -> None:
    """The same update with torch ops, in place (fp32 math), in ``torch.optim.AdamW``'s order of
    operations (``lerp`` for the first moment), so it matches torch element for element."""
    g = grad.float()
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
    if model_param_out is not None:
        model_param_out.copy_(param.view_as(model_param_out))


@triton.jit
def _adamw_kernel(
    P, G, M, V, P_OUT, n, lr, beta1, beta2, eps, decay_factor, step_size, inv_sqrt_bc2,
    BLOCK: tl.constexpr, WRITE_OUT: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = p * decay_factor
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    if WRITE_OUT:
        tl.store(P_OUT + offs, p.to(P_OUT.dtype.element_ty), mask=mask)


def adamw_step_triton(
    param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, model_param_out=None,
    block_size: int | None = None,
) -> None:
    n = param.numel()
    block = block_size or ADAMW_BLOCK
    grad = grad.contiguous()
    if n:
        _adamw_kernel[(triton.cdiv(n, block),)](
            param, grad, exp_avg, exp_avg_sq, model_param_out if model_param_out is not None else param, n,
            lr, beta1, beta2, eps, 1.0 - lr * weight_decay, lr / (1.0 - beta1**step),
            1.0 / math.sqrt(1.0 - beta2**step), BLOCK=block, WRITE_OUT=model_param_out is not None, num_warps=8,
        )


def adamw_step_apex(
    param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, model_param_out=None
) -> None:
    """apex's multi-tensor Adam kernel in AdamW mode on the one buffer."""
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    overflow = torch.zeros(1, dtype=torch.int, device=param.device)
    adam_w_mode, bias_correction = 1, 1
    multi_tensor_applier(
        amp_C.multi_tensor_adam, overflow, [[grad.float()], [param], [exp_avg], [exp_avg_sq]],
        lr, beta1, beta2, eps, step, adam_w_mode, bias_correction, weight_decay,
    )
    if model_param_out is not None:
        model_param_out.copy_(param.view_as(model_param_out))


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    step: int,
    model_param_out: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """One in-place AdamW update of a flat fp32 buffer; see the module docstring.

    ``backend``: ``auto`` (Triton on CUDA or under TRITON_INTERPRET=1, else torch),
    ``triton``, ``apex`` (apex's fused multi-tensor Adam) or ``torch``.
    """
    _check(param, grad, exp_avg, exp_avg_sq, model_param_out, step)
    kwargs = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                  model_param_out=model_param_out)
    chosen = resolve_backend(backend, "adamw_step", param, apex_has_op=True)
    if chosen == "triton":
        adamw_step_triton(param, grad, exp_avg, exp_avg_sq, **kwargs)
    elif chosen == "apex":
        adamw_step_apex(param, grad, exp_avg, exp_avg_sq, **kwargs)
    else:
        adamw_step_reference(param, grad, exp_avg, exp_avg_sq, **kwargs)


def adamw_flat_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    backend: str = "auto",
) -> None:
    """The flat update ``parallel3d.zero.adamw`` looks up: Adam without weight decay.

    The ZeRO optimizer applies the decoupled decay itself (only to the decayed ranges of a
    shard), so this is :func:`adamw_step` with ``weight_decay=0``.
    """
    adamw_step(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=0.0,
               step=step, backend=backend)
