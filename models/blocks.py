"""The transformer block shared by GPT and Llama: norms, attention, residuals, dropout.

A block maps ``[b, s_local, h] -> [b, s_local, h]`` (``s_local = s/tp`` with sequence
parallel, else ``s``). Attention and MLP are tensor parallel: each tp rank holds
``num_heads/tp`` query heads, ``num_kv_heads/tp`` key/value heads and ``ffn/tp`` MLP
columns. The fused QKV weight is laid out by key/value group, ``[q heads of group 0,
k_0, v_0, q heads of group 1, k_1, v_1, ...]`` (each ``head_dim`` rows per head), so a
contiguous split over tp gives every rank whole groups, whatever tp is.
What a block is made of comes from its ``models.spec.BlockSpec`` (``config.spec.blocks[i]``): the
norm kind (``NORM_FUNCTIONS``), the attention's heads and biases, and the MLP module that
``models.transformer`` builds for the MLP kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion
from torch.utils.checkpoint import checkpoint

from kernels import dispatch
from models.config import ModelConfig
from models.spec import AttentionSpec, BlockSpec, NormSpec
from parallel3d.context_parallel.model_attention import ContextParallelAttention
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel import ColumnParallelLinear, RowParallelLinear, copy_to_tp_region
from parallel3d.tensor_parallel.dropout import layout_independent_dropout

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

_SDPA_HAS_GQA = TorchVersion(torch.__version__) >= "2.5"  # enable_gqa= arrived in torch 2.5


@dataclass(frozen=True)
class BuildContext:
    """What every layer needs to build itself (no globals)."""

    config: ModelConfig
    pstate: "ParallelState"
    seed: int
    sequence_parallel: bool
    recompute: str
    dtype: torch.dtype
    device: torch.device
    context_parallel: ContextParallelAttention  # the cp group's attention (size 1: plain attention)

    @property
    def residual_std(self) -> float:
        # GPT-2 / Megatron: projections that write into the residual stream are scaled by
        # 1/sqrt(2 * num_layers) so the residual's variance does not grow with depth.
        return self.config.init_std / math.sqrt(2.0 * self.config.num_layers)

    def column(self, fan_in: int, fan_out: int, name: str, bias: bool) -> ColumnParallelLinear:
        return ColumnParallelLinear(fan_in, fan_out, self.pstate, global_name=name, seed=self.seed,
                                    init_std=self.config.init_std, bias=bias,
                                    sequence_parallel=self.sequence_parallel, dtype=self.dtype, device=self.device)

    def row(self, fan_in: int, fan_out: int, name: str, bias: bool) -> RowParallelLinear:
        return RowParallelLinear(fan_in, fan_out, self.pstate, global_name=name, seed=self.seed,
                                 init_std=self.residual_std, bias=bias,
                                 sequence_parallel=self.sequence_parallel, dtype=self.dtype, device=self.device)


@dataclass
class ForwardContext:
    """Per-call values every block reads: rotary tables (``[s_local, d/2]``, or ``[b, s_local, d/2]``
    with per-document positions), dropout coordinates, the whole sequence's document ids."""

    rope: tuple[torch.Tensor, torch.Tensor] | None
    sample_ids: torch.Tensor | None
    step: int
    training: bool
    document_ids: torch.Tensor | None = None  # [b, s] (whole sequence, every cp rank): attention stays inside


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                backend: str) -> torch.Tensor:
    return dispatch.layer_norm(x, weight, bias, eps, backend=backend)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
              backend: str) -> torch.Tensor:
    assert bias is None, "RMSNorm has no bias (models.spec.NORM_TAKES_BIAS)"
    return dispatch.rms_norm(x, weight, eps, backend=backend)


# The function of each models.spec.NORM_KINDS kind: (x, weight, bias, eps, backend) -> normalised x.
NORM_FUNCTIONS = {"layernorm": _layer_norm, "rmsnorm": _rms_norm}


class Norm(nn.Module):
    """A ``NormSpec`` (LayerNorm, RMSNorm) over the last dim; weight (and bias) replicated over tp.

    With sequence parallel each rank normalises only its tokens, so the replicated
    weight/bias gradients are partial sums: ``copy_to_tp_region`` all-reduces them in backward.
    ``per_head``: the norm runs over attention heads, which tp splits, so its gradients are partial
    sums over tp with or without sequence parallel.
    """

    def __init__(self, ctx: BuildContext, global_name: str, spec: NormSpec, per_head: bool = False) -> None:
        super().__init__()
        self.partial_grads = ctx.sequence_parallel or (per_head and ctx.pstate.size("tp") > 1)
        self.function = NORM_FUNCTIONS[spec.kind]
        self.eps, self.backend = spec.eps, ctx.config.backend
        self.pstate, self.sequence_parallel = ctx.pstate, ctx.sequence_parallel
        self.weight = nn.Parameter(torch.ones(spec.size, dtype=ctx.dtype, device=ctx.device))
        set_meta(self.weight, global_name=f"{global_name}.weight", no_weight_decay=True)
        self.bias = None
        if spec.bias:
            self.bias = nn.Parameter(torch.zeros(spec.size, dtype=ctx.dtype, device=ctx.device))
            set_meta(self.bias, global_name=f"{global_name}.bias", no_weight_decay=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.partial_grads:
            weight = copy_to_tp_region(weight, self.pstate)
            bias = None if bias is None else copy_to_tp_region(bias, self.pstate)
        return self.function(x, weight, bias, self.eps, self.backend)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(QK^T/sqrt(d))V; q ``[b, s, hq, d]``, k/v ``[b, s, hk, d]`` -> ``[b, s, hq*d]``."""
    b, s, hq, d = q.shape
    repeat = hq // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # Grouped-query attention: query head j reads key/value head j // repeat.
    if repeat > 1 and _SDPA_HAS_GQA:  # flash/efficient kernels read the shared kv heads directly
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, hq * d)


def _views_copied_out_if_mixed(parts: tuple[torch.Tensor, ...], buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``parts`` as they are when all (or none) are views of ``buffer``; otherwise the views are
    copied out. Attention keeps q, k, v for backward: if all are views, the buffer *is* q, k, v;
    if some are new tensors (rotary outputs, regrouped q), one kept view would keep the whole
    fused buffer alive next to them. Views are told by storage identity, not data pointer: every meta
    storage has data pointer 0, and the dry run runs this on meta."""
    storage = buffer.untyped_storage()._cdata
    is_view = [t.untyped_storage()._cdata == storage for t in parts]
    if all(is_view):
        return parts
    return tuple(t.clone(memory_format=torch.contiguous_format) if view else t for t, view in zip(parts, is_view))


class Attention(nn.Module):
    """Multi-head / grouped-query causal self-attention, heads split over tp."""

    def __init__(self, ctx: BuildContext, layer: int, spec: AttentionSpec) -> None:
        super().__init__()
        h, tp = ctx.config.hidden_size, ctx.pstate.size("tp")
        self.head_dim = spec.head_dim
        self.kv_local = spec.num_kv_heads // tp
        self.q_per_kv = spec.num_heads // spec.num_kv_heads
        self.backend = ctx.config.backend
        self.selective = ctx.recompute == "selective"
        self.context_parallel = ctx.context_parallel
        self.qkv = ctx.column(h, spec.q_size + 2 * spec.kv_size, f"layers.{layer}.attn.qkv", spec.qkv_bias)
        self.q_norm = self.k_norm = None
        if spec.qk_norm is not None:  # Qwen3: RMSNorm over each head's width, before rotary positions
            self.q_norm = Norm(ctx, f"layers.{layer}.attn.q_norm", spec.qk_norm, per_head=True)
            self.k_norm = Norm(ctx, f"layers.{layer}.attn.k_norm", spec.qk_norm, per_head=True)
        self.out = ctx.row(spec.q_size, h, f"layers.{layer}.attn.out", spec.out_bias)

    def forward(self, x: torch.Tensor, run: ForwardContext) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.kv_local, self.q_per_kv + 2, self.head_dim)
        # q is a view of the fused buffer when this rank holds one kv group (or q_per_kv == 1), else a copy.
        q = qkv[:, :, :, : self.q_per_kv].reshape(b, s, self.kv_local * self.q_per_kv, self.head_dim)
        k, v = qkv[:, :, :, self.q_per_kv], qkv[:, :, :, self.q_per_kv + 1]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if run.rope is not None:
            q, k = self._rope(q, k, *run.rope)
        q, k, v = _views_copied_out_if_mixed((q, k, v), qkv)
        if self.context_parallel.size > 1 or run.document_ids is not None:
            # Never under selective checkpoint: the core communicates over cp, and a recompute
            # would post its collectives at a different point on each cp rank.
            out = self.context_parallel.attend(q, k, v, run.document_ids).reshape(b, s, -1)
        elif self.selective and torch.is_grad_enabled():
            # Selective recompute: keep q, k, v; recompute the O(s^2) core in backward.
            out = checkpoint(attention_core, q, k, v, use_reentrant=False)
        else:
            out = attention_core(q, k, v)
        return self.out(out)

    def _rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if cos.dim() == 2:
            return dispatch.apply_rope(q, k, cos, sin, backend=self.backend)
        # Per-document positions differ between rows: each row gets its own tables.
        rows = [dispatch.apply_rope(q[i:i + 1], k[i:i + 1], cos[i], sin[i], backend=self.backend)
                for i in range(q.shape[0])]
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + drop(attn(norm1(x)))``, ``out = h + drop(mlp(norm2(h)))``."""

    def __init__(self, ctx: BuildContext, layer: int, spec: BlockSpec, mlp: nn.Module,
                 attention: nn.Module | None = None) -> None:
        """``attention``: another attention module (``models.mla``); default ``Attention`` of ``spec``."""
        super().__init__()
        self.layer = layer
        self.dropout, self.seed = ctx.config.dropout, ctx.seed
        self.pstate, self.sequence_parallel = ctx.pstate, ctx.sequence_parallel
        self.norm1 = Norm(ctx, f"layers.{layer}.norm1", spec.norm)
        self.attn = Attention(ctx, layer, spec.attention) if attention is None else attention
        self.norm2 = Norm(ctx, f"layers.{layer}.norm2", spec.norm)
        self.mlp = mlp

    def _drop(self, x: torch.Tensor, run: ForwardContext, site: str) -> torch.Tensor:
        if not run.training or self.dropout == 0.0:
            return x
        return layout_independent_dropout(x, self.dropout, seed=self.seed, step=run.step, sample_ids=run.sample_ids,
                                          layer=self.layer, site=site, pstate=self.pstate,
                                          sequence_parallel=self.sequence_parallel)

    def forward(self, x: torch.Tensor, run: ForwardContext) -> torch.Tensor:
        h = x + self._drop(self.attn(self.norm1(x), run), run, "attn")
        return h + self._drop(self.mlp(self.norm2(h)), run, "mlp")
