"""Preflight: what the machine must provide for a validated job, probed before any process group.

The options classes check values; this module checks the environment those values point at:
directories that must be writable (``train.out_dir``, ``parallel.offload_dir``), checkpoints
(a ``train.resume`` directory; none left over under ``train.resume=none``), the
``train.init_from`` transformers directory, the data files, and the device (CUDA present,
bf16 supported). ``config.resolve`` runs it last, so the entry point (``parallel3d.train``,
``parallel3d.command_line``) has every problem as one ``ConfigError`` line before it
initialises torch.distributed. It reads and probes; it never creates or changes anything.
"""

from __future__ import annotations

import os
import tempfile

import torch

from models.config import ModelConfig
from parallel3d.checkpoint import complete_checkpoints
from parallel3d.checkpoint_io.hf_init import check_init_from
from parallel3d.checkpoint_io.options import CheckpointOptions
from parallel3d.data.options import DataOptions
from parallel3d.option_checks import ConfigError
from parallel3d.train_options import TrainOptions
from parallel3d.zero.options import ZeroOptions


def check_environment(train: TrainOptions, checkpoint: CheckpointOptions, zero: ZeroOptions, data: DataOptions,
                      model: ModelConfig) -> str:
    """Probe everything the job needs (module doc); the device it runs on: ``"cpu"`` or ``"cuda"``."""
    if zero.offload == "disk":
        check_writable_dir("parallel.offload_dir", str(zero.offload_dir))
    check_writable_dir("train.out_dir", train.out_dir)
    check_checkpoints(checkpoint, train.out_dir)
    if checkpoint.init_from is not None:
        try:
            check_init_from(checkpoint.init_from, model)
        except ValueError as exc:
            raise ConfigError(f"train.init_from={checkpoint.init_from!r}: {exc}") from None
    device = resolve_device(train)
    check_data_files(data)
    return device


def check_writable_dir(key: str, path: str) -> None:
    """``path`` is a directory we can write, or one that can be created in the nearest existing parent
    (probed by creating and removing a temporary file there: permission bits do not bind root)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    where = "" if probe == os.path.abspath(path) else f" in {probe}"
    if not os.path.isdir(probe):
        raise ConfigError(f"{key}={path!r}: must be a writable directory ({probe} is not a directory)")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}={path!r}: must be a writable directory (cannot write{where}: "
                          f"{exc.strerror or exc})") from None


def check_checkpoints(checkpoint: CheckpointOptions, out_dir: str) -> None:
    """A ``resume`` directory exists; ``resume=none`` does not silently mix with old checkpoints."""
    if checkpoint.resume_dir is not None and not os.path.isdir(checkpoint.resume_dir):
        raise ConfigError(f"train.resume={checkpoint.resume!r}: must be auto, none or an existing checkpoint directory")
    if checkpoint.resume == "none":
        old = [step for step, _ in complete_checkpoints(os.path.join(out_dir, "checkpoints"))]
        if old:
            raise ConfigError(
                f"train.resume=none but train.out_dir={out_dir!r} holds checkpoints of steps {old}; "
                f"use another train.out_dir, delete them, or train.resume=auto"
            )


def resolve_device(train: TrainOptions) -> str:
    """``train.device`` with ``auto`` decided by what this machine has; CUDA and bf16 support checked."""
    device = train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda: CUDA is not available on this machine (use auto or cpu)")
    if train.precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision=bf16: this GPU does not support bf16 (use fp16 or fp32)")
    return device


def check_data_files(data: DataOptions) -> None:
    """Every indexed dataset's ``.bin``/``.idx`` pair and the tokenizer file exist."""
    if data.tokenizer_file is not None and not os.path.exists(data.tokenizer_file):
        raise ConfigError(data.tokenizer_file_error())
    (paths, _), (valid_paths, _) = data.blends()
    for prefix in [*paths, *valid_paths]:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ConfigError(f"data.paths entry {prefix!r}: file {prefix + ext} does not exist")
