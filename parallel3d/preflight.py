"""Preflight: what the machine must provide for a validated job, probed before any process group.

The options classes check values; this module checks the environment those values point at:
directories that must be writable (``train.out_dir``, ``parallel.offload_dir``, ``data.cache_dir``),
checkpoints (a ``train.resume`` directory complete and of this model; under ``auto`` the newest one the
ranks will see, of this model; none left over under ``train.resume=none``), an explicit kernel backend on a
CPU run, the ``train.init_from`` transformers directory, the data files (at least one global batch: indexed data,
and the built-in corpus once tokenized), and the device (CUDA present, bf16 supported). ``config.resolve`` runs it last, so the entry point
(``parallel3d.train``, ``parallel3d.command_line``) has every problem as one ``ConfigError`` line before it
initialises torch.distributed. It reads and probes; it never creates or changes anything.
"""

from __future__ import annotations

import os
import tempfile

import torch

from kernels.runtime import BackendUnavailableError, resolve_backend
from models.config import ModelConfig
from parallel3d.checkpoint import (BRANCH_POINT, META, SET_ASIDE, CheckpointError, complete_checkpoints, is_loadable,
                                   publishable_steps, read_branch_point, read_meta, step_dir)
from parallel3d.checkpoint_io import compat
from parallel3d.checkpoint_io.hf_init import check_init_from
from parallel3d.checkpoint_io.options import CheckpointOptions
from parallel3d.dataset_pair import dataset_pair, short_of_a_batch
from parallel3d.data import GPTDataset
from parallel3d.data.corpus import cached_default_corpus
from parallel3d.data.errors import DataError
from parallel3d.data.options import DataOptions
from parallel3d.data.run_tokenizer import indexed_tokenizer_path
from parallel3d.option_checks import ConfigError
from parallel3d.train_options import TrainOptions
from parallel3d.zero.options import ZeroOptions


def check_environment(train: TrainOptions, checkpoint: CheckpointOptions, zero: ZeroOptions, data: DataOptions,
                      model: ModelConfig) -> str:
    """Probe everything the job needs (module doc); the device it runs on: ``"cpu"`` or ``"cuda"``."""
    if zero.offload == "disk":
        check_writable_dir("parallel.offload_dir", str(zero.offload_dir))
    check_writable_dir("train.out_dir", train.out_dir)
    if data.source == "default":  # the built-in corpus is tokenized into it on first use
        check_writable_dir("data.cache_dir", data.cache_dir)
    check_checkpoints(checkpoint, train.out_dir, model)
    if checkpoint.init_from is not None:
        try:
            check_init_from(checkpoint.init_from, model)
        except ValueError as exc:
            raise ConfigError(f"train.init_from={checkpoint.init_from!r}: {exc}") from None
    device = resolve_device(train)
    check_kernels(model, device)
    check_data_files(data)
    check_one_global_batch(data, train, model.vocab_size)
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
    name_max = os.pathconf(probe, "PC_NAME_MAX")
    for name in os.path.relpath(os.path.abspath(path), probe).split(os.sep):  # the directories to be made
        if len(os.fsencode(name)) > name_max:
            raise ConfigError(f"{key}={path!r}: must be a writable directory (a name of {len(os.fsencode(name))} "
                              f"bytes; the filesystem allows {name_max})")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}={path!r}: must be a writable directory (cannot write{where}: "
                          f"{exc.strerror or exc})") from None


def check_writable_file(key: str, path: str) -> None:
    """``path`` can be written as a file: not a directory, in an existing writable directory (a report
    written at the end of a long run must not fail then)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{key}={path!r}: must be a file path (it is a directory)")
    if not os.path.isdir(parent):
        raise ConfigError(f"{key}={path!r}: must be a file in an existing directory ({parent} is not a directory)")
    check_writable_dir(key, parent)


def check_checkpoints(checkpoint: CheckpointOptions, out_dir: str, model: ModelConfig) -> None:
    """A ``resume`` directory is a complete checkpoint of this model (its files' CRCs are verified by the
    ranks, spread over them); under ``resume=auto`` the newest checkpoint holds this model (which one passes
    its CRCs stays the ranks' check: they fall back past a damaged one); ``resume=none`` does not silently
    mix with old checkpoints."""
    if checkpoint.resume_dir is not None:
        if not os.path.isdir(checkpoint.resume_dir):
            raise ConfigError(f"train.resume={checkpoint.resume!r}: must be auto, none or an existing checkpoint "
                              f"directory{_restored(checkpoint.resume_dir)}")
        if not is_loadable(checkpoint.resume_dir):
            raise ConfigError(f"train.resume={checkpoint.resume!r}: not a complete checkpoint directory (needs a "
                              f"readable meta.json and every file it lists, at its size)")
        _check_resumable(f"train.resume={checkpoint.resume!r}", checkpoint.resume_dir, model)
    if checkpoint.resume == "auto":
        _check_newest(out_dir, model)
    if checkpoint.resume == "none":
        # A complete .tmp counts: the ranks publish it before training (``CheckpointManager._recover``).
        root = os.path.join(out_dir, "checkpoints")
        old = sorted({step for step, _ in complete_checkpoints(root)} | set(publishable_steps(root)))
        if old:
            raise ConfigError(
                f"train.resume=none but train.out_dir={out_dir!r} holds checkpoints of steps {old}; "
                f"use another train.out_dir, delete them, or train.resume=auto"
            )


def _restored(directory: str) -> str:
    """Where a set-aside ``step_<N>.superseded`` went once a run resumed it (``CheckpointManager._branch`` renames it
    back to ``step_<N>``): a clause for the error line, or ''."""
    named = SET_ASIDE.match(os.path.basename(os.path.normpath(directory)))
    back = step_dir(os.path.dirname(os.path.normpath(directory)), int(named.group(1))) if named else ""
    if not named or not is_loadable(back):
        return ""
    return (f" (a run resumed it and it was restored as {back}: train.resume=auto continues from there, or name "
            f"{back})")


def _check_newest(out_dir: str, model: ModelConfig) -> None:
    """``resume=auto``: the newest loadable checkpoint the ranks will see (``_auto_candidates``: the one they resume
    unless its CRCs fail) holds this model, so a changed model is one line here rather than every rank's failure
    after the spawn. A ``meta.json`` without a model section was not written by a run (the ranks judge it, as a
    damaged checkpoint)."""
    for path in reversed(_auto_candidates(os.path.join(out_dir, "checkpoints"))):
        if is_loadable(path):
            if isinstance(read_meta(path).get("model"), dict):
                _check_resumable("train.resume=auto", path, model, "start over in another train.out_dir")
            return


def _auto_candidates(root: str) -> list[str]:
    """The complete checkpoints ``auto`` chooses among once rank 0's ``CheckpointManager._recover`` has run, oldest
    first, read where they lie now: an unfinished ``branch_point`` set-aside drops the steps after it, then each
    complete ``step_<N>.tmp`` (``publishable_steps``) is published after the steps from ``N`` on are set aside
    (``tests/test_preflight_tmp.py`` holds this to the real manager)."""
    found = dict(complete_checkpoints(root))
    try:
        branch, restore = read_branch_point(os.path.join(root, BRANCH_POINT))
        source = os.path.join(root, restore) if restore else ""
        if os.path.isdir(source):  # a resumed set-aside checkpoint is put back, what was written after it set aside
            written = os.path.getmtime(os.path.join(source, META))
            found = {s: p for s, p in found.items() if s < branch and os.path.getmtime(os.path.join(p, META)) <= written}
            found[branch] = source
        else:
            found = {step: path for step, path in found.items() if step <= branch}
    except (OSError, ValueError):  # no set-aside was cut short (or an unreadable marker: the ranks' to judge)
        pass
    for step in publishable_steps(root):
        found = {s: path for s, path in found.items() if s < step}
        found[step] = step_dir(root, step) + ".tmp"
    return [found[step] for step in sorted(found)]


def _check_resumable(key: str, directory: str, model: ModelConfig, otherwise: str | None = None) -> None:
    """The checkpoint's format is readable and its model has this job's parameter shapes."""
    try:
        meta = read_meta(directory)
        compat.check_format(directory, meta)
        compat.check_same_model(directory, meta, model)
    except (CheckpointError, OSError, ValueError, TypeError) as exc:  # TypeError: a model section of other keys
        raise ConfigError(f"{key}: {exc}" + (f"; resume it with its model, or {otherwise}" if otherwise else "")) \
            from None


def check_kernels(model: ModelConfig, device: str) -> None:
    """An explicit ``kernels.backend`` (triton, apex) can run on a CPU run's tensors; probed with the
    kernels' own rule on an empty CPU tensor (a CUDA run is not probed here: that would create a CUDA
    context on the default GPU in every rank's process before it picks its own)."""
    if device != "cpu":
        return
    try:
        resolve_backend(model.backend, "the model's kernels", torch.empty(0), apex_has_op=True)
    except BackendUnavailableError as exc:
        raise ConfigError(f"{exc} (use kernels.backend=auto or torch)") from None


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
    """Every indexed dataset's ``.bin``/``.idx`` pair and the tokenizer file exist, and a document mask
    has a tokenizer to read its end-of-document id from."""
    if data.tokenizer_file is not None and not os.path.exists(data.tokenizer_file):
        raise ConfigError(data.tokenizer_file_error())
    (paths, _), (valid_paths, _) = data.blends()
    for key, prefixes in (("data.paths", paths), ("data.valid_paths", valid_paths)):
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ConfigError(f"{key} entry {prefix!r}: file {prefix + ext} does not exist"
                                      + _prefix_hint(prefix))
    if data.source == "indexed" and data.document_mask and indexed_tokenizer_path(data.tokenizer_file, paths) is None:
        beside = f" (no {paths[0]}.tokenizer.json beside the data either)" if paths else ""
        raise ConfigError("data.document_mask=true: needs the data's tokenizer for its end-of-document id: set "
                          f"data.tokenizer_file{beside}")


def check_one_global_batch(data: DataOptions, train: TrainOptions, vocab_size: int) -> None:
    """The data holds one global batch, in training and validation (``refuse_short``): indexed data, and the built-in
    corpus once tokenized (``cached_default_corpus``; at its first use the rank tokenizes it and applies the same
    ``refuse_short``). Data that cannot be read as a dataset at all (empty, truncated) is left to the ranks, whose
    line names the file."""
    blends = data.blends()
    if data.source == "default":
        try:
            prefix = cached_default_corpus(data.cache_dir, vocab_size, corpus=data.corpus, tokenizer=data.tokenizer)
        except DataError:
            return
        if prefix is None:
            return
        blends = (([prefix], None), ([], None))
    try:
        pair = dataset_pair(*blends, valid_fraction=data.valid_fraction, seq_len=train.seq_len,
                            seed=train.seed, vocab_size=None)
    except DataError:
        return
    refuse_short(pair, train.global_batch_size)


def refuse_short(pair: tuple[GPTDataset, GPTDataset | None], global_batch_size: int) -> None:
    """The one rule, for preflight and the ranks (``datasets.build_datasets``): a ``ConfigError`` line (exit 2) when
    a set of ``pair`` holds fewer samples than one global batch (``dataset_pair.short_of_a_batch``)."""
    if short := short_of_a_batch(*pair, global_batch_size):
        raise ConfigError(f"train.global_batch_size={global_batch_size}: {short}; use a smaller "
                          f"train.global_batch_size or train.seq_len, or more data")


def _prefix_hint(prefix: str) -> str:
    """Megatron's entries are prefixes: a user who names ``corpus.bin`` (or ``.idx``) is told so."""
    stem, ext = os.path.splitext(prefix)
    if ext in (".bin", ".idx") and os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx"):
        return f" (entries are prefixes without .bin/.idx: {stem!r})"
    return ""
