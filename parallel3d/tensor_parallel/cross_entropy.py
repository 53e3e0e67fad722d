"""Cross entropy from vocabulary-sharded logits, without ever gathering the full logits.

Each tp rank holds logits ``[..., V_pad/n]`` for vocabulary ids
``[rank * V_pad/n, (rank + 1) * V_pad/n)``. The loss needs three reductions over
the tp group, each of ``[...]``-sized tensors (never ``[..., V]``):
max (for a stable softmax), sum of exponentials, and the target's logit (which
lives on exactly one rank; the others contribute zero). Backward is local:
``d loss / d logits = softmax - one_hot(target)`` on this rank's columns.
Columns at or past ``vocab_size`` (tp padding) are treated as ``-inf`` logits, so the
loss equals that of the unpadded model and they receive zero gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel3d import comm

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def _all_reduce(t: torch.Tensor, pstate: "ParallelState", op=dist.ReduceOp.SUM) -> torch.Tensor:
    comm.all_reduce(t, pstate, "tp", op=op)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, pstate, vocab_size, ignore_index):  # type: ignore[override]
        local_v = logits.shape[-1]
        start = comm.group_rank(pstate, "tp") * local_v
        x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        if vocab_size is not None and start + local_v > vocab_size:
            pad = torch.arange(start, start + local_v, device=x.device) >= vocab_size
            x = x.masked_fill(pad, float("-inf"))
        row_max = _all_reduce(x.max(dim=-1).values, pstate, dist.ReduceOp.MAX)
        x = x - row_max.unsqueeze(-1)
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < local_v)
        picked = x.gather(-1, local_t.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), pstate)
        exp = x.exp_()  # x is a fresh tensor here (after the subtraction)
        sum_exp = _all_reduce(exp.sum(dim=-1), pstate)
        loss = sum_exp.log() - target_logit
        valid = targets != ignore_index
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, mine & valid, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        softmax, local_t, hit, valid = ctx.saved_tensors
        scale = grad_loss * valid  # ignored tokens get no gradient
        grad = softmax * scale.unsqueeze(-1)  # a new tensor: the saved softmax stays intact
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.nonzero(hit.reshape(-1)).squeeze(-1)
        flat[rows, local_t.reshape(-1)[rows]] -= scale.reshape(-1)[rows].to(flat.dtype)
        return grad.to(ctx.in_dtype), None, None, None, None


def runs_vocab_parallel_loss(backend: str, vocab_size: int, padded_vocab: int, local_vocab: int) -> bool:
    """Whether a tp > 1 model's loss is this module's (plain torch ops; backward keeps an fp32 softmax of the
    shard) rather than the kernels' sharded cross entropy (``kernels.dispatch.vocab_sharded_cross_entropy``,
    on any backend but ``torch``: it keeps the logits in their own dtype and fp32 per-row statistics). This
    module's runs on the torch backend, and where the last shard (``local_vocab`` columns ending at
    ``padded_vocab``) is padding only, which the kernels' does not take. ``models.transformer``'s loss and the
    planner's activation estimate both ask here."""
    return backend == "torch" or padded_vocab - local_vocab >= vocab_size


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    pstate: "ParallelState",
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross entropy of vocabulary-sharded logits ``[..., V_pad/n]`` against global ``targets [...]``.

    ``vocab_size``: the real vocabulary (columns past it are padding). ``reduction``:
    ``"mean"`` over non-ignored tokens (like ``F.cross_entropy``), ``"sum"`` or ``"none"``
    (per-token losses, zero where ignored). Computed in float32 (or float64 for float64 input).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of 'mean', 'sum', 'none'")
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits shape {tuple(logits_shard.shape)} does not match targets shape {tuple(targets.shape)} "
            f"(expected logits = targets.shape + [V_local])"
        )
    losses = _VocabParallelCrossEntropy.apply(logits_shard, targets, pstate, vocab_size, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    count = (targets != ignore_index).sum()
    return losses.sum() / count
