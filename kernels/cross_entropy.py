"""Cross-entropy over a (possibly vocab-sharded) logits matrix without a softmax tensor.

Shapes: ``logits [N, V_local]`` (any float dtype; row stride free, vocab dim contiguous),
``targets [N]`` int64 global vocab ids (``ignore_index`` rows add nothing). The shard holds
global ids ``[vocab_start, vocab_start + V_local)`` of a ``vocab_size``-wide vocabulary
(tp = 1: ``vocab_start = 0``, ``vocab_size = V_local``). Columns whose global id is
``>= vocab_size`` (tensor-parallel padding of the last shard) count as ``-inf`` logits: they
change no loss and get a zero gradient.

Two kernels, each streaming the logits once in ``BLOCK_V`` chunks, fp32 math:
- ``softmax_stats``: per row, the shard's max ``m``, ``sum_exp = sum exp(x - m)``, the target
  logit (0 when the target is in another shard) and ``sum_logits`` (for label smoothing);
  an online-softmax pass, so no probability is stored beyond one chunk in registers.
- ``cross_entropy_grad``: ``grad = row_scale * (exp(x - lse) - (1 - eps) * onehot - eps / V)``,
  written in the logits dtype; it is the only full-size tensor the op allocates.

Combining shards over the tp group (the reductions ``parallel3d.tensor_parallel``'s
vocab-parallel CE also performs, plus one for label smoothing): ``M = allreduce_max(m)``,
``S = allreduce_sum(sum_exp * exp(m - M))``, ``lse = M + log(S)``,
``target = allreduce_sum(target_logit)``, ``sum_all = allreduce_sum(sum_logits)``; then per row
``loss = (1 - eps) * (lse - target) + eps * (lse - sum_all / vocab_size)``.
:func:`vocab_sharded_cross_entropy` does exactly that given the two all-reduce callables
(at tp = 1 they are identities and it is the plain fused cross-entropy).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.runtime import num_warps_for

CE_BLOCK = 4096
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def cross_entropy_reference(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, *,
    label_smoothing: float = 0.0, reduction: str = "mean",
) -> torch.Tensor:
    """torch's cross-entropy on fp32 logits (the CPU path and the test oracle)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=ignore_index,
        label_smoothing=label_smoothing, reduction=reduction,
    )


class ShardStats(NamedTuple):
    """Per-row fp32 statistics of one vocab shard (all ``[N]``)."""

    max: torch.Tensor
    sum_exp: torch.Tensor  # sum over the shard of exp(x - max)
    target_logit: torch.Tensor  # 0 where the target is ignored or lives in another shard
    sum_logits: torch.Tensor


@triton.jit
def _softmax_stats_kernel(
    LOGITS, TARGETS, MAX, SUM_EXP, TARGET_LOGIT, SUM_LOGITS, stride, V_VALID, vocab_start, ignore_index,
    BLOCK_V: tl.constexpr,
):
    # Only the first V_VALID columns are real vocabulary; padding columns are never read.
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    m = float("-inf")
    s = 0.0
    total = 0.0
    for start in range(0, V_VALID, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V_VALID
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        total += tl.sum(tl.where(mask, x, 0.0), axis=0)
    target = tl.load(TARGETS + row)
    local = target - vocab_start
    here = (target != ignore_index) & (local >= 0) & (local < V_VALID)
    x_t = tl.load(base + tl.where(here, local, 0)).to(tl.float32)
    tl.store(MAX + row, m)
    tl.store(SUM_EXP + row, s)
    tl.store(TARGET_LOGIT + row, tl.where(here, x_t, 0.0))
    tl.store(SUM_LOGITS + row, total)


@triton.jit
def _cross_entropy_grad_kernel(
    LOGITS, TARGETS, LSE, ROW_SCALE, GRAD, stride, grad_stride, V, V_VALID, vocab_start, smooth_target,
    target_weight, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    out = GRAD + row * grad_stride
    lse = tl.load(LSE + row)
    scale = tl.load(ROW_SCALE + row)  # 0 for ignored rows
    local = tl.load(TARGETS + row) - vocab_start
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        real = cols < V_VALID
        x = tl.load(base + cols, mask=real, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - smooth_target - tl.where(cols == local, target_weight, 0.0)
        tl.store(out + cols, tl.where(real, g * scale, 0.0).to(GRAD.dtype.element_ty), mask=cols < V)


def _as_rows(logits: torch.Tensor) -> torch.Tensor:
    rows = logits.reshape(-1, logits.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def real_columns(v_local: int, vocab_start: int, vocab_size: int | None) -> int:
    """How many of the shard's columns are vocabulary (the rest is tp padding)."""
    return v_local if vocab_size is None else max(0, min(v_local, vocab_size - vocab_start))


def softmax_stats(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0, vocab_size: int | None = None,
    ignore_index: int = -100, block_size: int | None = None,
) -> ShardStats:
    """Triton per-row statistics of a vocab shard; see the module docstring."""
    rows = _as_rows(logits)
    n, v = rows.shape
    v = real_columns(v, vocab_start, vocab_size)
    block = block_size or min(CE_BLOCK, triton.next_power_of_2(max(v, 1)))
    stats = ShardStats(*(torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4)))
    if n:
        _softmax_stats_kernel[(n,)](
            rows, targets.reshape(-1).contiguous(), *stats, rows.stride(0), v, vocab_start, ignore_index,
            BLOCK_V=block, num_warps=num_warps_for(block),
        )
    return stats


def softmax_stats_reference(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0, vocab_size: int | None = None,
    ignore_index: int = -100,
) -> ShardStats:
    """The same statistics with torch ops (fp32)."""
    x = logits.reshape(-1, logits.shape[-1]).float()
    x = x[:, : real_columns(x.shape[-1], vocab_start, vocab_size)]
    t = targets.reshape(-1)
    m = x.max(dim=-1).values if x.shape[-1] else torch.full(x.shape[:1], float("-inf"), device=x.device)
    local = t - vocab_start
    here = (t != ignore_index) & (local >= 0) & (local < x.shape[-1])
    target_logit = torch.where(here, x.gather(1, torch.where(here, local, 0)[:, None])[:, 0], 0.0)
    return ShardStats(m, torch.exp(x - m[:, None]).sum(-1), target_logit, x.sum(-1))


def cross_entropy_grad(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor, *,
    vocab_start: int = 0, vocab_size: int | None = None, label_smoothing: float = 0.0,
    block_size: int | None = None,
) -> torch.Tensor:
    """Triton gradient of ``sum_rows row_scale * loss_row`` w.r.t. this shard's logits.

    ``lse`` is the global log-sum-exp per row, ``row_scale`` the upstream gradient per row
    (already 0 for ignored rows); both fp32 ``[N]``. Returns a tensor like ``logits``.
    """
    rows = _as_rows(logits)
    n, v = rows.shape
    v_valid = real_columns(v, vocab_start, vocab_size)
    vocab_size = v if vocab_size is None else vocab_size
    block = block_size or min(CE_BLOCK, triton.next_power_of_2(v))
    grad = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    if n:
        # Ignored targets (any id outside this shard) never equal a column index.
        _cross_entropy_grad_kernel[(n,)](
            rows, targets.reshape(-1).contiguous(), lse.contiguous(), row_scale.contiguous(), grad,
            rows.stride(0), grad.stride(0), v, v_valid, vocab_start, label_smoothing / vocab_size,
            1.0 - label_smoothing,
            BLOCK_V=block, num_warps=num_warps_for(block),
        )
    return grad.view(logits.shape)


def cross_entropy_grad_reference(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor, *,
    vocab_start: int = 0, vocab_size: int | None = None, label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The same gradient with torch ops (materialises fp32 probabilities: reference only)."""
    x = logits.reshape(-1, logits.shape[-1]).float()
    v_valid = real_columns(x.shape[-1], vocab_start, vocab_size)
    vocab_size = x.shape[-1] if vocab_size is None else vocab_size
    g = torch.exp(x - lse[:, None]) - label_smoothing / vocab_size
    local = targets.reshape(-1) - vocab_start
    cols = torch.arange(x.shape[-1], device=x.device)
    g = g - (1.0 - label_smoothing) * (cols[None, :] == local[:, None])
    g = torch.where(cols[None, :] < v_valid, g, 0.0)
    return (g * row_scale[:, None]).to(logits.dtype).view(logits.shape)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class ShardedCrossEntropy(torch.autograd.Function):
    """Per-row loss ``[N]`` (0 on ignored rows) over vocab-sharded logits.

    ``all_reduce_max`` / ``all_reduce_sum`` reduce a fp32 ``[N]`` tensor over the shards
    (the tp group) and return the result; at tp = 1 pass identities. Each call reduces
    4 small ``[N]`` vectors; the logits never move.
    """

    @staticmethod
    def forward(
        ctx, logits, targets, vocab_start: int, vocab_size: int, ignore_index: int, label_smoothing: float,
        all_reduce_max: AllReduce, all_reduce_sum: AllReduce, block_size: int | None, use_triton: bool = True,
    ):
        if use_triton:
            stats = softmax_stats(logits, targets, vocab_start=vocab_start, vocab_size=vocab_size,
                                  ignore_index=ignore_index, block_size=block_size)
        else:
            stats = softmax_stats_reference(logits, targets, vocab_start=vocab_start, vocab_size=vocab_size,
                                            ignore_index=ignore_index)
        global_max = all_reduce_max(stats.max.clone())
        sum_exp = all_reduce_sum(stats.sum_exp * torch.exp(stats.max - global_max))
        lse = global_max + torch.log(sum_exp)
        target_logit = all_reduce_sum(stats.target_logit)
        t = targets.reshape(-1)
        valid = t != ignore_index
        loss = (1.0 - label_smoothing) * (lse - target_logit)
        if label_smoothing:
            loss = loss + label_smoothing * (lse - all_reduce_sum(stats.sum_logits) / vocab_size)
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(logits, targets, lse, valid)
        ctx.args = (vocab_start, vocab_size, label_smoothing, block_size, use_triton)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse, valid = ctx.saved_tensors
        vocab_start, vocab_size, label_smoothing, block_size, use_triton = ctx.args
        row_scale = torch.where(valid, grad_loss.float(), 0.0)
        kwargs = dict(vocab_start=vocab_start, vocab_size=vocab_size, label_smoothing=label_smoothing)
        if use_triton:
            grad = cross_entropy_grad(logits, targets, lse, row_scale, block_size=block_size, **kwargs)
        else:
            grad = cross_entropy_grad_reference(logits, targets, lse, row_scale, **kwargs)
        return grad, None, None, None, None, None, None, None, None, None


def vocab_sharded_cross_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int,
    all_reduce_max: AllReduce, all_reduce_sum: AllReduce, ignore_index: int = -100,
    label_smoothing: float = 0.0, use_triton: bool = True, block_size: int | None = None,
) -> torch.Tensor:
    """Per-row fp32 loss ``[N]`` (rows flattened; 0 on ignored rows) over this rank's vocab shard.

    The shard holds global ids ``[vocab_start, vocab_start + V_local)``; ids ``>= vocab_size``
    are padding.
    ``all_reduce_max`` / ``all_reduce_sum`` must reduce a ``[N]`` fp32 tensor over the tensor-
    parallel group and return it (e.g. built on ``parallel3d.comm``); every rank gets the same
    loss and the gradient of its own shard. ``use_triton=False`` runs the torch reference.
    """
    if not 0 <= vocab_start < vocab_size:
        raise ValueError(f"cross_entropy: vocab_start={vocab_start} must be in [0, vocab_size={vocab_size})")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")
    check_targets(logits_shard, targets, vocab_size, ignore_index)
    return ShardedCrossEntropy.apply(
        logits_shard, targets, vocab_start, vocab_size, ignore_index, label_smoothing, all_reduce_max,
        all_reduce_sum, block_size, use_triton,
    )


def check_targets(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    rows = logits.numel() // max(logits.shape[-1], 1) if logits.dim() else 0
    if logits.dim() < 2 or targets.numel() != rows:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} must be [..., V] with one target per row; "
                         f"targets has shape {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cross_entropy: targets must be int64 (or int32), got {targets.dtype}")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):  # one host sync; eager torch would hit a device assert instead
        raise ValueError(f"cross_entropy: target ids must be in [0, {vocab_size}) or ignore_index={ignore_index}; "
                         f"got e.g. {int(targets[bad].reshape(-1)[0])}")


def reduce_loss(loss_rows: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """``mean`` over non-ignored rows (NaN when there are none, as torch), ``sum`` or ``none``."""
    if reduction == "none":
        return loss_rows.view(targets.shape)
    if reduction == "sum":
        return loss_rows.sum()
    if reduction == "mean":
        return loss_rows.sum() / (targets.reshape(-1) != ignore_index).sum()
    raise ValueError(f"cross_entropy: reduction={reduction!r} is not one of mean, sum, none")


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, *, label_smoothing: float = 0.0,
    reduction: str = "mean", block_size: int | None = None,
) -> torch.Tensor:
    """Fused cross-entropy over the full vocabulary (tp = 1); semantics of ``F.cross_entropy``.

    The loss is fp32 whatever the logits dtype; the logits gradient has the logits dtype.
    """
    v = logits.shape[-1]
    check_targets(logits, targets, v, ignore_index)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")
    loss_rows = ShardedCrossEntropy.apply(
        logits, targets, 0, v, ignore_index, label_smoothing, _identity, _identity, block_size, True
    )
    return reduce_loss(loss_rows, targets, ignore_index, reduction)
