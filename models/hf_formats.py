"""Hugging Face ``transformers`` model families as data: tensor names, layouts and configs.

One ``HFFormat`` per family, keyed by our ``model.arch`` in ``HF_FORMATS``: how our modules are
named there (``modules``: globals by full path, layer modules relative to ``layer_prefix``), how
our fused, kv-grouped QKV is stored (``qkv``: one fused ``[Q | K | V]`` module or separate q, k, v
modules), whether 2-D weights are stored transposed (GPT-2's ``Conv1D``), and the two config
conversions. ``models.hf`` converts any format with the same code, tensor by tensor of
``config.shape``, so a bias or norm the spec adds maps by its module name, with no code per
family. A new family is one more ``HFFormat``.
"""

from __future__ import annotations

from typing import Any

from models.config import ModelConfig
from models.hf_deepseek import DEEPSEEK_V3
from models.hf_format_spec import HFFormat, rope_base as _rope_base
from models.hf_moe import MOE_FORMATS, moe_format


# ---- GPT-2 ---------------------------------------------------------------------------------
def _gpt2_to_hf(cfg: ModelConfig) -> Any:
    import transformers  # the optional "hf" extra

    if not (cfg.use_bias and cfg.tie_embeddings):
        raise ValueError("GPT-2 in transformers needs use_bias=True and tie_embeddings=True")
    return transformers.GPT2Config(n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_heads,
                                   n_inner=cfg.ffn_size, vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len,
                                   layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new",
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None)


def _gpt2_from_hf(hf: Any) -> ModelConfig:
    if hf.activation_function != "gelu_new":
        raise ValueError(f"GPT-2 activation_function={hf.activation_function!r}; only 'gelu_new' is supported")
    return ModelConfig(arch="gpt", num_layers=hf.n_layer, hidden_size=hf.n_embd, num_heads=hf.n_head,
                       ffn_hidden_size=hf.n_inner, vocab_size=hf.vocab_size, max_seq_len=hf.n_positions,
                       norm_eps=hf.layer_norm_epsilon, tie_embeddings=True, use_bias=True,
                       init_std=hf.initializer_range, name="hf_gpt2")


GPT2 = HFFormat(
    arch="gpt", model_type="gpt2", architecture="GPT2LMHeadModel",
    modules=(("embedding.word", "transformer.wte"), ("embedding.position", "transformer.wpe"),
             ("final_norm", "transformer.ln_f"), ("head", "lm_head"),
             ("norm1", "ln_1"), ("norm2", "ln_2"), ("attn.out", "attn.c_proj"),
             ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")),
    layer_prefix="transformer.h.{}.", qkv=("attn.c_attn",), transposed_weights=True,
    config_to_hf=_gpt2_to_hf, config_from_hf=_gpt2_from_hf,
)


# ---- Llama ---------------------------------------------------------------------------------
def _llama_to_hf(cfg: ModelConfig) -> Any:
    import transformers  # the optional "hf" extra

    # Our use_bias puts biases on q, k, v, o (HF attention_bias) and on gate, up, down (mlp_bias).
    return transformers.LlamaConfig(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                    num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
                                    intermediate_size=cfg.ffn_size, vocab_size=cfg.vocab_size,
                                    max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                                    rope_theta=cfg.rope_base, tie_word_embeddings=cfg.tie_embeddings,
                                    attention_bias=cfg.use_bias, mlp_bias=cfg.use_bias,
                                    initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None,
                                    pad_token_id=None)


def _llama_from_hf(hf: Any) -> ModelConfig:
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        raise ValueError(f"Llama head_dim={head_dim} * heads={hf.num_attention_heads} != hidden={hf.hidden_size}")
    attention_bias, mlp_bias = bool(getattr(hf, "attention_bias", False)), bool(getattr(hf, "mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(f"Llama attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported "
                         f"(model.use_bias sets both)")
    if hf.hidden_act != "silu":
        raise ValueError(f"Llama hidden_act={hf.hidden_act!r}; only 'silu' is supported")
    return ModelConfig(arch="llama", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                       num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
                       ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
                       max_seq_len=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps, rope_base=_rope_base(hf),
                       tie_embeddings=bool(hf.tie_word_embeddings), use_bias=attention_bias,
                       init_std=hf.initializer_range, name="hf_llama")


LLAMA = HFFormat(
    arch="llama", model_type="llama", architecture="LlamaForCausalLM",
    modules=(("embedding.word", "model.embed_tokens"), ("final_norm", "model.norm"), ("head", "lm_head"),
             ("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm"), ("attn.out", "self_attn.o_proj"),
             ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj")),
    layer_prefix="model.layers.{}.", qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    transposed_weights=False, config_to_hf=_llama_to_hf, config_from_hf=_llama_from_hf,
)

HF_FORMATS: dict[str, HFFormat] = {f.arch: f for f in (GPT2, LLAMA)}  # dense families by our arch


def hf_format(cfg: ModelConfig) -> HFFormat:
    """The HF family that stores ``cfg``: by ``arch``; latent attention is DeepSeek-V3; a mixture of experts
    by its features (``models.hf_moe.moe_format``)."""
    if cfg.arch not in HF_FORMATS:
        raise ValueError(f"model.arch={cfg.arch!r} has no Hugging Face format; known: {sorted(HF_FORMATS)}")
    if cfg.mla.enabled:  # latent attention: only DeepSeek-V3 (which refuses what it cannot hold)
        return DEEPSEEK_V3
    if cfg.moe.enabled or cfg.qk_norm or cfg.qkv_bias is not None:
        return moe_format(cfg)
    return HF_FORMATS[cfg.arch]


def hf_format_of_model_type(model_type: object) -> HFFormat:
    """The format of an HF config's ``model_type``."""
    formats = (*HF_FORMATS.values(), *MOE_FORMATS, DEEPSEEK_V3)
    for fmt in formats:
        if fmt.model_type == model_type:
            return fmt
    known = " or ".join(repr(f.model_type) for f in formats)
    raise ValueError(f"HF model_type={model_type!r} is not supported; use {known}")
