"""A checkpoint of any layout -> a transformers model directory (config, safetensors, tokenizer).

``export_hf(source, out_dir)`` streams one conversion unit at a time (the global tensors,
then each layer: ``models.hf.to_hf_unit``), reading only that unit's weights from the
layout-free checkpoint (the fp32 master weights, and persistent buffers such as the
routers' expert bias), so memory stays at about one shard
(``max_shard_bytes``) whatever the model size. Shards are named as transformers names them
(``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json``). A tied output head is not written (transformers ties it).
In a bf16/fp16 export the tensors transformers always keeps in fp32 stay fp32.
The tokenizer comes from the run directory (``<out_dir>/tokenizer/``) unless given.
Invariant: after an export, the weight files in ``out_dir`` are exactly the ones it wrote. Weight
files of an earlier export there (those names, not written this time) are removed once the new
ones are complete, as ``save_pretrained`` does: ``from_pretrained`` reads ``model.safetensors``
before an index, so a stale one would silently load the old weights.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from models.config import ModelConfig
from models.hf import expected_hf_shapes, hf_config, hf_unit_of, hf_units, to_hf_unit, unit_of
from models.hf_formats import hf_format
from parallel3d.checkpoint import CheckpointError, complete_checkpoints, is_loadable, read_meta
from parallel3d.checkpoint_io.compat import STATE_DIR, check_format
from parallel3d.checkpoint_io.pieces import BUFFER_PREFIX, KEY_PREFIX
from parallel3d.checkpoint_io.state import read_metadata, read_tensors
from parallel3d.data.run_tokenizer import RUN_TOKENIZER_DIR, load_run_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size
# the weight files export_hf writes (one file, or shards and their index): the names transformers gives them
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5}\.safetensors|\.safetensors(\.index\.json)?)")


def resolve_checkpoint(source: str) -> str:
    """The checkpoint directory of ``source``: a checkpoint itself, or a run directory's newest."""
    if os.path.isfile(os.path.join(source, "meta.json")):
        if not is_loadable(source):
            raise CheckpointError(f"{source} is not a complete checkpoint (files listed in meta.json are missing)")
        return source
    root = os.path.join(source, "checkpoints")
    for _, path in reversed(complete_checkpoints(root)):
        if is_loadable(path):
            return path
    raise CheckpointError(f"{source} is neither a checkpoint (no meta.json) nor a run directory with a complete "
                          f"checkpoint under checkpoints/")


def run_dir_of(checkpoint: str) -> str:
    """``<out_dir>`` of ``<out_dir>/checkpoints/step_N``."""
    return os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))


@dataclass(frozen=True)
class ExportResult:
    out_dir: str
    checkpoint: str
    step: int
    files: list[str]
    parameters: int
    dtype: str
    tokenizer: str | None


def _plan_shards(cfg: ModelConfig, itemsize: int, max_bytes: int) -> list[list[object]]:
    """Units grouped into shards of at most ``max_bytes`` (a unit larger than that gets its own)."""
    unit_bytes: dict[object, int] = {}
    for key, shape in expected_hf_shapes(cfg).items():
        if key == "lm_head.weight" and cfg.tie_embeddings:
            continue
        unit = hf_unit_of(key)
        unit_bytes[unit] = unit_bytes.get(unit, 0) + math.prod(shape) * itemsize
    shards, current, size = [], [], 0
    for unit in hf_units(cfg):
        if current and size + unit_bytes[unit] > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(unit)
        size += unit_bytes[unit]
    return shards + [current]


def export_hf(source: str, out_dir: str, *, dtype: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              tokenizer: str | None = None, with_tokenizer: bool = True,
              progress: Callable[[str], Any] | None = None) -> ExportResult:
    """Write ``out_dir`` for ``AutoModelForCausalLM.from_pretrained(out_dir)``; see module doc.

    ``dtype``: fp32 | bf16 | fp16 (default: the run's training precision).
    ``tokenizer``: a tokenizer.json / directory to use instead of the run's (``with_tokenizer``
    False: write none). Everything is checked before the first file is written.
    """
    from safetensors.torch import save_file

    checkpoint = resolve_checkpoint(source)
    meta = read_meta(checkpoint)
    check_format(checkpoint, meta)
    cfg = ModelConfig(**meta["model"])
    dtype = dtype or meta.get("precision", "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    hf_cfg = hf_config(cfg)  # raises for a model transformers cannot represent
    tok_source = tokenizer or os.path.join(run_dir_of(checkpoint), RUN_TOKENIZER_DIR)
    tok_files = _tokenizer_files(tok_source, cfg, explicit=tokenizer is not None) if with_tokenizer else None

    state_dir = os.path.join(checkpoint, STATE_DIR)
    metadata = read_metadata(state_dir)
    # the weights, and the persistent buffers a format stores (DeepSeek-V3's e_score_correction_bias is our
    # router's expert_bias): without the buffers ``to_hf_unit`` would write zeros for them
    keys_by_unit: dict[object, dict[str, str]] = {}
    for key in metadata.state_dict_metadata:
        for prefix in (KEY_PREFIX["master"], BUFFER_PREFIX):
            if key.startswith(prefix):
                name = key[len(prefix):]
                keys_by_unit.setdefault(unit_of(name), {})[name] = key
    keep_fp32 = _fp32_tensors(hf_format(cfg).architecture, torch_dtype)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{out_dir!r} must be a directory that can be made or written "
                         f"({exc.strerror or exc})") from None
    shards = _plan_shards(cfg, torch_dtype.itemsize, max_shard_bytes)
    files, weight_map, total, params = [], {}, 0, 0
    for i, units in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for unit in units:
            keys = keys_by_unit.get(unit, {})
            ours = read_tensors(state_dir, list(keys.values()), metadata)
            full = {n: ours[k] for n, k in keys.items()}
            for key, value in to_hf_unit(full, cfg, unit).items():
                if key == "lm_head.weight" and cfg.tie_embeddings:
                    continue  # tied to the input embedding: transformers re-ties it on load
                tensors[key] = value.to(torch.float32 if keep_fp32(key) else torch_dtype).contiguous()
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        for key, value in tensors.items():
            weight_map[key] = file
            total += value.numel() * value.element_size()
            params += value.numel()
        files.append(file)
        if progress:
            progress(f"wrote {file} ({len(tensors)} tensors)")
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
        files.append("model.safetensors.index.json")
    hf_cfg.architectures = [hf_format(cfg).architecture]
    hf_cfg.dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    hf_cfg.save_pretrained(out_dir)
    files.append("config.json")
    if tok_files is not None:
        files += _write_tokenizer(tok_files, out_dir, cfg)
    for stale in sorted(set(os.listdir(out_dir)) - set(files)):  # see the module doc's invariant
        if WEIGHT_FILE.fullmatch(stale) and os.path.isfile(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    return ExportResult(out_dir, checkpoint, int(meta["step"]), files, params, dtype,
                        None if tok_files is None else tok_source)


def _fp32_tensors(architecture: str, dtype: torch.dtype) -> Callable[[str], bool]:
    """Which HF keys stay fp32 in a bf16/fp16 export: those transformers always keeps in fp32
    (``_keep_in_fp32_modules_strict``: DeepSeek-V3's router weight and ``e_score_correction_bias``), so the
    files hold what ``save_pretrained`` of the loaded model would, and a small expert bias is not rounded."""
    import re

    import transformers

    patterns = getattr(getattr(transformers, architecture, None), "_keep_in_fp32_modules_strict", None) or ()
    if dtype == torch.float32 or not patterns:
        return lambda key: False
    found = re.compile("|".join(re.escape(p).replace(r"\*", ".*") for p in sorted(patterns)))
    return lambda key: found.search(key) is not None


def _tokenizer_files(path: str, cfg: ModelConfig, explicit: bool):
    if not os.path.exists(path):
        if explicit:
            raise ValueError(f"--tokenizer {path}: no such file or directory")
        raise ValueError(f"the run has no saved tokenizer ({path} is missing; runs on data.source=indexed need "
                         f"data.tokenizer_file): pass --tokenizer PATH, or --no-tokenizer")
    backend, eod = load_run_tokenizer(path)
    if backend.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
        raise ValueError(f"tokenizer {path} has {backend.get_vocab_size(with_added_tokens=True)} tokens, more than "
                         f"the model's vocab_size={cfg.vocab_size}")
    return backend, eod


def _write_tokenizer(tok_files, out_dir: str, cfg: ModelConfig) -> list[str]:
    from transformers import PreTrainedTokenizerFast

    backend, eod = tok_files
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eod["eod_token"],
                                   model_max_length=cfg.max_seq_len)
    written = fast.save_pretrained(out_dir)
    return sorted({os.path.basename(f) for f in written})
