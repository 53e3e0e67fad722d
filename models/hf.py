"""Hugging Face ``transformers`` interop: GPT2LMHeadModel and LlamaForCausalLM (extra ``hf``).

- ``from_hf(hf_model_or_state_dict, config=None, pstate=None)`` builds a (possibly
  sharded) parallel3d model holding the HF weights; the config comes from the HF
  model's own config when omitted (required with a bare state dict).
- ``to_hf(model)`` gathers the shards and returns the HF state dict, which
  ``transformers`` loads with ``load_state_dict(strict=True)``.

Both go through ``models.state``, so they follow the expert grid too: routed experts are
split over ``ep`` by global expert index and their matrices over ``etp`` (which may differ
from tp). ``from_hf`` also builds a pipeline stage's chunk (``layer_range``, ``pre_process``,
``post_process`` in its ``build_kwargs``: it loads what the chunk holds); ``to_hf`` needs the
whole model; a run at any layout, pp included, exports through its checkpoint
(``parallel3d.checkpoint_io.hf_export``).
- ``hf_config(config)`` makes the matching ``transformers`` config (no download).
DeepSeek-V3 (latent attention, ``models.hf_deepseek``) adds a row order (``HFFormat.reorder``) and the
routers' expert-bias buffers (``HFFormat.layer_buffers``: ``from_hf`` loads them, ``to_hf`` writes them,
zero where the source has none). Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: ``models.hf_moe``) use
checkpoint names, one
tensor per expert; a transformers >= 5 module's fused experts are accepted on import
(``models.hf_moe.unfuse_experts``) and ``models.hf_moe.fuse_experts`` makes ``to_hf``'s dict loadable
into such a module.

Each family's names and layouts are data (``models.hf_formats``): GPT-2's ``Conv1D`` stores
``[in, out]`` (the transpose of ours) and its ``c_attn`` output is ``[Q | K | V]``; Llama has
separate q/k/v projections. Ours is one fused QKV grouped by key/value head (``models.blocks``);
``group_qkv`` / ``ungroup_qkv`` convert. Conversion walks ``config.shape``'s tensors, so every
tensor the spec gives the model (biases included) is converted. HF keys and shapes are checked
against the config before any tensor is converted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from models.config import ModelConfig
from models.hf_formats import hf_format, hf_format_of_model_type
from models.hf_moe import unfuse_experts
from models.shape import ParamShape
from models.state import check_keys, full_state_dict, load_full_state_dict
from models.transformer import TransformerLM, build_model
from parallel3d.parallel_state import ParallelState

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
def config_from_hf(hf: Any) -> ModelConfig:
    """Our ``ModelConfig`` for a ``transformers`` config of a supported family (``models.hf_formats``)."""
    return hf_format_of_model_type(getattr(hf, "model_type", None)).config_from_hf(hf)


def hf_config(cfg: ModelConfig) -> "transformers.PretrainedConfig":
    """The ``transformers`` config of the same architecture (dropout off; nothing downloaded)."""
    return hf_format(cfg).config_to_hf(cfg)


# ---- name/layout maps (full tensors), one unit at a time ---------------------------------
# A unit is the global tensors (embeddings, final norm, head) or one layer: HF tensors of a
# unit depend only on our tensors of the same unit, so export/import can stream unit by unit.
GLOBALS = "globals"
QKV = "attn.qkv"  # our fused, kv-grouped projection (models.blocks)


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


def _unit_tensors(cfg: ModelConfig, unit: object) -> tuple[ParamShape, ...]:
    shape = cfg.shape
    if unit == GLOBALS:
        return (*shape.embedding, *shape.final_norm, *shape.head)
    return shape.layers[unit].tensors


def _split_name(cfg: ModelConfig, unit: object, name: str) -> tuple[str, str, str]:
    """(HF prefix, our module path within the unit, parameter suffix) of one of our names."""
    if unit == GLOBALS:
        prefix, rest = "", name
    else:
        prefix, rest = hf_format(cfg).layer_prefix.format(unit), name.split(".", 2)[2]
    module, suffix = rest.rsplit(".", 1)
    if suffix not in ("weight", "bias"):  # expert matrices are named w1/w2/w3 themselves (parallel3d.moe)
        module, suffix = rest, "weight"
    return prefix, module, suffix


def to_hf_unit(full: Mapping[str, torch.Tensor], cfg: ModelConfig, unit: object) -> dict[str, torch.Tensor]:
    """HF tensors of ``unit`` from our full tensors of it (``lm_head.weight`` included, tied or not)."""
    fmt, out = hf_format(cfg), {}
    for t in _unit_tensors(cfg, unit):
        prefix, module, suffix = _split_name(cfg, unit, t.name)
        value = full[t.name]
        if module == QKV:
            parts = ungroup_qkv(value, cfg)
            if len(fmt.qkv) == 1:
                parts = (torch.cat(parts),)
            for hf_module, part in zip(fmt.qkv, parts):
                out[f"{prefix}{hf_module}.{suffix}"] = part.t() if fmt.transposed_weights and part.dim() == 2 else part
        elif fmt.transposed_weights and unit != GLOBALS and value.dim() == 2:
            out[f"{prefix}{fmt.hf_module(module)}.{suffix}"] = value.t()
        else:
            if fmt.reorder is not None:
                value = fmt.reorder(cfg, module, value, True)
            out[f"{prefix}{fmt.hf_module(module)}.{suffix}"] = value
    if unit == GLOBALS and cfg.spec.tied_head:
        out[f"{fmt.hf_module('head')}.weight"] = full[cfg.shape.word_embedding.name]
    for ours, theirs, shape in _unit_buffers(cfg, unit):
        # A buffer the source lacks (a checkpoint's master weights, a model without expert bias) is zero.
        default = torch.zeros(shape, dtype=torch.float32, device=next(iter(full.values())).device)
        out[f"{hf_format(cfg).layer_prefix.format(unit)}{theirs}"] = full.get(ours, default)
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_unit(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, unit: object) -> dict[str, torch.Tensor]:
    """Our full tensors of ``unit`` from the HF tensors of it (a tied ``lm_head.weight`` is not needed)."""
    fmt, full = hf_format(cfg), {}
    for t in _unit_tensors(cfg, unit):
        prefix, module, suffix = _split_name(cfg, unit, t.name)
        if module == QKV:
            parts = [hf[f"{prefix}{m}.{suffix}"] for m in fmt.qkv]
            parts = [p.t() if fmt.transposed_weights and p.dim() == 2 else p for p in parts]
            if len(parts) == 1:
                a = cfg.spec.blocks[unit].attention
                parts = parts[0].split([a.q_size, a.kv_size, a.kv_size])
            full[t.name] = group_qkv(*parts, cfg)
            continue
        value = hf[f"{prefix}{fmt.hf_module(module)}.{suffix}"]
        if fmt.reorder is not None:
            value = fmt.reorder(cfg, module, value, False)
        full[t.name] = value.t() if fmt.transposed_weights and unit != GLOBALS and value.dim() == 2 else value
    for ours, theirs, _ in _unit_buffers(cfg, unit):
        full[ours] = hf[f"{fmt.layer_prefix.format(unit)}{theirs}"]
    return full


def _unit_buffers(cfg: ModelConfig, unit: object) -> list[tuple[str, str, tuple[int, ...]]]:
    """(our full buffer name, HF path within the layer, shape) of the non-parameter tensors of ``unit``."""
    fmt = hf_format(cfg)
    if unit == GLOBALS or fmt.layer_buffers is None:
        return []
    return [(f"layers.{unit}.{ours}", theirs, shape) for ours, theirs, shape in fmt.layer_buffers(cfg, unit)]


def _load_buffers(model: TransformerLM, values: Mapping[str, torch.Tensor]) -> None:
    """Copy converted buffers into ``model``; one the model has no place for must be zero (it changes nothing)."""
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in values.items():
            if name in buffers:
                buffers[name].copy_(value)
            elif bool(value.ne(0).any()):
                raise ValueError(f"{name}: the HF weights hold a nonzero value but the model has no such buffer "
                                 f"(an expert bias needs model.moe.bias_update_rate > 0)")


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
    """HF key -> shape for ``cfg`` (from ``cfg.shape``, on the meta device)."""
    full = {t.name: torch.empty(t.shape, device="meta") for t in cfg.shape.tensors()}
    return {k: tuple(v.shape) for k, v in _to_hf_tensors(full, cfg).items()}


def _validate_hf_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    # transformers >= 5 modules fuse each layer's experts; checkpoints (our names) hold one per expert.
    state = unfuse_experts({k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}, hf_format(cfg))
    expected = expected_hf_shapes(cfg)
    if cfg.tie_embeddings:  # the tied lm_head is optional in saved HF checkpoints
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    check_keys(set(expected), set(state), f"HF state dict does not match the {cfg.arch} config")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{key}: shape {tuple(state[key].shape)} in the HF state dict, expected {shape}")
    return state


def _in_chunk(model: TransformerLM, name: str) -> bool:
    """Whether ``model`` (a pipeline stage's chunk: its layers, the embedding and/or the head) holds the
    full tensor ``name``: any tensor of its layers (experts of other ep ranks too: ``models.state`` expects
    them), and the global tensors it has."""
    unit = unit_of(name)
    if unit != GLOBALS:
        return model.layer_range[0] <= unit < model.layer_range[1]
    return name in {getattr(p, "global_name", None) for p in model.parameters()}


# ---- public API ----------------------------------------------------------------------
def from_hf(
    hf_model_or_state_dict: "nn.Module | Mapping[str, torch.Tensor]",
    config: ModelConfig | None = None,
    pstate: ParallelState | None = None,
    **build_kwargs: Any,
) -> TransformerLM:
    """A parallel3d model (this rank's shard: tp, and the ep block / etp slice of the experts) holding
    the HF weights; see module docstring.

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
    converted = {k: v for k, v in _from_hf_tensors(state, config).items() if _in_chunk(model, k)}
    params = {t.name for t in config.shape.tensors()}
    load_full_state_dict(model, {k: v for k, v in converted.items() if k in params})
    _load_buffers(model, {k: v for k, v in converted.items() if k not in params})
    return model


def to_hf(model: TransformerLM) -> dict[str, torch.Tensor]:
    """The HF state dict of a whole model (shards gathered: a collective over tp, etp and ep)."""
    cfg = model.config
    if not (model.pre_process and model.post_process and model.layer_range == (0, cfg.num_layers)):
        raise ValueError(f"to_hf needs the whole model; this module holds layers {model.layer_range} "
                         f"(pre_process={model.pre_process}, post_process={model.post_process})")
    hf_config(cfg)  # raises if the HF family cannot represent this config
    return _to_hf_tensors({**dict(model.named_buffers()), **full_state_dict(model)}, cfg)
