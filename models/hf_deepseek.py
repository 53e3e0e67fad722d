"""DeepSeek-V3 (transformers' ``DeepseekV3ForCausalLM``) as data: names, one row order and two configs.

What maps to what (``HFFormat`` below; ``models.hf`` converts it with the code every family uses):
- multi-head latent attention (``model.mla``, ``models.mla``): ``attn.q_down`` / ``q_latent_norm`` / ``q_up``
  (or ``attn.q`` when ``q_lora_rank = 0``: HF ``q_lora_rank=None``) -> ``self_attn.q_a_proj`` /
  ``q_a_layernorm`` / ``q_b_proj`` (``q_proj``); ``attn.kv_down`` / ``kv_latent_norm`` / ``kv_up`` ->
  ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``; ``attn.out`` -> ``o_proj``;
- the router (``mlp.router``) -> ``mlp.gate`` with sigmoid scores, group-limited top-k (``n_group``,
  ``topk_group``), ``norm_topk_prob`` and ``routed_scaling_factor``; our aux-loss-free expert bias (the
  router's ``expert_bias`` buffer) <-> ``mlp.gate.e_score_correction_bias``;
- routed experts by global index, one shared MLP of width ``n_shared_experts * moe_intermediate_size``
  (``mlp.shared_experts``), and ``first_k_dense_replace`` dense layers (``model.moe.dense_first``).

One layout differs: with ``rope_interleave=True`` (DeepSeek's checkpoints and transformers' default) the
rotary dims of each query head and of the shared rotary key are stored as pairs ``(x0, x1), (x2, x3), ...``;
ours rotate halves (``models.mla``). Rotating the pairs gives ``[even dims | odd dims]`` rotated by halves, so
our rows are HF's rows ``0, 2, 4, ..., 1, 3, 5, ...`` (``_reorder``); the attention scores are the same.

What HF DeepSeek-V3 has and we do not is refused by ``config_from_hf``, naming the HF field: rope scaling
(YaRN: ``rope_parameters``), ``rope_interleave=False``, ``attention_bias``, ``num_key_value_heads`` other than
the head count, ``rms_norm_eps`` other than 1e-6 (transformers' MLA latent norms always use 1e-6, ours
``model.norm_eps``), no shared expert. The multi-token-prediction module is not modelled (not built by
transformers either). The HF config holds no bias update rate: imports use DeepSeek-V3's 0.001.
"""

from __future__ import annotations

from typing import Any

import torch

from models.config import ModelConfig
from models.hf_format_spec import HFFormat, rope_base as _rope_base

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with this eps
IMPORTED_BIAS_UPDATE_RATE = 0.001  # DeepSeek-V3's gamma (the HF config does not carry one)

_MODULES = (("embedding.word", "model.embed_tokens"), ("final_norm", "model.norm"), ("head", "lm_head"),
            ("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm"),
            ("attn.q_down", "self_attn.q_a_proj"), ("attn.q_latent_norm", "self_attn.q_a_layernorm"),
            ("attn.q_up", "self_attn.q_b_proj"), ("attn.q", "self_attn.q_proj"),
            ("attn.kv_down", "self_attn.kv_a_proj_with_mqa"), ("attn.kv_latent_norm", "self_attn.kv_a_layernorm"),
            ("attn.kv_up", "self_attn.kv_b_proj"), ("attn.out", "self_attn.o_proj"),
            ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj"),
            ("mlp.router", "mlp.gate"), ("mlp.experts.{e}.w1", "mlp.experts.{e}.gate_proj"),
            ("mlp.experts.{e}.w3", "mlp.experts.{e}.up_proj"), ("mlp.experts.{e}.w2", "mlp.experts.{e}.down_proj"),
            ("mlp.shared_experts.w1", "mlp.shared_experts.gate_proj"),
            ("mlp.shared_experts.w3", "mlp.shared_experts.up_proj"),
            ("mlp.shared_experts.w2", "mlp.shared_experts.down_proj"))


# ---- the rotary rows ----------------------------------------------------------------------------
def _pairs_to_halves(d: int) -> torch.Tensor:
    """Our rotary row ``j`` is HF's row ``order[j]`` (module docstring)."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _reorder(cfg: ModelConfig, module: str, value: torch.Tensor, to_hf: bool) -> torch.Tensor:
    """HF's interleaved rotary rows <-> ours, for the query projection and the shared rotary key."""
    lat = cfg.mla
    order = _pairs_to_halves(lat.qk_rope_head_dim).to(value.device)
    if to_hf:
        order = torch.argsort(order)
    if module in ("attn.q_up", "attn.q"):  # [H * (nope + rope), in]: each head's last rope rows
        heads = value.reshape(cfg.num_heads, lat.qk_nope_head_dim + lat.qk_rope_head_dim, -1)
        nope, rope = heads.split([lat.qk_nope_head_dim, lat.qk_rope_head_dim], dim=1)
        return torch.cat([nope, rope[:, order]], dim=1).reshape(value.shape)
    if module == "attn.kv_down":  # [kv_lora_rank + rope, in]: the last rope rows
        latent, rope = value.split([lat.kv_lora_rank, lat.qk_rope_head_dim])
        return torch.cat([latent, rope[order]])
    return value


def _buffers(cfg: ModelConfig, layer: int) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    if not cfg.moe.is_moe_layer(layer):
        return ()
    return (("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", (cfg.moe.num_experts,)),)


# ---- configs ------------------------------------------------------------------------------------
def _refuse(cond: bool, message: str) -> None:
    if cond:
        raise ValueError(message)


def _dense_prefix(cfg: ModelConfig) -> int:
    """``first_k_dense_replace`` of ``cfg``; raises unless its dense layers are exactly the first k."""
    dense = [i for i in range(cfg.num_layers) if not cfg.moe.is_moe_layer(i)]
    _refuse(dense != list(range(len(dense))),
            f"model.moe dense layers {dense}: DeepSeek-V3 has only the first k dense (first_k_dense_replace); "
            f"use model.moe.dense_first")
    return len(dense)


def _shared_count(cfg: ModelConfig) -> int:
    """HF ``n_shared_experts``: the shared MLP is ``n * moe_intermediate_size`` wide there."""
    m = cfg.moe
    routed = m.ffn_hidden_size or cfg.ffn_size
    width = m.num_shared_experts * (m.shared_ffn_hidden_size or routed)
    _refuse(m.num_shared_experts < 1 or m.shared_expert_gate or width % routed != 0,
            f"model.moe.num_shared_experts={m.num_shared_experts}, shared_ffn_hidden_size={m.shared_ffn_hidden_size}, "
            f"shared_expert_gate={m.shared_expert_gate}: DeepSeek-V3 has ungated shared experts whose total width is "
            f"a multiple of the expert width {routed}")
    return width // routed


def _to_hf(cfg: ModelConfig) -> Any:
    import transformers  # the optional "hf" extra

    m, lat = cfg.moe, cfg.mla
    _refuse(cfg.use_bias or cfg.qk_norm or cfg.qkv_bias is not None,
            "model.use_bias / qk_norm / qkv_bias: DeepSeek-V3 has no attention biases nor q/k norms")
    _refuse(not m.enabled, "model.moe.num_experts=0: DeepSeek-V3 in transformers is a mixture of experts")
    _refuse(m.score_function != "sigmoid" or m.capacity_factor is not None,
            f"model.moe.score_function={m.score_function!r}, capacity_factor={m.capacity_factor}: DeepSeek-V3 routes "
            f"dropless with sigmoid scores")
    _refuse(m.num_experts // m.num_groups < 2,
            f"model.moe.num_groups={m.num_groups}: DeepSeek-V3 scores a group by its two best experts, so groups "
            f"need at least 2 of the {m.num_experts} experts")
    _refuse(cfg.norm_eps != LATENT_NORM_EPS,
            f"model.norm_eps={cfg.norm_eps}: transformers' DeepSeek-V3 latent norms use {LATENT_NORM_EPS}")
    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        moe_intermediate_size=m.ffn_hidden_size or cfg.ffn_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        n_shared_experts=_shared_count(cfg), n_routed_experts=m.num_experts, routed_scaling_factor=m.scaling_factor,
        kv_lora_rank=lat.kv_lora_rank, q_lora_rank=lat.q_lora_rank or None, qk_rope_head_dim=lat.qk_rope_head_dim,
        v_head_dim=lat.v_head_dim, qk_nope_head_dim=lat.qk_nope_head_dim, n_group=m.num_groups,
        topk_group=m.topk_groups, num_experts_per_tok=m.top_k, first_k_dense_replace=_dense_prefix(cfg),
        norm_topk_prob=m.normalize_topk, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_theta=cfg.rope_base, rope_interleave=True, attention_bias=False, num_mtp_layers=0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _from_hf(hf: Any) -> ModelConfig:
    _refuse(hf.hidden_act != "silu", f"DeepSeek-V3 hidden_act={hf.hidden_act!r}; only 'silu' is supported")
    _refuse(bool(getattr(hf, "attention_bias", False)), "DeepSeek-V3 attention_bias=True is not supported")
    _refuse(getattr(hf, "rope_interleave", True) is False,
            "DeepSeek-V3 rope_interleave=False is not supported (DeepSeek's checkpoints interleave)")
    _refuse(hf.num_key_value_heads != hf.num_attention_heads,
            f"DeepSeek-V3 num_key_value_heads={hf.num_key_value_heads} != num_attention_heads="
            f"{hf.num_attention_heads}: latent attention expands every head's keys")
    _refuse(hf.rms_norm_eps != LATENT_NORM_EPS,
            f"DeepSeek-V3 rms_norm_eps={hf.rms_norm_eps}: transformers' latent norms use {LATENT_NORM_EPS} whatever "
            f"this is, ours use the model's; only {LATENT_NORM_EPS} imports exactly")
    _refuse(not hf.n_shared_experts, f"DeepSeek-V3 n_shared_experts={hf.n_shared_experts} is not supported (>= 1)")
    moe = dict(num_experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok, ffn_hidden_size=hf.moe_intermediate_size,
               num_shared_experts=hf.n_shared_experts, dense_first=hf.first_k_dense_replace or 0,
               score_function="sigmoid", normalize_topk=bool(hf.norm_topk_prob),
               scaling_factor=float(hf.routed_scaling_factor), num_groups=hf.n_group or 1,
               topk_groups=hf.topk_group or 1, bias_update_rate=IMPORTED_BIAS_UPDATE_RATE)
    mla = dict(kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank or 0, qk_nope_head_dim=hf.qk_nope_head_dim,
               qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim)
    return ModelConfig(arch="llama", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                       num_heads=hf.num_attention_heads, num_kv_heads=hf.num_attention_heads,
                       ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
                       max_seq_len=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps, rope_base=_rope_base(hf),
                       tie_embeddings=bool(hf.tie_word_embeddings), use_bias=False, init_std=hf.initializer_range,
                       name="hf_deepseek_v3", moe=moe, mla=mla)


DEEPSEEK_V3 = HFFormat(
    arch="llama", model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", modules=_MODULES,
    layer_prefix="model.layers.{}.", qkv=(), transposed_weights=False, config_to_hf=_to_hf, config_from_hf=_from_hf,
    moe_module="mlp", fused_moe_module="mlp", reorder=_reorder, layer_buffers=_buffers,
)
