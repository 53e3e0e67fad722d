"""Hugging Face mixture-of-experts families as data: Mixtral, Qwen2-MoE, Qwen3-MoE.

Each is an ``models.hf_formats.HFFormat`` over the Llama layout plus the MoE block's names: the router
(``mlp.router`` -> ``gate``), routed experts by global index (``experts.{e}.w1/w3/w2`` -> Mixtral's
``w1/w3/w2``, Qwen's ``gate_proj/up_proj/down_proj``), Qwen2-MoE's one shared expert and its sigmoid gate
(``shared_expert``, ``shared_expert_gate``), Qwen3's per-head ``q_norm``/``k_norm``. What differs between
the families is config data: Qwen2 has q/k/v biases and no o bias (``model.qkv_bias``), dense layers
listed by index (``mlp_only_layers`` / ``decoder_sparse_step`` <-> ``model.moe.dense_layers``), unnormalised
top-k weights by default (``norm_topk_prob`` <-> ``moe.normalize_topk``).

Names are those of checkpoints (one tensor per expert, as on the hub; transformers >= 5 converts them
when loading). transformers >= 5 *modules* fuse each layer's experts; ``unfuse_experts`` /
``fuse_experts`` convert a module state dict from / to the checkpoint names.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from models.config import ModelConfig
from models.hf_format_spec import HFFormat, rope_base as _rope_base

_ATTENTION = (("embedding.word", "model.embed_tokens"), ("final_norm", "model.norm"), ("head", "lm_head"),
              ("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm"), ("attn.out", "self_attn.o_proj"),
              ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj"))
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def _experts(block: str, names: tuple[str, str, str]) -> tuple[tuple[str, str], ...]:
    return (("mlp.router", f"{block}.gate"), (f"mlp.experts.{{e}}.w1", f"{block}.experts.{{e}}.{names[0]}"),
            (f"mlp.experts.{{e}}.w3", f"{block}.experts.{{e}}.{names[1]}"),
            (f"mlp.experts.{{e}}.w2", f"{block}.experts.{{e}}.{names[2]}"))


def _common(hf: Any) -> dict[str, Any]:
    if hf.hidden_act != "silu":
        raise ValueError(f"HF {hf.model_type} hidden_act={hf.hidden_act!r}; only 'silu' is supported")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError(f"HF {hf.model_type} use_sliding_window=True is not supported")
    return dict(arch="llama", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
                vocab_size=hf.vocab_size, max_seq_len=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps,
                rope_base=_rope_base(hf), tie_embeddings=bool(hf.tie_word_embeddings), use_bias=False,
                init_std=hf.initializer_range)


def _head_dim(cfg: ModelConfig) -> dict[str, Any]:
    return {} if cfg.kv_channels is None else {"head_dim": cfg.kv_channels}


def _kv_channels(hf: Any) -> int | None:
    d = getattr(hf, "head_dim", None)
    return None if d is None or d * hf.num_attention_heads == hf.hidden_size else int(d)


def _common_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.use_bias:
        raise ValueError("model.use_bias=true has no HF MoE family (Qwen2-MoE: model.qkv_bias)")
    if cfg.mla.enabled:
        raise ValueError("model.mla: no HF export for latent attention yet (DeepSeek-V3 is not supported)")
    m = cfg.moe
    if m.capacity_factor is not None or m.score_function != "softmax" or m.num_groups != 1 or m.scaling_factor != 1.0:
        raise ValueError(f"model.moe (score_function={m.score_function!r}, capacity_factor={m.capacity_factor}, "
                         f"num_groups={m.num_groups}, scaling_factor={m.scaling_factor}): Mixtral / Qwen-MoE route "
                         f"dropless softmax top-k, ungrouped, unscaled")
    return dict(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.kv_heads, vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_seq_len,
                rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_base, tie_word_embeddings=cfg.tie_embeddings,
                num_experts_per_tok=m.top_k, initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None,
                pad_token_id=None, **_head_dim(cfg))


def _dense_layers(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.num_layers) if not cfg.moe.is_moe_layer(i)]


# ---- Mixtral --------------------------------------------------------------------------------
def _mixtral_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    m, common = cfg.moe, _common_to_hf(cfg)  # the routing checks first: they name the keys
    if cfg.qk_norm or cfg.qkv_bias or m.num_shared_experts or _dense_layers(cfg) or not m.normalize_topk:
        raise ValueError("Mixtral has no q/k norms, q/k/v biases, shared experts, dense layers or unnormalised "
                         "top-k weights (use Qwen2-MoE / Qwen3-MoE configs)")
    # Every Mixtral layer is MoE, so its one intermediate_size is the expert width (model.ffn_hidden_size,
    # the dense width, is unused; reading the directory back gives ffn_hidden_size = the expert width).
    return transformers.MixtralConfig(intermediate_size=m.ffn_hidden_size or cfg.ffn_size,
                                      num_local_experts=m.num_experts,
                                      router_aux_loss_coef=m.aux_loss_coeff, **common)


def _mixtral_from_hf(hf: Any) -> ModelConfig:
    if getattr(hf, "sliding_window", None):
        raise ValueError(f"Mixtral sliding_window={hf.sliding_window} is not supported")
    return ModelConfig(**_common(hf), ffn_hidden_size=hf.intermediate_size, kv_channels=_kv_channels(hf),
                       name="hf_mixtral",
                       moe=dict(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok, normalize_topk=True,
                                aux_loss_coeff=hf.router_aux_loss_coef))


MIXTRAL = HFFormat(
    arch="llama", model_type="mixtral", architecture="MixtralForCausalLM",
    modules=(*_ATTENTION, *_experts("block_sparse_moe", ("w1", "w3", "w2"))),
    layer_prefix="model.layers.{}.", qkv=_QKV, transposed_weights=False,
    config_to_hf=_mixtral_to_hf, config_from_hf=_mixtral_from_hf,
    moe_module="block_sparse_moe", fused_moe_module="mlp", expert_names=("w1", "w3", "w2"),
)


# ---- Qwen2-MoE / Qwen3-MoE ------------------------------------------------------------------
def _qwen_moe_to_hf(cfg: ModelConfig, qwen3: bool) -> Any:
    import transformers

    m, common = cfg.moe, _common_to_hf(cfg)
    dense = dict(mlp_only_layers=_dense_layers(cfg), decoder_sparse_step=1,
                 moe_intermediate_size=m.ffn_hidden_size or cfg.ffn_size, intermediate_size=cfg.ffn_size,
                 num_experts=m.num_experts, norm_topk_prob=m.normalize_topk, router_aux_loss_coef=m.aux_loss_coeff)
    if qwen3:
        if not cfg.qk_norm or cfg.qkv_bias or m.num_shared_experts:
            raise ValueError("Qwen3-MoE has q/k norms (model.qk_norm=true), no q/k/v biases and no shared experts")
        return transformers.Qwen3MoeConfig(attention_bias=False, **dense, **common)
    if cfg.qk_norm or m.num_shared_experts != 1 or not m.shared_expert_gate:
        raise ValueError("Qwen2-MoE has one gated shared expert (moe.num_shared_experts=1, shared_expert_gate=true) "
                         "and no q/k norms")
    return transformers.Qwen2MoeConfig(qkv_bias=bool(cfg.qkv_bias), shared_expert_intermediate_size=(
        cfg.moe.shared_ffn_hidden_size or dense["moe_intermediate_size"]), **dense, **common)


def _qwen_moe_from_hf(hf: Any, qwen3: bool) -> ModelConfig:
    if qwen3 and getattr(hf, "attention_bias", False):
        raise ValueError("Qwen3-MoE attention_bias=True is not supported")
    only = set(hf.mlp_only_layers or ())
    dense = [i for i in range(hf.num_hidden_layers) if i in only or (i + 1) % hf.decoder_sparse_step]
    moe = dict(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok, ffn_hidden_size=hf.moe_intermediate_size,
               normalize_topk=bool(hf.norm_topk_prob), aux_loss_coeff=hf.router_aux_loss_coef, dense_layers=dense)
    extra: dict[str, Any] = dict(qk_norm=True)
    if not qwen3:
        moe.update(num_shared_experts=1, shared_ffn_hidden_size=hf.shared_expert_intermediate_size,
                   shared_expert_gate=True)
        extra = dict(qkv_bias=bool(hf.qkv_bias))
    return ModelConfig(**_common(hf), ffn_hidden_size=hf.intermediate_size, kv_channels=_kv_channels(hf),
                       name="hf_qwen3_moe" if qwen3 else "hf_qwen2_moe", moe=moe, **extra)


_QWEN_EXPERTS = _experts("mlp", ("gate_proj", "up_proj", "down_proj"))
QWEN2_MOE = HFFormat(
    arch="llama", model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM",
    modules=(*_ATTENTION, *_QWEN_EXPERTS, ("mlp.shared_experts.w1", "mlp.shared_expert.gate_proj"),
             ("mlp.shared_experts.w3", "mlp.shared_expert.up_proj"),
             ("mlp.shared_experts.w2", "mlp.shared_expert.down_proj"),
             ("mlp.shared_expert_gate", "mlp.shared_expert_gate")),
    layer_prefix="model.layers.{}.", qkv=_QKV, transposed_weights=False,
    config_to_hf=lambda cfg: _qwen_moe_to_hf(cfg, qwen3=False),
    config_from_hf=lambda hf: _qwen_moe_from_hf(hf, qwen3=False), moe_module="mlp",
)
QWEN3_MOE = HFFormat(
    arch="llama", model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    modules=(*_ATTENTION, *_QWEN_EXPERTS, ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")),
    layer_prefix="model.layers.{}.", qkv=_QKV, transposed_weights=False,
    config_to_hf=lambda cfg: _qwen_moe_to_hf(cfg, qwen3=True),
    config_from_hf=lambda hf: _qwen_moe_from_hf(hf, qwen3=True), moe_module="mlp",
)
MOE_FORMATS: tuple[HFFormat, ...] = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)


def moe_format(cfg: ModelConfig) -> HFFormat:
    """The HF family of a Llama-arch model with MoE layers, q/k norms or separate q/k/v biases:
    q/k norms -> Qwen3-MoE; a shared expert or q/k/v biases -> Qwen2-MoE; otherwise Mixtral.
    (``config_to_hf`` then refuses what the family cannot hold.)"""
    if cfg.qk_norm:
        return QWEN3_MOE
    if cfg.moe.num_shared_experts or cfg.qkv_bias is not None or not cfg.moe.enabled:
        return QWEN2_MOE
    return MIXTRAL


# ---- fused experts (transformers >= 5 modules) <-> one tensor per expert (checkpoints) -------------------
def unfuse_experts(state: Mapping[str, torch.Tensor], fmt: HFFormat) -> dict[str, torch.Tensor]:
    """A transformers >= 5 module state dict -> checkpoint names (unchanged if nothing is fused)."""
    if not fmt.moe_module or not any(k.endswith(".experts.gate_up_proj") for k in state):
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    fused, block = f".{fmt.fused_moe_module}.", f".{fmt.moe_module}."
    gate, up, down = fmt.expert_names
    for key, value in state.items():
        if key.endswith(".experts.gate_up_proj"):
            prefix = key[: -len("gate_up_proj")].replace(fused, block)
            width = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.{gate}.weight"] = value[e, :width]
                out[f"{prefix}{e}.{up}.weight"] = value[e, width:]
        elif key.endswith(".experts.down_proj"):
            prefix = key[: -len("down_proj")].replace(fused, block)
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.{down}.weight"] = value[e]
        elif key.endswith(f"{fused}gate.weight"):
            out[key.replace(fused, block)] = value
        else:
            out[key] = value
    return out


def fuse_experts(state: Mapping[str, torch.Tensor], fmt: HFFormat, num_experts: int) -> dict[str, torch.Tensor]:
    """Checkpoint names -> a transformers >= 5 module state dict (inverse of ``unfuse_experts``)."""
    if not fmt.moe_module:
        return dict(state)
    gate, up, down = fmt.expert_names
    block, fused = f".{fmt.moe_module}.", f".{fmt.fused_moe_module}."
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if f"{block}experts." in key:
            if key.endswith(f".0.{gate}.weight"):
                prefix = key[: -len(f"0.{gate}.weight")]
                pairs = [torch.cat([state[f"{prefix}{e}.{gate}.weight"], state[f"{prefix}{e}.{up}.weight"]])
                         for e in range(num_experts)]
                out[prefix.replace(block, fused) + "gate_up_proj"] = torch.stack(pairs)
                out[prefix.replace(block, fused) + "down_proj"] = torch.stack(
                    [state[f"{prefix}{e}.{down}.weight"] for e in range(num_experts)])
        elif key.endswith(f"{block}gate.weight"):
            out[key.replace(block, fused)] = value
        else:
            out[key] = value
    return out


