"""Shared experts: a dense SwiGLU FFN every token goes through, beside the routed experts.

``num_shared`` shared experts of width ``f`` are one SwiGLU FFN of width ``num_shared * f``
(DeepSeek-V2/V3). With ``gate`` (Qwen2-MoE) the output is scaled per token by
``sigmoid(x @ gate^T)`` (``gate [1, h]``). Shapes ``[T, h] -> [T, h]``.

This module is replicated (every rank holds all of it; its gradients are reduced like
any replicated dense parameter). ``weight_fn``, if given, is applied to every weight at use
time (e.g. the caller's identity-forward / all-reduce-the-gradient map over the ranks that hold
different tokens of one micro-batch: tp under sequence parallel). A model that runs its dense FFNs tensor parallel may pass
its own tensor-parallel FFN to ``MoELayer(shared_experts=...)`` instead.
Names: ``{prefix}.shared_experts.w1/w2/w3`` and ``{prefix}.shared_expert_gate.weight``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel.init import normal_shard

WeightFn = Callable[[torch.Tensor], torch.Tensor]


def _weight(shape: tuple[int, int], name: str, seed: int, std: float, dtype: torch.dtype,
            device: torch.device | str | None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    normal_shard(param, seed=seed, global_name=name, std=std, split_dim=None, tp_rank=0, tp_size=1)
    return set_meta(param, global_name=name)


class SharedExpertFFN(nn.Module):
    """``w2 @ (silu(w1 @ x) * (w3 @ x))`` of width ``width``."""

    def __init__(self, hidden: int, width: int, *, prefix: str, seed: int = 0, init_std: float = 0.02,
                 output_std: float | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, kernel_backend: str = "auto",
                 weight_fn: WeightFn | None = None) -> None:
        super().__init__()
        self.weight_fn = weight_fn
        name = f"{prefix}.shared_experts"
        self.w1 = _weight((width, hidden), f"{name}.w1", seed, init_std, dtype, device)
        self.w3 = _weight((width, hidden), f"{name}.w3", seed, init_std, dtype, device)
        self.w2 = _weight((hidden, width), f"{name}.w2", seed, init_std if output_std is None else output_std,
                          dtype, device)
        self.kernel_backend = kernel_backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w if self.weight_fn is None else self.weight_fn(w) for w in (self.w1, self.w2, self.w3))
        hidden = dispatch.swiglu(F.linear(x, w1), F.linear(x, w3), backend=self.kernel_backend)
        return F.linear(hidden, w2)


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
