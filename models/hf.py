"""Hugging Face ``transformers`` interop: GPT2LMHeadModel and LlamaForCausalLM (extra ``hf``).

- ``from_hf(hf_model_or_state_dict, config=None, pstate=None)`` builds a (possibly
  tp-sharded) parallel3d model holding the HF weights; the config comes from the HF
  model's own config when omitted (required with a bare state dict).
- ``to_hf(model)`` gathers the tp shards and returns the HF state dict, which
  ``transformers`` loads with ``load_state_dict(strict=True)``.
- ``hf_config(config)`` makes the matching ``transformers`` config (no download).

Weight layouts: GPT-2's ``Conv1D`` stores ``[in, out]`` (the transpose of ours) and its
``c_attn`` output is ``[Q | K | V]``; Llama has separate q/k/v projections. Ours is one
fused QKV grouped by key/value head (``models.blocks``); ``group_qkv`` / ``ungroup_qkv``
convert. HF keys and shapes are checked against the config before any tensor is converted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from models.config import ModelConfig
from models.state import check_keys, full_state_dict, load_full_state_dict
from models.transformer import TransformerLM, build_model
from parallel3d.parallel_state import ParallelState
from parallel3d.tensor_parallel.sharding import full_shape

if TYPE_CHECKING:  # pragma: no cover
    import transformers

# Non-parameter buffers some transformers versions put in state dicts.
_IGNORED_SUFFIXES = (".attn.masked_bias", ".attn.bias", ".rotary_emb.inv_freq")


def group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Separate q ``[H*d, ...]``, k/v ``[K*d, ...]`` -> our fused ``[(H+2K)*d, ...]`` grouped by kv head."""
    groups, d, rest = cfg.kv_heads, cfg.head_dim, q.shape[1:]
    parts = [q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def ungroup_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``group_qkv``."""
    groups, d, rest = cfg.kv_heads, cfg.head_dim, qkv.shape[1:]
    per_group = (cfg.num_heads // groups) * d
    g = qkv.reshape(groups, per_group + 2 * d, *rest)
    q, k, v = g[:, :per_group], g[:, per_group : per_group + d], g[:, per_group + d :]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# ---- configs ------------------------------------------------------------------------
def _rope_base(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf, "rope_scaling", None)
    if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
        raise ValueError(f"HF rope_type={rope_type!r} (rope scaling) is not supported; only 'default'")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    return float(10000.0 if theta is None else theta)


def config_from_hf(hf: Any) -> ModelConfig:
    """Our ``ModelConfig`` for a ``transformers`` GPT2Config / LlamaConfig."""
    kind = getattr(hf, "model_type", None)
    if kind == "gpt2":
        if hf.activation_function != "gelu_new":
            raise ValueError(f"GPT-2 activation_function={hf.activation_function!r}; only 'gelu_new' is supported")
        return ModelConfig(arch="gpt", num_layers=hf.n_layer, hidden_size=hf.n_embd, num_heads=hf.n_head,
                           ffn_hidden_size=hf.n_inner, vocab_size=hf.vocab_size, max_seq_len=hf.n_positions,
                           norm_eps=hf.layer_norm_epsilon, tie_embeddings=True, use_bias=True,
                           init_std=hf.initializer_range, name="hf_gpt2")
    if kind == "llama":
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if head_dim * hf.num_attention_heads != hf.hidden_size:
            raise ValueError(f"Llama head_dim={head_dim} * heads={hf.num_attention_heads} != hidden={hf.hidden_size}")
        if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
            raise ValueError("Llama attention_bias / mlp_bias are not supported")
        if hf.hidden_act != "silu":
            raise ValueError(f"Llama hidden_act={hf.hidden_act!r}; only 'silu' is supported")
        return ModelConfig(arch="llama", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                           num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
                           ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
                           max_seq_len=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps, rope_base=_rope_base(hf),
                           tie_embeddings=bool(hf.tie_word_embeddings), use_bias=False, init_std=hf.initializer_range,
                           name="hf_llama")
    raise ValueError(f"HF model_type={kind!r} is not supported; use 'gpt2' or 'llama'")


def hf_config(cfg: ModelConfig) -> "transformers.PretrainedConfig":
    """The ``transformers`` config of the same architecture (dropout off; nothing downloaded)."""
    import transformers

    if cfg.arch == "gpt":
        if not (cfg.use_bias and cfg.tie_embeddings):
            raise ValueError("GPT-2 in transformers needs use_bias=True and tie_embeddings=True")
        return transformers.GPT2Config(n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_heads,
                                       n_inner=cfg.ffn_size, vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len,
                                       layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new",
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None)
    if cfg.use_bias:
        raise ValueError("Llama in transformers has no biases; use use_bias=False")
    return transformers.LlamaConfig(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                    num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
                                    intermediate_size=cfg.ffn_size, vocab_size=cfg.vocab_size,
                                    max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                                    rope_theta=cfg.rope_base, tie_word_embeddings=cfg.tie_embeddings,
                                    attention_bias=False, mlp_bias=False, initializer_range=cfg.init_std,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None)


# ---- name/layout maps (full tensors), one unit at a time ---------------------------------
# A unit is the global tensors (embeddings, final norm, head) or one layer: HF tensors of a
# unit depend only on our tensors of the same unit, so export/import can stream unit by unit.
GLOBALS = "globals"


def hf_units(cfg: ModelConfig) -> list:
    """The conversion units: ``GLOBALS`` then the layer indices."""
    return [GLOBALS, *range(cfg.num_layers)]


def unit_of(name: str) -> object:
    """The unit of one of our global names (``layers.<i>.…`` -> i, else ``GLOBALS``)."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else GLOBALS


def hf_unit_of(key: str) -> object:
    """The unit of an HF key (``transformer.h.<i>.…`` / ``model.layers.<i>.…`` -> i)."""
    parts = key.split(".")
    for a, b in (("h", 2), ("layers", 2)):
        if len(parts) > b and parts[b - 1] == a and parts[b].isdigit():
            return int(parts[b])
    return GLOBALS


_GPT_LAYER_LINEARS = (("attn.out", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj"))
_LLAMA_LAYER_WEIGHTS = (("attn.out", "self_attn.o_proj"), ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"),
                        ("mlp.down", "mlp.down_proj"), ("norm1", "input_layernorm"),
                        ("norm2", "post_attention_layernorm"))


def to_hf_unit(full: Mapping[str, torch.Tensor], cfg: ModelConfig, unit: object) -> dict[str, torch.Tensor]:
    """HF tensors of ``unit`` from our full tensors of it (``lm_head.weight`` included, tied or not)."""
    out: dict[str, torch.Tensor] = {}
    if unit == GLOBALS:
        if cfg.arch == "gpt":
            out["transformer.wte.weight"] = full["embedding.word.weight"]
            out["transformer.wpe.weight"] = full["embedding.position.weight"]
            out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = full["final_norm.weight"], full["final_norm.bias"]
            out["lm_head.weight"] = full["embedding.word.weight"]
        else:
            out["model.embed_tokens.weight"] = full["embedding.word.weight"]
            out["model.norm.weight"] = full["final_norm.weight"]
            out["lm_head.weight"] = full["embedding.word.weight" if cfg.tie_embeddings else "head.weight"]
        return {k: v.contiguous() for k, v in out.items()}
    ours = f"layers.{unit}."
    if cfg.arch == "gpt":
        hf = f"transformer.h.{unit}."
        for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[f"{hf}{b}.weight"], out[f"{hf}{b}.bias"] = full[f"{ours}{a}.weight"], full[f"{ours}{a}.bias"]
        q, k, v = ungroup_qkv(full[ours + "attn.qkv.weight"], cfg)
        out[hf + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()  # Conv1D is [in, out]
        out[hf + "attn.c_attn.bias"] = torch.cat(ungroup_qkv(full[ours + "attn.qkv.bias"], cfg))
        for a, b in _GPT_LAYER_LINEARS:
            out[f"{hf}{b}.weight"] = full[f"{ours}{a}.weight"].t()
            out[f"{hf}{b}.bias"] = full[f"{ours}{a}.bias"]
    else:
        hf = f"model.layers.{unit}."
        q, k, v = ungroup_qkv(full[ours + "attn.qkv.weight"], cfg)
        out[hf + "self_attn.q_proj.weight"], out[hf + "self_attn.k_proj.weight"] = q, k
        out[hf + "self_attn.v_proj.weight"] = v
        for a, b in _LLAMA_LAYER_WEIGHTS:
            out[f"{hf}{b}.weight"] = full[f"{ours}{a}.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_unit(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, unit: object) -> dict[str, torch.Tensor]:
    """Our full tensors of ``unit`` from the HF tensors of it (a tied ``lm_head.weight`` is not needed)."""
    full: dict[str, torch.Tensor] = {}
    if unit == GLOBALS:
        if cfg.arch == "gpt":
            full["embedding.word.weight"] = hf["transformer.wte.weight"]
            full["embedding.position.weight"] = hf["transformer.wpe.weight"]
            full["final_norm.weight"], full["final_norm.bias"] = hf["transformer.ln_f.weight"], hf["transformer.ln_f.bias"]
        else:
            full["embedding.word.weight"] = hf["model.embed_tokens.weight"]
            full["final_norm.weight"] = hf["model.norm.weight"]
            if not cfg.tie_embeddings:
                full["head.weight"] = hf["lm_head.weight"]
        return full
    ours = f"layers.{unit}."
    if cfg.arch == "gpt":
        h = f"transformer.h.{unit}."
        for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
            full[f"{ours}{a}.weight"], full[f"{ours}{a}.bias"] = hf[f"{h}{b}.weight"], hf[f"{h}{b}.bias"]
        w, bias = hf[h + "attn.c_attn.weight"].t(), hf[h + "attn.c_attn.bias"]
        cuts = [cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
        full[ours + "attn.qkv.weight"] = group_qkv(*w.split(cuts), cfg)
        full[ours + "attn.qkv.bias"] = group_qkv(*bias.split(cuts), cfg)
        for a, b in _GPT_LAYER_LINEARS:
            full[f"{ours}{a}.weight"] = hf[f"{h}{b}.weight"].t()
            full[f"{ours}{a}.bias"] = hf[f"{h}{b}.bias"]
    else:
        h = f"model.layers.{unit}."
        full[ours + "attn.qkv.weight"] = group_qkv(hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"],
                                                   hf[h + "self_attn.v_proj.weight"], cfg)
        for a, b in _LLAMA_LAYER_WEIGHTS:
            full[f"{ours}{a}.weight"] = hf[f"{h}{b}.weight"]
    return full


def _to_hf_tensors(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for unit in hf_units(cfg):
        out.update(to_hf_unit(full, cfg, unit))
    return out


def _from_hf_tensors(hf: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for unit in hf_units(cfg):
        full.update(from_hf_unit(hf, cfg, unit))
    return full


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF key -> shape for ``cfg`` (computed on the meta device)."""
    meta = build_model(cfg, ParallelState.single_process(device="meta"), device="meta")
    full = {getattr(p, "global_name", n): torch.empty(full_shape(p, meta.pstate), device="meta")
            for n, p in meta.named_parameters()}
    return {k: tuple(v.shape) for k, v in _to_hf_tensors(full, cfg).items()}


def _validate_hf_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    expected = expected_hf_shapes(cfg)
    if cfg.tie_embeddings:  # the tied lm_head is optional in saved HF checkpoints
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    check_keys(set(expected), set(state), f"HF state dict does not match the {cfg.arch} config")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{key}: shape {tuple(state[key].shape)} in the HF state dict, expected {shape}")
    return state


# ---- public API ----------------------------------------------------------------------
def from_hf(
    hf_model_or_state_dict: "nn.Module | Mapping[str, torch.Tensor]",
    config: ModelConfig | None = None,
    pstate: ParallelState | None = None,
    **build_kwargs: Any,
) -> TransformerLM:
    """A parallel3d model (this rank's tp shard) holding the HF weights; see module docstring.

    ``build_kwargs`` go to ``build_model`` (``dtype``, ``sequence_parallel``, ``device``, ...).
    """
    if isinstance(hf_model_or_state_dict, nn.Module):
        state = hf_model_or_state_dict.state_dict()
        if config is None:
            config = config_from_hf(hf_model_or_state_dict.config)
    elif isinstance(hf_model_or_state_dict, Mapping):
        state = dict(hf_model_or_state_dict)
        if config is None:
            raise ValueError("from_hf(state_dict) needs config=ModelConfig(...) (a state dict carries no head counts)")
    else:
        raise ValueError(f"from_hf expects a transformers model or a state dict, got {type(hf_model_or_state_dict)}")
    state = _validate_hf_state(state, config)
    model = build_model(config, pstate or ParallelState.single_process(), **build_kwargs)
    load_full_state_dict(model, _from_hf_tensors(state, config))
    return model


def to_hf(model: TransformerLM) -> dict[str, torch.Tensor]:
    """The HF state dict of a whole model (tp shards gathered: a collective over tp)."""
    cfg = model.config
    if not (model.pre_process and model.post_process and model.layer_range == (0, cfg.num_layers)):
        raise ValueError(f"to_hf needs the whole model; this module holds layers {model.layer_range} "
                         f"(pre_process={model.pre_process}, post_process={model.post_process})")
    if cfg.arch == "gpt":
        hf_config(cfg)  # raises if GPT-2 cannot represent this config
    return _to_hf_tensors(full_state_dict(model), cfg)
