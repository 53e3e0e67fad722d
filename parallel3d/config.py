"""The structured-config schema of a training job, and its resolution into options.

Hydra composes ``conf/config.yaml`` against ``JobConfig`` (registered in Hydra's
ConfigStore as ``job_schema``), so a key that is not a field here is rejected
while composing and every value is type-checked. The sections are generated from the
options each package owns (``ParallelDims``, ``ContextParallelOptions``, ``PipelineOptions``,
``ZeroOptions``, ``TrainOptions``, ``CheckpointOptions``, ``StopOptions``, ``OptimizerOptions``,
``DataOptions``, ``LoggingOptions``; the model section from ``ModelConfig``), so a key's
type, default and allowed values are stated once, in its package. ``resolve`` builds
those options (each checks its own values), checks the rules between sections (batch
arithmetic, the model against the layout), runs ``preflight`` (the filesystem, CUDA,
checkpoints, HF and data directories) and returns a frozen ``ResolvedJob``; library code
never sees an OmegaConf object.

Invariant: ``resolve`` runs before any process group exists (it reads the world
size from the launcher's ``WORLD_SIZE``), and every problem it finds is one
``ConfigError`` whose message names the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from kernels.runtime import BACKENDS as KERNEL_BACKENDS
from models.config import ModelConfig
from models.mla import check_latent_layout
from models.moe_block import check_expert_degrees_need_moe, check_moe_layout, check_moe_split
from models.transformer import RECOMPUTE_MODES as RECOMPUTE
from parallel3d import plain_schema, preflight
from parallel3d.checkpoint_io.options import CheckpointOptions
from parallel3d.context_parallel.options import ContextParallelOptions
from parallel3d.data.options import DataOptions
from parallel3d.logging_options import WANDB_MODES, LoggingOptions
from parallel3d.option_checks import ConfigError, check_choice, check_int
from parallel3d.parallel_dims import ParallelDims
from parallel3d.pipeline.options import SCHEDULES, PipelineOptions
from parallel3d.preemption import StopOptions
from parallel3d.topology import LayoutError, Topology
from parallel3d.train_options import DEVICES, TrainOptions
from parallel3d.zero.options import (
    OFFLOAD_MODES,
    PRECISIONS,
    ZERO3_RESHARD,
    ZERO_STAGES,
    OptimizerOptions,
    ZeroOptions,
)

# The allowed values, as their packages define them (re-exported for the layout matrix and tests).
__all__ = ["DEVICES", "KERNEL_BACKENDS", "OFFLOAD_MODES", "PRECISIONS", "RECOMPUTE", "SCHEDULES", "WANDB_MODES",
           "ZERO3_RESHARD", "ZERO_STAGES", "ConfigError", "JobConfig", "ResolvedJob", "build_model_config",
           "check_no_extra_keys", "data_blends", "job_from_dict", "one_line_omegaconf_error", "options_of",
           "register_schema", "resolve", "schema_of", "world_size_from_env"]


# ---- schema -------------------------------------------------------------------------
def _hydra_type(hint: Any) -> Any:
    """The structured-config type of an options field: tuples are lists to Hydra; a union of
    two value types (``parallel.dp``: an int or "auto") is ``Any``, checked by the options."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        return list[args[0]]  # type: ignore[valid-type]
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        values = [a for a in args if a is not type(None)]
        if len(values) > 1:
            return Any
        return _hydra_type(values[0]) | None
    return hint


def schema_of(name: str, sources: tuple[type, ...], order: tuple[str, ...] | None = None,
              skip: tuple[str, ...] = ()) -> type:
    """A mutable dataclass (Hydra cannot override frozen nodes) with the fields of the options
    classes ``sources``: same names, types and defaults; nested options become nested sections.
    ``order``: the keys in the order the section lists them (default: the sources' order)."""
    found: dict[str, tuple[Any, dataclasses.Field]] = {}
    for cls in sources:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in found:
                raise TypeError(f"{name}: key {f.name!r} is stated by two options classes")
            if f.name not in skip:
                found[f.name] = (hints[f.name], f)
    names = order or tuple(found)
    if sorted(names) != sorted(found):
        raise TypeError(f"{name}: order {names} does not list the fields {sorted(found)} once each")
    specs = []
    for key in names:
        hint, f = found[key]
        if dataclasses.is_dataclass(hint):
            nested = schema_of(hint.__name__.replace("Options", "Config"), (hint,))
            specs.append((key, nested, field(default_factory=nested)))
        elif f.default is dataclasses.MISSING:
            specs.append((key, _hydra_type(hint), field(default_factory=f.default_factory)))
        elif isinstance(f.default, tuple):
            specs.append((key, _hydra_type(hint), field(default_factory=lambda v=f.default: list(v))))
        else:
            specs.append((key, _hydra_type(hint), field(default=f.default)))
    schema = dataclasses.make_dataclass(name, specs)
    schema.__module__ = __name__
    return schema


def options_of(cls: type, section: Any) -> Any:
    """The options ``cls`` from its keys in a schema section (validates them)."""
    values = {}
    for name, hint in plain_schema.field_types(cls).items():
        value = getattr(section, name)
        values[name] = options_of(hint, value) if dataclasses.is_dataclass(hint) else value
    return cls(**values)


# kernels.backend is the public name of ModelConfig.kernel_backend, so the model group
# does not carry it (one key per setting).
ModelSchema = schema_of("ModelSchema", (ModelConfig,), skip=("kernel_backend",))
# Sections built from several packages list their keys in the order they always had (the order
# "<section> accepts: ..." errors print); schema_of checks the order names every key once.
ParallelConfig = schema_of("ParallelConfig", (ParallelDims, ContextParallelOptions, PipelineOptions, ZeroOptions),
                           order=(
    "tp", "pp", "dp", "cp", "cp_comm", "cp_a2a_size", "ep", "etp", "zero_stage", "expert_zero_stage", "sequence_parallel", "schedule",
    "virtual_stages", "split_drain", "order",
    "bucket_size_mb", "grad_reduce_dtype", "pp_layers", "offload", "offload_dir", "offload_buffer_mb",
    "zero3_prefetch", "zero3_reshard", "overlap_param_gather"))
TrainConfig = schema_of("TrainConfig", (TrainOptions, CheckpointOptions, StopOptions), order=(
    "steps", "global_batch_size", "micro_batch_size", "seq_len", "seed", "precision", "recompute", "out_dir",
    "save_every", "keep_last", "resume", "device", "timeout_s", "peak_tflops", "stop_after", "async_save",
    "init_from", "preempt_signal", "max_minutes", "eval_every", "eval_iters", "eval_only", "on_nonfinite"))
OptimizerConfig = schema_of("OptimizerConfig", (OptimizerOptions,))
DataConfig = schema_of("DataConfig", (DataOptions,))
LoggingConfig = schema_of("LoggingConfig", (LoggingOptions,))


@dataclass
class KernelsConfig:
    backend: str = ModelConfig.kernel_backend  # auto | triton | apex | torch (ModelConfig.kernel_backend)


@dataclass
class JobConfig:
    model: ModelSchema = field(default_factory=ModelSchema)  # type: ignore[valid-type]
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # type: ignore[valid-type]
    train: TrainConfig = field(default_factory=TrainConfig)  # type: ignore[valid-type]
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # type: ignore[valid-type]
    data: DataConfig = field(default_factory=DataConfig)  # type: ignore[valid-type]
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # type: ignore[valid-type]
    kernels: KernelsConfig = field(default_factory=KernelsConfig)


def register_schema() -> None:
    """Register ``JobConfig`` as ``job_schema`` for conf/config.yaml's defaults list."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="job_schema", node=JobConfig)


# ---- resolved job ---------------------------------------------------------------------
@dataclass(frozen=True)
class ResolvedJob:
    """A validated job: the config, each package's options and what is derived from the world size."""

    job: JobConfig
    model: ModelConfig
    topology: Topology
    world_size: int
    grad_accum: int  # micro-batches per step per DP rank
    device: str  # "cpu" | "cuda"
    dims: ParallelDims  # dp resolved for world_size
    pipeline: PipelineOptions
    zero: ZeroOptions
    train: TrainOptions
    checkpoint: CheckpointOptions
    stop: StopOptions
    optimizer: OptimizerOptions
    data: DataOptions
    logging: LoggingOptions
    context_parallel: ContextParallelOptions = ContextParallelOptions()

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.train.seq_len


def world_size_from_env() -> int:
    """The launcher's world size (torchrun/SLURM set WORLD_SIZE); 1 for a plain run. The launcher's other
    integers are checked with it (``RANK`` < ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``): a
    hand-set one must fail here, not in ``int()`` on a rank."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if rank >= world:
        raise ConfigError(f"environment RANK={rank}: must be < WORLD_SIZE={world}")
    _env_int("LOCAL_RANK", 0)
    _env_int("LOCAL_WORLD_SIZE", 1)
    return world


def _env_int(name: str, minimum: int) -> int:
    raw = os.environ.get(name, str(minimum))
    try:
        return check_int(name, int(raw), minimum)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r}: must be an integer >= {minimum}") from None


def _check_model_fits(model: ModelConfig, topo: Topology, virtual_stages: int) -> None:
    """The model splits over the layout: heads and FFN over tp, layers over the pipeline chunks."""
    if model.ffn_size % topo.tp:
        raise ConfigError(f"model.ffn_hidden_size={model.ffn_size}: must be divisible by parallel.tp={topo.tp}")
    try:
        topo.check_model(**model.layout_sizes(), virtual_stages=virtual_stages)
    except LayoutError as exc:
        raise ConfigError(f"model does not fit the layout: {exc}") from None


def data_blends(d: Any) -> tuple[tuple[list[str], list[float] | None], tuple[list[str], list[float] | None]]:
    """``((train prefixes, weights), (validation prefixes, weights))`` of a ``data.*`` section (raises ConfigError)."""
    return options_of(DataOptions, d).blends()


def build_model_config(job: JobConfig) -> ModelConfig:
    """The frozen ModelConfig from the model group plus kernels.backend."""
    check_choice("kernels.backend", job.kernels.backend, KERNEL_BACKENDS)
    values = {f.name: getattr(job.model, f.name) for f in dataclasses.fields(ModelSchema)}
    values["kernel_backend"] = job.kernels.backend
    try:
        return ModelConfig(**values)
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None


def resolve(job: JobConfig, world_size: int | None = None) -> ResolvedJob:
    """Validate every value of ``job`` for a job of ``world_size`` processes, then probe the
    environment (``preflight``); see the module doc."""
    world = world_size_from_env() if world_size is None else world_size
    model = build_model_config(job)
    dims = options_of(ParallelDims, job.parallel).with_world(world)
    try:  # before the topology, whose expert fold would otherwise be the error a dense model's ep gets
        check_expert_degrees_need_moe(model.moe.enabled, dims.ep, dims.etp, dims.tp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    topo = dims.build_topology()
    pipeline = options_of(PipelineOptions, job.parallel)
    zero = options_of(ZeroOptions, job.parallel)
    pipeline.check_layout(dims.pp, model.num_layers)
    _check_model_fits(model, topo, pipeline.virtual_stages)
    try:
        check_moe_layout(model.moe.enabled, dims.tp, dims.sequence_parallel)
        if model.moe.enabled:  # else every rank would refuse the split in build_model, after the spawn
            check_moe_split(model.moe.options(model.ffn_size), topo.tp, topo.ep, topo.etp)
        if model.mla.enabled:  # else every rank would refuse it in build_model, after the spawn
            check_latent_layout(dims.tp, dims.cp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    train = options_of(TrainOptions, job.train)
    pipeline.splits_drain(train.recompute)  # parallel.split_drain=true with full recompute: refused here
    accum = train.grad_accum(topo.dp)
    train.check_sequence(model.max_seq_len, dims.tp, dims.sequence_parallel)
    context_parallel = options_of(ContextParallelOptions, job.parallel)
    context_parallel.check_layout(cp=dims.cp, tp=dims.tp, seq_len=train.seq_len, num_heads=model.num_heads,
                                  num_kv_heads=model.kv_heads, sequence_parallel=dims.sequence_parallel)
    pipeline.check_microbatches(dims.pp, accum)
    zero.check_precision(train.precision)
    checkpoint = options_of(CheckpointOptions, job.train)
    stop = options_of(StopOptions, job.train)
    optimizer = options_of(OptimizerOptions, job.optimizer)
    optimizer.check_steps(train.steps)
    data = options_of(DataOptions, job.data)
    data.check_vocab(model.vocab_size)
    train.check_eval(data.has_valid_set)
    logging = options_of(LoggingOptions, job.logging)
    device = preflight.check_environment(train, checkpoint, zero, data, model)
    return ResolvedJob(job=job, model=model, topology=topo, world_size=world, grad_accum=accum, device=device,
                       dims=dims, pipeline=pipeline, zero=zero, train=train, checkpoint=checkpoint, stop=stop,
                       optimizer=optimizer, data=data, logging=logging, context_parallel=context_parallel)


def job_from_dict(values: dict | None = None, *, model: str | None = None) -> JobConfig:
    """A ``JobConfig`` from nested plain values (for tests and scripts), type-checked like Hydra does:
    values already of their fields' types are built directly (``plain_schema``: the same object), the
    rest (and every error) go through OmegaConf.

    ``model`` names a registry config (``models.get_config``) for the model section;
    ``values["model"]`` then overrides single keys of it.
    """
    values = dict(values or {})
    if model is not None:
        from models import get_config

        named = {f.name: v for f, v in zip(dataclasses.fields(ModelSchema), _section_values(get_config(model)))}
        overrides = dict(values.get("model", {}))
        if isinstance(overrides.get("moe"), dict):  # a partial model.moe keeps the named config's other keys
            overrides["moe"] = {**named["moe"], **overrides["moe"]}
        values["model"] = {**named, **overrides}
    fast = plain_schema.instance_of(JobConfig, values)  # plain typed values: OmegaConf would only copy them
    return fast if fast is not None else _job_via_omegaconf(values)


def _job_via_omegaconf(values: dict) -> JobConfig:
    """``job_from_dict``'s OmegaConf path: ``values`` merged into the structured schema (any ``ConfigError``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.merge(_job_schema(), OmegaConf.create(values))  # merge copies the schema first
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(one_line_omegaconf_error(exc)) from None


@functools.cache  # building the structured schema is ~60% of a job_from_dict (test collection draws ~400)
def _job_schema() -> Any:
    """``JobConfig`` as an OmegaConf structured config, read-only: one per process, never changed
    (``OmegaConf.merge`` deep-copies its first argument and merges into the copy)."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(JobConfig)
    OmegaConf.set_readonly(schema, True)
    return schema


def _section_values(model: ModelConfig) -> list[Any]:
    """The model's values for the ``ModelSchema`` keys, nested sections (``moe``) as plain dicts."""
    return [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
            for v in (getattr(model, f.name) for f in dataclasses.fields(ModelSchema))]


def one_line_omegaconf_error(exc: BaseException) -> str:
    """OmegaConf/Hydra errors span several lines; keep the key and the reason on one."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    full_key = getattr(exc, "full_key", None)
    if isinstance(exc, (ConfigAttributeError, ConfigKeyError)) and full_key:
        return f"{full_key}: unknown key; {_allowed_keys(str(full_key), getattr(exc, 'object_type', None))}"
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


def _allowed_keys(full_key: str, node: Any = None) -> str:
    """``'<section> accepts: a, b, c'`` for the schema node holding ``full_key``: ``node`` where the
    caller knows it (a schema extending ``JobConfig``, the planners'), else found from ``JobConfig``."""
    path = full_key.split(".")[:-1]
    if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
        node = JobConfig
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
            raise ConfigError(f"{full}: unknown key; {_allowed_keys(full, schema)}")
        if dataclasses.is_dataclass(hints[key]) and hasattr(cfg[key], "keys"):
            check_no_extra_keys(cfg[key], hints[key], f"{full}.")
