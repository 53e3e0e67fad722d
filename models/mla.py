"""Multi-head latent attention (DeepSeek-V2/V3 MLA): the attention of a block whose spec has ``latent``.

``[b, s, h] -> [b, s, h]``. With ``L = spec.latent`` and ``H`` heads:
- queries: ``q_up(q_latent_norm(q_down(x)))`` (``L.q_lora_rank > 0``) or ``q(x)``, ``[b, s, H, nope + rope]``;
- keys/values: ``kv_down(x)`` is ``[latent | k_rope]`` (``kv_lora_rank + rope``); ``kv_up(kv_latent_norm(latent))``
  gives each head's ``[k_nope | v]`` (``nope + v_head_dim``); the one rotary key ``k_rope`` is shared
  by every head;
- rotary positions turn the last ``rope`` dims of q and k (halves rotated, as in ``models.llama``:
  DeepSeek's interleaved pairs are a fixed permutation of those weights' rows, applied at HF import);
- causal softmax over ``[q_nope | q_rope] . [k_nope | k_rope] / sqrt(nope + rope)``, then ``out``.

Parameter names (``models.shape.attention_params`` lists the same): ``attn.q_down``, ``attn.q_latent_norm``,
``attn.q_up`` (or ``attn.q``), ``attn.kv_down``, ``attn.kv_latent_norm``, ``attn.kv_up``, ``attn.out``.
Layouts: tp = 1 and cp = 1 only, no per-document attention (``check_latent_layout`` says so in one line);
the down projections are whole on every rank, as the shape records for the planner.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels import dispatch
from models.blocks import BuildContext, ForwardContext, Norm
from models.spec import AttentionSpec, NormSpec
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel.init import normal_shard


def check_latent_layout(tp: int, cp: int) -> None:
    """Raise ValueError (one line) for a layout latent attention does not run in yet."""
    if tp > 1 or cp > 1:
        raise ValueError(f"model.mla with parallel.tp={tp}, parallel.cp={cp}: latent attention runs at tp=1 and "
                         f"cp=1 for now (use pp, dp, ep)")


def _replicated_weight(ctx: BuildContext, shape: tuple[int, int], name: str) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=ctx.dtype, device=ctx.device))
    normal_shard(param, seed=ctx.seed, global_name=name, std=ctx.config.init_std, split_dim=None, tp_rank=0, tp_size=1)
    return set_meta(param, global_name=name)


def latent_attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention; q/k ``[b, s, H, dq]``, v ``[b, s, H, dv]`` -> ``[b, s, H*dv]`` (scale 1/sqrt(dq))."""
    b, s, heads, _ = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2).reshape(b, s, heads * v.shape[-1])


class LatentAttention(nn.Module):
    """See the module docstring."""

    def __init__(self, ctx: BuildContext, layer: int, spec: AttentionSpec) -> None:
        super().__init__()
        assert spec.latent is not None
        check_latent_layout(ctx.pstate.size("tp"), ctx.context_parallel.size)
        lat, h, p = spec.latent, ctx.config.hidden_size, f"layers.{layer}.attn"
        self.heads, self.lat = spec.num_heads, lat
        self.backend = ctx.config.backend
        self.selective = ctx.recompute == "selective"
        norm = lambda size: NormSpec(kind="rmsnorm", size=size, bias=False, eps=ctx.config.norm_eps)  # noqa: E731
        q_width = spec.num_heads * lat.qk_head_dim
        self.q_down = self.q_latent_norm = None
        if lat.q_lora_rank:
            self.q_down = _replicated_weight(ctx, (lat.q_lora_rank, h), f"{p}.q_down.weight")
            self.q_latent_norm = Norm(ctx, f"{p}.q_latent_norm", norm(lat.q_lora_rank))
            self.q_up = ctx.column(lat.q_lora_rank, q_width, f"{p}.q_up", False)
        else:
            self.q = ctx.column(h, q_width, f"{p}.q", False)
        self.kv_down = _replicated_weight(ctx, (lat.kv_lora_rank + lat.qk_rope_dim, h), f"{p}.kv_down.weight")
        self.kv_latent_norm = Norm(ctx, f"{p}.kv_latent_norm", norm(lat.kv_lora_rank))
        self.kv_up = ctx.column(lat.kv_lora_rank, spec.num_heads * (lat.qk_nope_dim + lat.v_head_dim),
                                f"{p}.kv_up", False)
        self.out = ctx.row(spec.num_heads * lat.v_head_dim, h, f"{p}.out", spec.out_bias)

    def forward(self, x: torch.Tensor, run: ForwardContext) -> torch.Tensor:
        if run.document_ids is not None:
            raise ValueError("model.mla: per-document attention (data.reset_attention) is not supported yet")
        lat, b, s = self.lat, x.shape[0], x.shape[1]
        if self.q_down is not None:
            q = self.q_up(self.q_latent_norm(F.linear(x, self.q_down)))
        else:
            q = self.q(x)
        q = q.view(b, s, self.heads, lat.qk_head_dim)
        latent, k_rope = F.linear(x, self.kv_down).split([lat.kv_lora_rank, lat.qk_rope_dim], dim=-1)
        kv = self.kv_up(self.kv_latent_norm(latent)).view(b, s, self.heads, lat.qk_nope_dim + lat.v_head_dim)
        k_nope, v = kv.split([lat.qk_nope_dim, lat.v_head_dim], dim=-1)
        q_nope, q_rope = q.split([lat.qk_nope_dim, lat.qk_rope_dim], dim=-1)
        k_rope = k_rope.view(b, s, 1, lat.qk_rope_dim)
        if run.rope is not None:
            cos, sin = run.rope
            q_rope, k_rope = dispatch.apply_rope(q_rope.contiguous(), k_rope.contiguous(), cos, sin,
                                                 backend=self.backend)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, s, self.heads, lat.qk_rope_dim)], dim=-1)
        v = v.contiguous()
        if self.selective and torch.is_grad_enabled():
            out = checkpoint(latent_attention_core, q, k, v, use_reentrant=False)
        else:
            out = latent_attention_core(q, k, v)
        return self.out(out)
