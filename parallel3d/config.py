"""The structured-config schema of a training job, and its validation.

Hydra composes ``conf/config.yaml`` against ``JobConfig`` (registered in Hydra's
ConfigStore as ``job_schema``), so a key that is not a field here is rejected
while composing and every value is type-checked. ``resolve`` then checks the
*meaning* of every value (ranges, choices, batch arithmetic, model fit) and
returns a frozen ``ResolvedJob``; library code never sees an OmegaConf object.

Invariant: ``resolve`` runs before any process group exists (it reads the world
size from the launcher's ``WORLD_SIZE``), and every problem it finds is one
``ConfigError`` whose message names the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from models.config import ModelConfig
from parallel3d.topology import LayoutError, Topology

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zbv")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("online", "offline", "disabled")
KERNEL_BACKENDS = ("auto", "triton", "apex", "torch")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_MODES = ("none", "cpu", "disk")
ZERO3_RESHARD = ("auto", "microbatch", "step")


class ConfigError(ValueError):
    """A bad configuration value; the message is one line a user can act on."""


# ---- schema -------------------------------------------------------------------------

# kernels.backend is the public name of ModelConfig.kernel_backend, so the model group
# does not carry it (one key per setting).
_MODEL_KEYS_NOT_IN_GROUP = ("kernel_backend",)


def _model_schema() -> type:
    """ModelConfig's fields as a mutable dataclass (Hydra cannot override frozen nodes).

    Built from ModelConfig itself so the YAML schema cannot drift from the model code.
    """
    hints = typing.get_type_hints(ModelConfig)
    specs = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in _MODEL_KEYS_NOT_IN_GROUP:
            continue
        specs.append((f.name, hints[f.name], field(default=f.default)))
    schema = dataclasses.make_dataclass("ModelSchema", specs)
    schema.__module__ = __name__
    return schema


ModelSchema = _model_schema()


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel degree (splits heads / MLP columns)
    pp: int = 1  # pipeline stages
    dp: Any = "auto"  # data-parallel replicas, or "auto" = world_size / (tp * pp)
    zero_stage: int = 0  # 0: plain DP all-reduce; 1: sharded optimizer state; 2: + sharded grads; 3: + sharded params
    sequence_parallel: bool = False  # shard norm/dropout activations over tp (needs tp > 1)
    schedule: str = "1f1b"  # 1f1b | gpipe | interleaved_1f1b | zb_h1 | zbv (zero bubble, split backward)
    virtual_stages: int = 1  # model chunks per stage (interleaved_1f1b: >= 2; zbv: 2, its V)
    order: str = "tp-dp-pp"  # rank order, fastest-varying first
    bucket_size_mb: float = 25.0  # gradient bucket size for DP/ZeRO reduction
    # dtype gradients are accumulated over microbatches and reduced over DP in: fp32 (main
    # grads, the default) or the model's own bf16/fp16 (half the reduction bytes).
    grad_reduce_dtype: str = "fp32"
    pp_layers: list[int] | None = None  # layers per pipeline chunk; null = balanced split
    # Optimizer state (fp32 master weights + Adam moments) on the device (none), in host memory
    # with the update on the CPU (cpu), or in files under offload_dir (disk); zero_stage >= 1.
    offload: str = "none"
    offload_dir: str | None = None  # offload=disk: directory for the state files (fast local disk)
    offload_buffer_mb: float = 256.0  # offload=disk: host memory the state streams through
    zero3_prefetch: int = 1  # zero_stage=3: gather units issued ahead of the one computing
    zero3_reshard: str = "auto"  # zero_stage=3: free gathered params per microbatch | per step (auto: step if pp > 1)
    # zero_stage=1/2: the post-step parameter all-gather runs while the next forward computes
    # (each bucket waited for right before its first layer) instead of blocking in step().
    overlap_param_gather: bool = True


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch_size: int = 8  # = micro_batch_size * grad_accum * dp
    micro_batch_size: int = 4
    seq_len: int = 128
    seed: int = 1234
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 uses dynamic loss scaling)
    recompute: str = "none"  # activation recompute: none | selective | full
    out_dir: str = "runs/default"  # run directory: metrics.jsonl, checkpoints/, .hydra/
    save_every: int = 0  # checkpoint every N steps; 0 = only at the end
    keep_last: int = 2  # checkpoints kept (K)
    resume: str = "auto"  # auto (newest complete checkpoint in out_dir) | none | <checkpoint dir>
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    timeout_s: float = 600.0  # collective timeout
    peak_tflops: float | None = None  # per-device peak for MFU; null = detect known GPUs
    stop_after: int | None = None  # stop (and checkpoint) after this step, as if killed; resumable
    async_save: bool = True  # write checkpoints in a background thread while training goes on
    init_from: str | None = None  # hf:<dir>: start (step 0) from a transformers checkpoint directory
    # Signals that stop the run at the next step boundary with a checkpoint (parallel3d/preemption.py).
    preempt_signal: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    max_minutes: float | None = None  # wall-clock budget: save and stop before it runs out; null = none
    # Validation (parallel3d/eval.py): eval_iters global batches of the validation set, forward
    # only, every eval_every steps (0 = only at the end); eval_iters=0 = no evaluation.
    eval_every: int = 0
    eval_iters: int = 0


@dataclass
class OptimizerConfig:
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # cosine decay floor, reached at train.steps
    warmup_steps: int = 20  # linear warm-up from 0
    weight_decay: float = 0.1  # AdamW decoupled decay (not on norms/biases)
    clip_grad: float = 1.0  # max global grad norm; 0 = no clipping
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class DataConfig:
    source: str = "default"  # default (built-in corpus) | indexed (Megatron .bin/.idx prefixes)
    corpus: str = "pydoc"  # built-in corpus (source=default): pydoc | stdlib | pydoc+stdlib
    tokenizer: str = "bpe"  # built-in corpus tokenizer: bpe (trained locally to model.vocab_size) | byte
    paths: list[str] = field(default_factory=list)  # dataset prefixes (source=indexed)
    weights: list[float] | None = None  # blending weights, one per path; null = by dataset size
    cache_dir: str = ".cache/parallel3d"  # where the built-in corpus is tokenized once
    # source=indexed: the tokenizer the data was made with (saved into the run for HF export);
    # null = <first path>.tokenizer.json when it exists
    tokenizer_file: str | None = None
    # Megatron's blend string "0.3 prefix_a 0.7 prefix_b" (or "a b"): instead of paths + weights.
    blend: str | None = None
    # Validation set: the tail of each training dataset (a fraction of its tokens, cut at a
    # document boundary), or separate prefixes (same syntax as paths; source=indexed).
    valid_fraction: float = 0.0
    valid_paths: list[str] = field(default_factory=list)


@dataclass
class WandbConfig:
    mode: str = "disabled"  # online | offline | disabled
    project: str = "parallel3d"
    entity: str | None = None
    name: str | None = None  # run name; null = W&B picks one
    init_timeout_s: float = 60.0  # give up on an unreachable server after this (training goes on)


@dataclass
class LoggingConfig:
    log_every: int = 10  # console/JSONL/W&B every N steps (and the last step)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class KernelsConfig:
    backend: str = "auto"  # auto | triton | apex | torch (ModelConfig.kernel_backend)


@dataclass
class JobConfig:
    model: ModelSchema = field(default_factory=ModelSchema)  # type: ignore[valid-type]
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)


def register_schema() -> None:
    """Register ``JobConfig`` as ``job_schema`` for conf/config.yaml's defaults list."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="job_schema", node=JobConfig)


# ---- resolved job ---------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedJob:
    """A validated job: the config plus everything derived from it and the world size."""

    job: JobConfig
    model: ModelConfig
    topology: Topology
    world_size: int
    grad_accum: int  # micro-batches per step per DP rank
    device: str  # "cpu" | "cuda"

    @property
    def tokens_per_step(self) -> int:
        return self.job.train.global_batch_size * self.job.train.seq_len


def _check_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r}: must be an integer >= {minimum}")
    return value


def _check_choice(key: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(map(str, allowed))}")
    return value


def _check_range(key: str, value: Any, lo: float, hi: float | None = None, *, lo_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = value > lo if lo_open else value >= lo
        ok = ok and (hi is None or value <= hi)
    if not ok:
        bound = f"{'>' if lo_open else '>='} {lo}" + ("" if hi is None else f" and <= {hi}")
        raise ConfigError(f"{key}={value!r}: must be a number {bound}")
    return float(value)


def _check_writable_dir(key: str, path: str) -> None:
    """``path`` is a directory this process can create or write into (checked without creating it)."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ConfigError(f"{key}={path!r}: exists and is not a directory")
    parent = full
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path!r}: cannot be created or written ({parent} is "
                          f"{'not a directory' if not os.path.isdir(parent) else 'not writable'})")


def world_size_from_env() -> int:
    """The launcher's world size (torchrun/SLURM set WORLD_SIZE); 1 for a plain run."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return _check_int("WORLD_SIZE", int(raw), 1)
    except ValueError:
        raise ConfigError(f"environment WORLD_SIZE={raw!r}: must be an integer >= 1") from None


def _resolve_dp(p: ParallelConfig, world_size: int) -> int:
    tp = _check_int("parallel.tp", p.tp, 1)
    pp = _check_int("parallel.pp", p.pp, 1)
    if p.dp == "auto":
        if world_size % (tp * pp):
            raise ConfigError(
                f"parallel.dp=auto: world_size={world_size} is not divisible by "
                f"parallel.tp*parallel.pp = {tp}*{pp} = {tp * pp}"
            )
        return world_size // (tp * pp)
    dp = p.dp
    if isinstance(dp, str) and dp.strip().isdigit():
        dp = int(dp)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ConfigError(f"parallel.dp={p.dp!r}: must be an integer >= 1 or 'auto'")
    if tp * pp * dp != world_size:
        raise ConfigError(
            f"parallel.tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} but the job has "
            f"world_size={world_size} processes (use parallel.dp=auto to derive dp)"
        )
    return dp


def _check_parallel(p: ParallelConfig, model: ModelConfig, topo: Topology) -> None:
    _check_choice("parallel.zero_stage", p.zero_stage, ZERO_STAGES)
    _check_choice("parallel.schedule", p.schedule, SCHEDULES)
    v = _check_int("parallel.virtual_stages", p.virtual_stages, 1)
    if v > 1 and p.schedule not in ("interleaved_1f1b", "zbv"):
        raise ConfigError(
            f"parallel.virtual_stages={v}: only parallel.schedule=interleaved_1f1b or zbv uses more than one "
            f"chunk per stage (schedule is {p.schedule!r})"
        )
    if p.schedule == "zbv" and v != 2:
        raise ConfigError(f"parallel.schedule=zbv runs two chunks per stage: set parallel.virtual_stages=2 (got {v})")
    if p.schedule == "interleaved_1f1b" and (v < 2 or topo.pp < 2):
        raise ConfigError(
            f"parallel.schedule=interleaved_1f1b needs parallel.pp >= 2 and parallel.virtual_stages >= 2 "
            f"(got pp={topo.pp}, virtual_stages={v})"
        )
    if p.sequence_parallel and topo.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true: needs parallel.tp > 1 (with tp=1 it would do nothing)")
    _check_range("parallel.bucket_size_mb", p.bucket_size_mb, 0.0, lo_open=True)
    _check_choice("parallel.grad_reduce_dtype", p.grad_reduce_dtype, PRECISIONS)
    _check_zero3_and_offload(p)
    if model.ffn_size % topo.tp:
        raise ConfigError(f"model.ffn_hidden_size={model.ffn_size}: must be divisible by parallel.tp={topo.tp}")
    try:
        topo.check_model(
            num_layers=model.num_layers,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            hidden_size=model.hidden_size,
            virtual_stages=v,
        )
    except LayoutError as exc:
        raise ConfigError(f"model does not fit the layout: {exc}") from None
    if p.pp_layers is not None:
        chunks = topo.pp * v
        layers = list(p.pp_layers)
        if len(layers) != chunks or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers):
            raise ConfigError(
                f"parallel.pp_layers={layers}: must list {chunks} positive layer counts "
                f"(one per pipeline chunk = pp*virtual_stages = {topo.pp}*{v}), or be null"
            )
        if sum(layers) != model.num_layers:
            raise ConfigError(
                f"parallel.pp_layers={layers}: sums to {sum(layers)} but model.num_layers={model.num_layers}"
            )


def _check_writable_dir(key: str, path: str) -> None:
    """``path`` is a directory we can write, or one that can be created in the nearest existing parent
    (probed by creating and removing a temporary file there: permission bits do not bind root)."""
    import tempfile

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


def _check_zero3_and_offload(p: ParallelConfig) -> None:
    _check_choice("parallel.offload", p.offload, OFFLOAD_MODES)
    if p.offload != "none" and p.zero_stage == 0:
        raise ConfigError(
            f"parallel.offload={p.offload}: needs parallel.zero_stage >= 1 (with stage 0 every rank would keep and "
            f"update the whole optimizer state on its host; stage 1 shards it at the same communication volume)"
        )
    if p.offload == "disk":
        if not p.offload_dir:
            raise ConfigError("parallel.offload_dir=null: parallel.offload=disk needs a directory for the optimizer "
                              "state files (a fast local disk)")
        _check_writable_dir("parallel.offload_dir", p.offload_dir)
    elif p.offload_dir is not None:
        raise ConfigError(f"parallel.offload_dir={p.offload_dir!r}: only used with parallel.offload=disk "
                          f"(offload is {p.offload!r})")
    _check_range("parallel.offload_buffer_mb", p.offload_buffer_mb, 0.0, lo_open=True)
    _check_int("parallel.zero3_prefetch", p.zero3_prefetch, 0)
    _check_choice("parallel.zero3_reshard", p.zero3_reshard, ZERO3_RESHARD)
    if not isinstance(p.overlap_param_gather, bool):
        raise ConfigError(f"parallel.overlap_param_gather={p.overlap_param_gather!r}: must be true or false")
    if p.zero_stage != 3 and p.zero3_reshard != "auto":
        raise ConfigError(f"parallel.zero3_reshard={p.zero3_reshard}: only used with parallel.zero_stage=3 "
                          f"(zero_stage is {p.zero_stage})")


def _grad_accum(t: TrainConfig, dp: int) -> int:
    gbs = _check_int("train.global_batch_size", t.global_batch_size, 1)
    mbs = _check_int("train.micro_batch_size", t.micro_batch_size, 1)
    if gbs % (mbs * dp):
        raise ConfigError(
            f"train.global_batch_size={gbs} is not divisible by train.micro_batch_size*dp = {mbs}*{dp} = "
            f"{mbs * dp}; global_batch = micro_batch * grad_accum * dp needs an integer grad_accum"
        )
    return gbs // (mbs * dp)


def _check_train(t: TrainConfig, model: ModelConfig, topo: Topology, p: ParallelConfig, accum: int) -> str:
    _check_int("train.steps", t.steps, 1)
    seq = _check_int("train.seq_len", t.seq_len, 1)
    if seq > model.max_seq_len:
        raise ConfigError(f"train.seq_len={seq}: must be <= model.max_seq_len={model.max_seq_len}")
    if p.sequence_parallel and seq % topo.tp:
        raise ConfigError(f"train.seq_len={seq}: sequence parallel needs it divisible by parallel.tp={topo.tp}")
    if p.schedule == "interleaved_1f1b" and accum % topo.pp:
        raise ConfigError(
            f"parallel.schedule=interleaved_1f1b: grad_accum={accum} micro-batches must be a multiple of "
            f"parallel.pp={topo.pp} (grad_accum = global_batch_size / (micro_batch_size*dp))"
        )
    _check_int("train.seed", t.seed, 0)
    _check_choice("train.precision", t.precision, PRECISIONS)
    if p.grad_reduce_dtype not in ("fp32", t.precision):
        raise ConfigError(
            f"parallel.grad_reduce_dtype={p.grad_reduce_dtype!r}: must be fp32 or the training precision "
            f"(train.precision={t.precision!r})"
        )
    _check_choice("train.recompute", t.recompute, RECOMPUTE)
    _check_int("train.save_every", t.save_every, 0)
    _check_int("train.keep_last", t.keep_last, 1)
    if t.stop_after is not None:
        _check_int("train.stop_after", t.stop_after, 1)
    if not isinstance(t.out_dir, str) or not t.out_dir.strip():
        raise ConfigError(f"train.out_dir={t.out_dir!r}: must be a non-empty path")
    _check_writable_dir("train.out_dir", t.out_dir)
    if t.resume not in ("auto", "none") and not os.path.isdir(t.resume):
        raise ConfigError(f"train.resume={t.resume!r}: must be auto, none or an existing checkpoint directory")
    if t.resume == "none":
        from parallel3d.checkpoint import complete_checkpoints

        old = [step for step, _ in complete_checkpoints(os.path.join(t.out_dir, "checkpoints"))]
        if old:
            raise ConfigError(
                f"train.resume=none but train.out_dir={t.out_dir!r} holds checkpoints of steps {old}; "
                f"use another train.out_dir, delete them, or train.resume=auto"
            )
    _check_range("train.timeout_s", t.timeout_s, 0.0, lo_open=True)
    from parallel3d.preemption import check_stop_settings

    check_stop_settings(t.preempt_signal, t.max_minutes)
    if not isinstance(t.async_save, bool):
        raise ConfigError(f"train.async_save={t.async_save!r}: must be true or false")
    if t.init_from is not None:
        from parallel3d.checkpoint_io.hf_init import check_init_from

        try:
            check_init_from(t.init_from, model)
        except ValueError as exc:
            raise ConfigError(f"train.init_from={t.init_from!r}: {exc}") from None
    if t.peak_tflops is not None:
        _check_range("train.peak_tflops", t.peak_tflops, 0.0, lo_open=True)
    device = _check_choice("train.device", t.device, DEVICES)
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda: CUDA is not available on this machine (use auto or cpu)")
    if t.precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision=bf16: this GPU does not support bf16 (use fp16 or fp32)")
    return device


def _check_optimizer(o: OptimizerConfig, steps: int) -> None:
    lr = _check_range("optimizer.lr", o.lr, 0.0, lo_open=True)
    _check_range("optimizer.min_lr", o.min_lr, 0.0, lr)
    _check_int("optimizer.warmup_steps", o.warmup_steps, 0)
    if o.warmup_steps > steps:
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps}: must be <= train.steps={steps}")
    _check_range("optimizer.weight_decay", o.weight_decay, 0.0)
    _check_range("optimizer.clip_grad", o.clip_grad, 0.0)
    for key in ("beta1", "beta2"):
        value = getattr(o, key)
        if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ConfigError(f"optimizer.{key}={value!r}: must be in [0, 1)")
    _check_range("optimizer.eps", o.eps, 0.0, lo_open=True)


def data_blends(d: DataConfig) -> tuple[tuple[list[str], list[float] | None], tuple[list[str], list[float] | None]]:
    """``((train prefixes, weights), (validation prefixes, weights))`` of ``data.*`` (raises ConfigError)."""
    from parallel3d.data.blend import BlendError, resolve_blend

    try:
        train = resolve_blend(d.paths, d.weights, d.blend)
        valid = resolve_blend(d.valid_paths, None, None, prefix_key="data.valid")
    except BlendError as exc:
        raise ConfigError(str(exc)) from None
    return train, valid


def _check_data(d: DataConfig, model: ModelConfig) -> None:
    _check_choice("data.source", d.source, ("default", "indexed"))
    (paths, weights), (valid_paths, _) = data_blends(d)
    if d.source == "indexed" and not paths:
        raise ConfigError("data.paths=[]: data.source=indexed needs at least one dataset prefix (or data.blend)")
    if d.source == "default" and paths:
        given = f"data.blend={d.blend!r}" if d.blend else f"data.paths={list(d.paths)}"
        raise ConfigError(f"{given}: only used with data.source=indexed")
    if d.source == "default" and weights is not None:
        raise ConfigError(f"data.weights={weights}: only used with data.source=indexed")
    if d.source == "default" and valid_paths:
        raise ConfigError(f"data.valid_paths={list(d.valid_paths)}: only used with data.source=indexed "
                          f"(the built-in corpus holds out data.valid_fraction)")
    valid_fraction = _check_range("data.valid_fraction", d.valid_fraction, 0.0)
    if valid_fraction >= 1.0:
        raise ConfigError(f"data.valid_fraction={d.valid_fraction!r}: must be >= 0 and < 1")
    if valid_paths and valid_fraction > 0:
        raise ConfigError(f"data.valid_fraction={d.valid_fraction!r}: give one validation set, either "
                          f"data.valid_paths (with data.valid_fraction=0) or a held-out data.valid_fraction")
    if d.tokenizer_file is not None and (d.source != "indexed" or not os.path.exists(d.tokenizer_file)):
        raise ConfigError(f"data.tokenizer_file={d.tokenizer_file!r}: must be an existing tokenizer.json (or a "
                          f"directory holding one) and is only used with data.source=indexed")
    for prefix in [*paths, *valid_paths]:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ConfigError(f"data.paths entry {prefix!r}: file {prefix + ext} does not exist")
    from parallel3d.data.corpus import CORPORA, TOKENIZER_KINDS

    _check_choice("data.corpus", d.corpus, CORPORA)
    _check_choice("data.tokenizer", d.tokenizer, TOKENIZER_KINDS)
    if d.source == "default" and model.vocab_size < 257:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size}: the built-in corpus needs >= 257 (256 bytes + end-of-document)"
        )


def _check_eval(t: TrainConfig, d: DataConfig) -> None:
    _check_int("train.eval_every", t.eval_every, 0)
    iters = _check_int("train.eval_iters", t.eval_iters, 0)
    if iters and not d.valid_paths and not d.valid_fraction:
        raise ConfigError(f"train.eval_iters={iters}: needs a validation set: data.valid_fraction > 0 "
                          f"(held out of the training data) or data.valid_paths (or train.eval_iters=0)")


def _check_logging(lg: LoggingConfig) -> None:
    _check_int("logging.log_every", lg.log_every, 1)
    _check_choice("logging.wandb.mode", lg.wandb.mode, WANDB_MODES)
    _check_range("logging.wandb.init_timeout_s", lg.wandb.init_timeout_s, 0.0, lo_open=True)
    if not isinstance(lg.wandb.project, str) or not lg.wandb.project:
        raise ConfigError(f"logging.wandb.project={lg.wandb.project!r}: must be a non-empty string")


def build_model_config(job: JobConfig) -> ModelConfig:
    """The frozen ModelConfig from the model group plus kernels.backend."""
    _check_choice("kernels.backend", job.kernels.backend, KERNEL_BACKENDS)
    values = {f.name: getattr(job.model, f.name) for f in dataclasses.fields(ModelSchema)}
    values["kernel_backend"] = job.kernels.backend
    try:
        return ModelConfig(**values)
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None


def resolve(job: JobConfig, world_size: int | None = None) -> ResolvedJob:
    """Validate every value of ``job`` for a job of ``world_size`` processes; see module doc."""
    world = world_size_from_env() if world_size is None else world_size
    model = build_model_config(job)
    p = job.parallel
    dp = _resolve_dp(p, world)
    try:
        topo = Topology(p.tp, p.pp, dp, order=p.order)
    except LayoutError as exc:
        raise ConfigError(f"parallel.order={p.order!r}: {exc}") from None
    _check_parallel(p, model, topo)
    accum = _grad_accum(job.train, dp)
    device = _check_train(job.train, model, topo, p, accum)
    _check_optimizer(job.optimizer, job.train.steps)
    _check_data(job.data, model)
    _check_eval(job.train, job.data)
    _check_logging(job.logging)
    return ResolvedJob(job=job, model=model, topology=topo, world_size=world, grad_accum=accum, device=device)


def job_from_dict(values: dict | None = None, *, model: str | None = None) -> JobConfig:
    """A ``JobConfig`` from nested plain values (for tests and scripts), type-checked like Hydra does.

    ``model`` names a registry config (``models.get_config``) for the model section;
    ``values["model"]`` then overrides single keys of it.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    values = dict(values or {})
    if model is not None:
        from models import get_config

        named = {f.name: getattr(get_config(model), f.name) for f in dataclasses.fields(ModelSchema)}
        values["model"] = {**named, **values.get("model", {})}
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.create(values))
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(one_line_omegaconf_error(exc)) from None


def one_line_omegaconf_error(exc: BaseException) -> str:
    """OmegaConf/Hydra errors span several lines; keep the key and the reason on one."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    full_key = getattr(exc, "full_key", None)
    if isinstance(exc, (ConfigAttributeError, ConfigKeyError)) and full_key:
        return f"{full_key}: unknown key; {_allowed_keys(str(full_key))}"
    msg = getattr(exc, "msg", None) or str(exc)
    lines = []
    for line in str(msg).splitlines():
        line = line.strip()
        if not line or line.startswith(("full_key", "object_type", "reference_type")):
            continue
        if line.startswith("Config search path"):
            break
        lines.append(line)
    text = " ".join(lines)
    if full_key and str(full_key) not in text:
        return f"{full_key}: {text}"
    return text


def _allowed_keys(full_key: str) -> str:
    """``'<section> accepts: a, b, c'`` for the schema node holding ``full_key``."""
    node: Any = JobConfig
    path = full_key.split(".")[:-1]
    for part in path:
        hints = typing.get_type_hints(node)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            break
        node = hints[part]
    where = ".".join(path) or "the config root"
    return f"{where} accepts: {', '.join(f.name for f in dataclasses.fields(node))}"


def check_no_extra_keys(cfg: Any, schema: type = JobConfig, prefix: str = "") -> None:
    """Reject keys a ``+key=value`` override added outside the schema (Hydra allows it)."""
    hints = typing.get_type_hints(schema)
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{full}: unknown key; {_allowed_keys(full)}")
        if dataclasses.is_dataclass(hints[key]) and hasattr(cfg[key], "keys"):
            check_no_extra_keys(cfg[key], hints[key], f"{full}.")
