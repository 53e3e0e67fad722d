"""``train.init_from=hf:DIR``: start a run (step 0) from a transformers checkpoint directory.

Every rank reads only the conversion units (``models.hf``: globals, one layer) holding the
parameters it has, tensor by tensor from the safetensors files (``safe_open``: no whole
file is loaded), converts them to our layout and writes its boxes of them into its fp32
master weights (``pieces.pieces_to_read``); the parameters follow
(``ZeroOptimizer.params_from_master``). Adam moments start at zero, the step at 0. Any
layout works, as for checkpoints. ``check_init_from`` validates the directory (config,
every expected tensor and its shape) when the config is resolved, before any process group.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch

from models.config import ModelConfig
from models.hf import config_from_hf, expected_hf_shapes, from_hf_unit, hf_unit_of, unit_of
from parallel3d.checkpoint_io.compat import model_signature
from parallel3d.checkpoint_io.options import hf_dir_of
from parallel3d.checkpoint_io.pieces import BUFFER_PREFIX, buffer_pieces, pieces_to_read, zero_owned_state

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState
    from parallel3d.zero.optimizer import ZeroOptimizer


class HFWeights:
    """Tensors of a transformers directory by name (``model.safetensors`` or an index of shards)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as fh:
                self.file_of = dict(json.load(fh)["weight_map"])
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            from safetensors import safe_open

            with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
                self.file_of = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ValueError(f"{directory} has no model.safetensors nor model.safetensors.index.json")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        from safetensors import safe_open

        out = {}
        for file in sorted(set(self.file_of.values())):
            with safe_open(os.path.join(self.directory, file), framework="pt") as f:
                out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        return out

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.file_of[key], []).append(key)
        out = {}
        for file, names in by_file.items():
            with safe_open(os.path.join(self.directory, file), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in names})
        return out


def check_init_from(spec: str, cfg: ModelConfig) -> None:
    """Raise ValueError (one line) unless ``spec`` names a transformers directory of ``cfg``'s shape."""
    directory = hf_dir_of(spec)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"{directory} has no config.json (a transformers model directory is expected)")
    from transformers import AutoConfig

    theirs = model_signature(config_from_hf(AutoConfig.from_pretrained(directory, local_files_only=True)))
    ours = model_signature(cfg)
    diff = [f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} in model.*" for k in ours if theirs.get(k) != ours.get(k)]
    if diff:
        raise ValueError(f"another model ({'; '.join(diff)})")
    expected = expected_hf_shapes(cfg)
    stored = HFWeights(directory).shapes()
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise ValueError(f"tensors missing: {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    for key, shape in expected.items():
        if stored[key] != shape:
            raise ValueError(f"{key} has shape {list(stored[key])}, the model needs {list(shape)}")


@torch.no_grad()
def load_hf_weights(opt: "ZeroOptimizer", pstate: "ParallelState", spec: str, cfg: ModelConfig) -> None:
    """Set this rank's master weights (and parameters) from ``spec``; all ranks of the job call it."""
    weights = HFWeights(hf_dir_of(spec))
    pieces = pieces_to_read(opt, pstate, weights_only=True)
    hf_keys: dict[object, list[str]] = {}
    for key in expected_hf_shapes(cfg):
        if not (key == "lm_head.weight" and cfg.tie_embeddings):
            hf_keys.setdefault(hf_unit_of(key), []).append(key)
    by_unit: dict[object, list] = {}
    for piece in pieces:
        by_unit.setdefault(unit_of(piece.key.split(".", 1)[1]), []).append(piece)
    zero_owned_state(opt, weights_only=True)  # vocabulary padding stays zero
    # persistent buffers (the router's expert_bias <-> DeepSeek's e_score_correction_bias) where the format has them;
    # a format without the buffer leaves its initial value, as a fresh run would
    for piece in buffer_pieces(opt):
        by_unit.setdefault(unit_of(piece.key.split(".", 1)[1]), []).append(piece)
    for unit, unit_pieces in by_unit.items():
        ours = from_hf_unit(weights.read(hf_keys[unit]), cfg, unit)
        for piece in unit_pieces:
            full = ours.get(piece.key.split(".", 1)[1])
            if full is None and piece.key.startswith(BUFFER_PREFIX):
                continue
            if full is None:
                raise ValueError(f"the HF conversion gives no {piece.key.split('.', 1)[1]}")
            region = tuple(slice(o, o + s) for o, s in zip(piece.box.offsets, piece.box.sizes))
            piece.data.copy_(full[region])
    opt.params_from_master()
