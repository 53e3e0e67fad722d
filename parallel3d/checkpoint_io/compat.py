"""Can this job resume from that checkpoint? Format and model checks, each failing in one line.

A checkpoint written at any layout resumes at any other; what cannot change is the model's
shape (the fields below) and the format; a setting that keeps the shapes but changes what the model computes
(``moe.top_k``, ``rope_base``, ``norm_eps``, ...) may change, and ``computation_changes`` names each one for the
resume's warning. Checkpoints of the earlier per-rank format
(``zero/`` directory, same tp/pp only, no ``format`` in meta.json) are refused, not read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from models.config import ModelConfig
from models.params import parameter_shapes
from parallel3d.checkpoint import CheckpointError

FORMAT = "parallel3d-dcp-v1"
STATE_DIR = "state"  # the DCP directory inside a checkpoint
TRAINER_KEY = "trainer"  # the trainer-state object in the DCP directory

# What fixes the parameters' names and shapes (dropout, init_std, norm_eps, kernels may change).
SHAPE_FIELDS = ("arch", "num_layers", "hidden_size", "num_heads", "kv_heads", "ffn_size", "vocab_size",
                "tie_embeddings", "use_bias")


# ModelConfig fields that do not change what a resumed model computes: a label, kernels of the same function, and
# the initialisation (the checkpoint's weights replace it). Every other field is compared (``computation_changes``).
NOT_COMPUTATION = ("name", "kernel_backend", "fused_kernels", "init_std")


def model_signature(cfg: ModelConfig) -> dict[str, Any]:
    sig = {key: getattr(cfg, key) for key in SHAPE_FIELDS}
    if cfg.spec.learned_positions:
        sig["max_seq_len"] = cfg.max_seq_len  # the learned position table's rows
    return sig


def check_format(directory: str, meta: dict[str, Any]) -> None:
    fmt = meta.get("format")
    if fmt == FORMAT:
        return
    if fmt is None and os.path.isdir(os.path.join(directory, "zero")):
        raise CheckpointError(
            f"checkpoint {directory} uses the old per-rank format (parallel3d-zero-v1), which this version does "
            f"not read; resume it with the parallel3d version that wrote it, or start from scratch "
            f"(another train.out_dir, or train.resume=none after moving {os.path.dirname(directory)} away)"
        )
    raise CheckpointError(f"checkpoint {directory} has format {fmt!r}; this version reads {FORMAT!r}")


def _other_parameters(saved: ModelConfig, cfg: ModelConfig) -> list[str]:
    """Where ``model_signature`` agrees, the settings that still change a parameter's name or shape (q/k norms,
    q/k/v biases, the head width, the experts, latent attention): each differing setting and a parameter. Both
    models are built on the meta device, so only where the configs differ at all (seconds for the largest)."""
    if dataclasses.replace(saved, kernel_backend=cfg.kernel_backend, name=cfg.name) == cfg:
        return []
    theirs, ours = parameter_shapes(saved), parameter_shapes(cfg)
    if theirs == ours:
        return []
    settings = [f"{f.name}={getattr(saved, f.name)!r} there, {getattr(cfg, f.name)!r} here"
                for f in dataclasses.fields(ModelConfig)
                if f.name not in ("kernel_backend", "name") and getattr(saved, f.name) != getattr(cfg, f.name)]
    names = sorted(set(theirs) ^ set(ours)) or sorted(k for k in ours if theirs[k] != ours[k])
    return [*settings, f"e.g. parameter {names[0]}"]


def check_same_model(directory: str, meta: dict[str, Any], cfg: ModelConfig) -> None:
    """Raise unless the checkpoint's model has the same parameters (names and shapes) as ``cfg``."""
    saved = meta.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {directory}: meta.json has no model section")
    saved_cfg = ModelConfig(**saved)
    theirs = model_signature(saved_cfg)
    ours = model_signature(cfg)
    diff = [f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in ours if theirs.get(k) != ours.get(k)]
    diff = diff or _other_parameters(saved_cfg, cfg)
    if diff:
        raise CheckpointError(f"checkpoint {directory} holds another model ({'; '.join(diff)}): a layout may "
                              f"change on resume, the model's shape may not")


def _differences(saved: Any, cfg: Any, prefix: str = "") -> list[str]:
    """``key=<there> there, <here> here`` for each differing field of two config dataclasses, nested ones (``moe``,
    ``mla``) by their dotted key, as a user writes the override."""
    out = []
    for f in dataclasses.fields(cfg):
        there, here = getattr(saved, f.name), getattr(cfg, f.name)
        if prefix == "" and f.name in NOT_COMPUTATION or there == here:
            continue
        if dataclasses.is_dataclass(here):
            out += _differences(there, here, f"{prefix}{f.name}.")
        else:
            out.append(f"model.{prefix}{f.name}={there!r} there, {here!r} here")
    return out


def computation_changes(directory: str, meta: dict[str, Any], cfg: ModelConfig) -> str | None:
    """The warning for resuming ``directory`` (whose model ``check_same_model`` accepted) with settings that change
    the model's computation but no parameter's shape (each field of ``ModelConfig`` but ``NOT_COMPUTATION``), or
    None when there is none. Changing them is legitimate (a run may lower top_k), so this warns, never refuses."""
    diff = _differences(ModelConfig(**meta["model"]), cfg)
    if not diff:
        return None
    return (f"resuming checkpoint {directory} with model settings that change what the model computes: "
            f"{'; '.join(diff)}; the run continues with this run's settings")
