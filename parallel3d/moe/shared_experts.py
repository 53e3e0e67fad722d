"""Shared experts: a dense SwiGLU FFN every token goes through, beside the routed experts.

``num_shared`` shared experts of width ``f`` are one SwiGLU FFN of width ``num_shared * f``
(DeepSeek-V2/V3). With ``gate`` (Qwen2-MoE) the output is scaled per token by
``sigmoid(x @ gate^T)`` (``gate [1, h]``). Shapes ``[T, h] -> [T, h]`` (or ``[b, s, h]``).

Tensor parallel (``pstate`` given), as the dense SwiGLU MLP and Megatron-core's shared expert:
``w1``/``w3`` are column parallel (each tp rank holds ``width / tp`` of their rows), ``w2`` row
parallel (the same slice of its columns), so a rank holds ``1 / tp`` of the FFN and its output is
summed over tp. Under sequence parallel a rank's tokens (its sequence chunk) are all-gathered
along the sequence before ``w1``/``w3`` and the output is reduce-scattered back to them; each rank's
weight gradient is then complete for its slice (it saw every token). A ``[T, h]`` input is viewed as
``[1, T, h]``: the FFN is per token, so gathering the ranks' token blocks in rank order and
scattering the sum back gives each rank its own tokens' outputs. Their weight gradients may be
deferred to a zero-bubble ``W`` (``wgrad_deferrable``), as the dense layers' are.
Without ``pstate`` the FFN is whole on every rank; ``weight_fn``, if given, is applied to each
weight at use time (e.g. identity forward / all-reduce of the gradient over the ranks that hold
different tokens of one micro-batch).

The gate is always whole (``[1, h]``, a replicated parameter); ``weight_fn`` completes its gradient
where the tp ranks hold different tokens (sequence parallel).
Names: ``{prefix}.shared_experts.w1/w2/w3`` and ``{prefix}.shared_expert_gate.weight``; a weight's
full value depends only on (seed, name), whatever tp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel import column_parallel_linears, mappings
from parallel3d.tensor_parallel.deferrable_linear import deferrable_linear
from parallel3d.tensor_parallel.init import normal_shard

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

WeightFn = Callable[[torch.Tensor], torch.Tensor]


def _weight(shape: tuple[int, int], name: str, seed: int, std: float, dtype: torch.dtype,
            device: torch.device | str | None, *, split_dim: int | None = None, tp_rank: int = 0,
            tp_size: int = 1) -> nn.Parameter:
    """This tp rank's slice (along ``split_dim``; None: whole) of the full ``shape`` weight."""
    local = list(shape)
    if split_dim is not None:
        local[split_dim] //= tp_size
    param = nn.Parameter(torch.empty(tuple(local), dtype=dtype, device=device))
    normal_shard(param, seed=seed, global_name=name, std=std, split_dim=split_dim, tp_rank=tp_rank, tp_size=tp_size)
    if split_dim is None:
        return set_meta(param, global_name=name)
    return set_meta(param, global_name=name, tp_split_dim=split_dim, wgrad_deferrable=True)


def check_shared_width(width: int, tp: int) -> None:
    """The shared experts' FFN (``num_shared_experts x`` its width) splits over tp (ValueError otherwise)."""
    if width % tp:
        raise ValueError(f"model.moe.shared_ffn_hidden_size: the shared experts' width {width} "
                         f"(num_shared_experts x width) is not divisible by parallel.tp={tp}")


class SharedExpertFFN(nn.Module):
    """``w2 @ (silu(w1 @ x) * (w3 @ x))`` of width ``width``; split over ``pstate``'s tp (module docstring)."""

    def __init__(self, hidden: int, width: int, *, prefix: str, seed: int = 0, init_std: float = 0.02,
                 output_std: float | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, kernel_backend: str = "auto",
                 weight_fn: WeightFn | None = None, pstate: "ParallelState | None" = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = 1 if pstate is None else pstate.size("tp")
        check_shared_width(width, tp)
        if pstate is not None and weight_fn is not None:
            raise ValueError("SharedExpertFFN: weight_fn is for the whole FFN; a tensor-parallel one completes "
                             "its gradients itself")
        self.pstate, self.sequence_parallel, self.weight_fn = pstate, sequence_parallel, weight_fn
        self.kernel_backend = kernel_backend
        name = f"{prefix}.shared_experts"
        split = dict(tp_rank=0 if pstate is None else pstate.coord("tp"), tp_size=tp)
        column, row = (None, None) if pstate is None else (0, 1)
        self.w1 = _weight((width, hidden), f"{name}.w1", seed, init_std, dtype, device, split_dim=column, **split)
        self.w3 = _weight((width, hidden), f"{name}.w3", seed, init_std, dtype, device, split_dim=column, **split)
        self.w2 = _weight((hidden, width), f"{name}.w2", seed, init_std if output_std is None else output_std,
                          dtype, device, split_dim=row, **split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pstate is None:
            w1, w2, w3 = (w if self.weight_fn is None else self.weight_fn(w) for w in (self.w1, self.w2, self.w3))
            hidden = dispatch.swiglu(F.linear(x, w1), F.linear(x, w3), backend=self.kernel_backend)
            return F.linear(hidden, w2)
        pstate, flat = self.pstate, x.dim() == 2
        tokens = x.unsqueeze(0) if flat else x  # sequence parallel gathers dim 1 (module docstring)
        gate, up = column_parallel_linears(tokens, [(self.w1, None), (self.w3, None)], pstate,
                                           sequence_parallel=self.sequence_parallel)
        hidden = dispatch.swiglu(gate, up, backend=self.kernel_backend)
        out = deferrable_linear(hidden, self.w2, None, pstate.weight_grads)  # partial: this rank's width slice
        if self.sequence_parallel:
            out = mappings.reduce_scatter_seq(out, pstate)
        else:
            out = mappings.reduce_from_tp_region(out, pstate)
        return out.squeeze(0) if flat else out


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's per-token gate ``sigmoid(x @ weight^T)``, ``weight [1, h]``."""

    def __init__(self, hidden: int, *, prefix: str, seed: int = 0, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 weight_fn: WeightFn | None = None) -> None:
        super().__init__()
        self.weight_fn = weight_fn
        self.weight = _weight((1, hidden), f"{prefix}.shared_expert_gate.weight", seed, init_std, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight_fn is None else self.weight_fn(self.weight)
        return torch.sigmoid(F.linear(x, weight))
