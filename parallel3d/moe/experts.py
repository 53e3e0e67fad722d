"""This rank's routed experts: SwiGLU FFNs run as grouped GEMMs over expert-sorted rows.

Expert ``e`` computes ``w2 @ (silu(w1 @ x) * (w3 @ x))`` (Mixtral / DeepSeek experts; HF
layout: ``w1``, ``w3`` ``[f, h]``, ``w2`` ``[h, f]``). An ep rank holds the experts
``[first, first + num_local)``; with expert tensor parallelism (``etp``) each holds the
``etp_rank``-th slice of every local expert's width: rows of ``w1``/``w3``, columns of
``w2``, so its output is a partial sum over the etp group (the dispatcher's
reduce-scatter completes it).

Parameters are named and initialised by GLOBAL expert index: ``GroupedExperts`` is a
``ModuleDict`` keyed ``str(e)``, so inside a layer named ``layers.{i}.mlp`` the state-dict
keys read ``layers.{i}.mlp.experts.{e}.w1`` whatever the ep rank. A weight's full value
comes from ``(seed, "{prefix}.experts.{e}.w1")`` (``tensor_parallel.init.normal_shard``),
sliced for etp, so every ep / etp layout holds the same experts. Each parameter carries
``global_name``, ``expert_index`` (global) and ``etp_split_dim`` (0 for w1/w3, 1 for w2).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from kernels import dispatch
from parallel3d.moe.expert_layout import check_expert_split
from parallel3d.moe.grouped_gemm import grouped_linear
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel.init import normal_shard


def _expert_weight(storage: torch.Tensor, *, name: str, expert: int, split_dim: int, seed: int, std: float,
                   etp_rank: int, etp_size: int) -> nn.Parameter:
    param = nn.Parameter(storage)  # shares ``storage`` (its slot in the experts' block)
    normal_shard(param, seed=seed, global_name=name, std=std, split_dim=split_dim, tp_rank=etp_rank, tp_size=etp_size)
    set_meta(param, global_name=name)
    param.expert_index = expert
    param.etp_split_dim = split_dim
    return param


class ExpertFFN(nn.Module):
    """One expert's slice: ``w1``/``w3`` ``[f/etp, h]``, ``w2`` ``[h, f/etp]``, each a slot of ``blocks``
    (``name -> [G, ...]`` shared by the local experts: the grouped GEMM then reads them without a copy)."""

    def __init__(self, expert: int, slot: int, blocks: dict[str, torch.Tensor], *, prefix: str, seed: int,
                 init_std: float, output_std: float, etp_rank: int, etp_size: int) -> None:
        super().__init__()
        common = dict(expert=expert, seed=seed, etp_rank=etp_rank, etp_size=etp_size)
        name = f"{prefix}.experts.{expert}"
        self.w1 = _expert_weight(blocks["w1"][slot], name=f"{name}.w1", split_dim=0, std=init_std, **common)
        self.w3 = _expert_weight(blocks["w3"][slot], name=f"{name}.w3", split_dim=0, std=init_std, **common)
        self.w2 = _expert_weight(blocks["w2"][slot], name=f"{name}.w2", split_dim=1, std=output_std, **common)


class GroupedExperts(nn.ModuleDict):
    """Local experts keyed by global index; ``forward(rows [N, h], sizes [num_local]) -> [N, h]`` (partial over etp).

    ``rows`` are sorted by local expert, ``sizes`` host integers (0 allowed).
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, *, first: int, num_local: int, prefix: str,
                 seed: int = 0, init_std: float = 0.02, output_std: float | None = None, etp_rank: int = 0,
                 etp_size: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 gemm_backend: str = "auto", kernel_backend: str = "auto") -> None:
        check_expert_split(num_experts, 1, ffn_hidden, etp_size)
        if first < 0 or first + num_local > num_experts:
            raise ValueError(f"experts [{first}, {first + num_local}) outside the {num_experts} experts")
        std_out = init_std if output_std is None else output_std
        f = ffn_hidden // etp_size
        # Each weight kind of the local experts in one block, expert after expert (see ExpertFFN).
        blocks = {k: torch.empty((num_local, *shape), dtype=dtype, device=device)
                  for k, shape in (("w1", (f, hidden)), ("w3", (f, hidden)), ("w2", (hidden, f)))}
        super().__init__({
            str(e): ExpertFFN(e, e - first, blocks, prefix=prefix, seed=seed, init_std=init_std, output_std=std_out,
                              etp_rank=etp_rank, etp_size=etp_size)
            for e in range(first, first + num_local)
        })
        self.first, self.num_local = first, num_local
        self.gemm_backend, self.kernel_backend = gemm_backend, kernel_backend

    def forward(self, rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:  # type: ignore[override]
        experts = list(self.values())
        gate = grouped_linear(rows, [m.w1 for m in experts], sizes, self.gemm_backend)
        up = grouped_linear(rows, [m.w3 for m in experts], sizes, self.gemm_backend)
        hidden = dispatch.swiglu(gate, up, backend=self.kernel_backend)
        return grouped_linear(hidden, [m.w2 for m in experts], sizes, self.gemm_backend)
