"""Each package's options class: bad values are refused naming the config key; one list of allowed
values and one set of defaults, read by the schema, the components and the planner.

Cases are generated from the options classes themselves (their fields, types and defaults) and
from the allowed-value lists the packages export, so a new field or a new allowed value is
covered without editing this file.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import typing

import pytest
from omegaconf import OmegaConf

from models.transformer import RECOMPUTE_MODES
from parallel3d.context_parallel.options import ContextParallelOptions
from parallel3d import config
from parallel3d.checkpoint import CheckpointManager
from parallel3d.checkpoint_io.options import CheckpointOptions
from parallel3d.context_parallel import CP_COMM_VARIANTS
from parallel3d.context_parallel.options import ContextParallelOptions
from parallel3d.data.corpus import CORPORA, TOKENIZER_KINDS
from parallel3d.data.options import SOURCES, DataOptions
from parallel3d.logging_options import WANDB_MODES, LoggingOptions, WandbOptions
from parallel3d.metrics import WandbSink
from parallel3d.option_checks import ConfigError
from parallel3d.parallel_dims import ParallelDims
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.options import MULTI_CHUNK, SCHEDULES, PipelineOptions
from parallel3d.pipeline.schedules import build_schedule
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.layout import Layout
from parallel3d.planning.planner import enumerate_layouts
from parallel3d.planning.request import RECOMPUTE_ORDER, PlanRequest
from parallel3d.preemption import StopOptions
from parallel3d.topology import Topology
from parallel3d.train_options import DEVICES, TrainOptions
from parallel3d.zero import ZeroOptimizer
from parallel3d.zero.options import OFFLOAD_MODES, PRECISIONS, ZERO3_RESHARD, ZERO_STAGES, OptimizerOptions, ZeroOptions

# Each options class and the config section its keys live in.
SECTIONS: dict[type, str] = {
    ParallelDims: "parallel", ContextParallelOptions: "parallel", PipelineOptions: "parallel", ZeroOptions: "parallel", TrainOptions: "train",
    CheckpointOptions: "train", StopOptions: "train", OptimizerOptions: "optimizer", DataOptions: "data",
    LoggingOptions: "logging", WandbOptions: "logging.wandb",
}
# Which options compose each schema section (config.py generates the section from them).
SCHEMA_SOURCES = {"parallel": (ParallelDims, ContextParallelOptions, PipelineOptions, ZeroOptions),
                  "train": (TrainOptions, CheckpointOptions, StopOptions),
                  "optimizer": (OptimizerOptions,), "data": (DataOptions,), "logging": (LoggingOptions,)}


def _companions(cls: type, key: str, value: typing.Any) -> dict[str, typing.Any]:
    """The other values a valid ``value`` of ``key`` needs (the options' own cross-key rules)."""
    if cls is ZeroOptions and key == "offload":
        return {"zero_stage": 1, "offload_dir": "/tmp/p3d-offload" if value == "disk" else None}
    if cls is ZeroOptions and key == "zero3_reshard":
        return {"zero_stage": 3}
    if cls is PipelineOptions and key == "schedule" and value in MULTI_CHUNK:
        return {"virtual_stages": 2}
    if cls is ContextParallelOptions and key == "cp_comm" and value == "a2a+p2p":
        return {"cp_a2a_size": 2}
    if cls is DataOptions and key == "source" and value == "indexed":
        return {"paths": ("/tmp/p3d-data",)}
    return {}


# (options class, key, the allowed values as the owning package exports them)
CHOICES = [
    (PipelineOptions, "schedule", SCHEDULES), (ZeroOptions, "zero_stage", ZERO_STAGES),
    (ZeroOptions, "offload", OFFLOAD_MODES), (ZeroOptions, "zero3_reshard", ZERO3_RESHARD),
    (ZeroOptions, "grad_reduce_dtype", PRECISIONS), (TrainOptions, "precision", PRECISIONS),
    (TrainOptions, "recompute", RECOMPUTE_MODES), (TrainOptions, "device", DEVICES),
    (DataOptions, "source", SOURCES), (DataOptions, "corpus", CORPORA), (DataOptions, "tokenizer", TOKENIZER_KINDS),
    (WandbOptions, "mode", WANDB_MODES), (ContextParallelOptions, "cp_comm", CP_COMM_VARIANTS),
]


@pytest.mark.parametrize("cls, key, allowed", CHOICES, ids=[f"{c.__name__}.{k}" for c, k, _ in CHOICES])
def test_every_allowed_value_is_accepted_and_others_are_refused_naming_the_key(cls, key, allowed):
    for value in allowed:
        assert getattr(cls(**{key: value, **_companions(cls, key, value)}), key) == value
    full = f"{SECTIONS[cls]}.{key}"
    for bad in ("no_such_value", 99, True):
        with pytest.raises(ConfigError) as info:
            cls(**{key: bad, **_companions(cls, key, allowed[-1])})
        assert str(info.value) == f"{full}={bad!r}: must be one of {', '.join(map(str, allowed))}"


def _bad_values(hint: typing.Any, default: typing.Any) -> list[typing.Any]:
    """Values of the wrong type or out of range for a field with type ``hint``."""
    base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if bool in base or isinstance(default, bool):
        return ["maybe", 2]
    if int in base or float in base:
        return ["abc", -7, -1.5]
    return []  # free text, tuples (Hydra types them; test_config_errors covers them) and nested options


def _field_cases() -> list[tuple[type, str, typing.Any]]:
    cases = []
    for cls in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            cases += [(cls, f.name, bad) for bad in _bad_values(hints[f.name], default)]
    return cases


FIELD_CASES = _field_cases()


@pytest.mark.parametrize("cls, key, bad", FIELD_CASES, ids=[f"{c.__name__}.{k}={b!r}" for c, k, b in FIELD_CASES])
def test_every_field_refuses_a_wrong_type_or_range_naming_its_key(cls, key, bad):
    with pytest.raises(ConfigError) as info:
        cls(**{key: bad})
    message = str(info.value)
    assert message.startswith(f"{SECTIONS[cls]}.{key}=") and "\n" not in message, message


def test_the_generated_matrix_covers_every_numeric_and_boolean_field():
    covered = {(c, k) for c, k, _ in FIELD_CASES}
    assert len(covered) >= 35
    assert (ParallelDims, "cp") in covered and (ZeroOptions, "overlap_param_gather") in covered


def test_options_are_frozen_and_hold_no_lists():
    options = [cls() for cls in SECTIONS] + [StopOptions(preempt_signal=["SIGTERM"]),
                                             DataOptions(source="indexed", paths=["a"], weights=[1.0])]
    for opts in options:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(opts, dataclasses.fields(opts)[0].name, None)
        assert not any(isinstance(getattr(opts, f.name), list) for f in dataclasses.fields(opts))


# ---- the schema and the components read the options' defaults ----------------------------
def _schema_leaves(schema: type, prefix: str = "") -> dict[str, typing.Any]:
    out = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_schema_leaves(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def _option_leaves(cls: type, prefix: str) -> dict[str, typing.Any]:
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            out.update(_option_leaves(type(value), f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = list(value) if isinstance(value, tuple) else value
    return out


def test_schema_defaults_are_the_options_defaults():
    schema = _schema_leaves(config.JobConfig)
    options: dict[str, typing.Any] = {}
    for section, sources in SCHEMA_SOURCES.items():
        for cls in sources:
            options.update(_option_leaves(cls, f"{section}."))
    assert {k: v for k, v in schema.items() if k.split(".")[0] in SCHEMA_SOURCES} == options
    assert schema["kernels.backend"] == config.ModelConfig.kernel_backend


def test_the_parallel_group_yaml_restates_the_options_defaults():
    """conf/parallel/default.yaml is the default job's parallel section: its values are the defaults."""
    from parallel3d.train import CONF_DIR

    yaml = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF_DIR, "parallel", "default.yaml")))
    defaults = {k.split(".", 1)[1]: v for k, v in _schema_leaves(config.JobConfig).items() if k.startswith("parallel.")}
    assert yaml == defaults


# (callable, its parameter, the options class, the field whose default it must take)
COMPONENT_DEFAULTS = [
    *[(ZeroOptimizer.__init__, f.name, ZeroOptions, f.name) for f in dataclasses.fields(ZeroOptions)
      if f.name != "zero_stage"],
    (PipelineEngine.__init__, "schedule", PipelineOptions, "schedule"),
    (CheckpointManager.__init__, "keep_last", CheckpointOptions, "keep_last"),
    (WandbSink.__init__, "init_timeout_s", WandbOptions, "init_timeout_s"),
]


@pytest.mark.parametrize("func, param, cls, key", COMPONENT_DEFAULTS,
                         ids=[f"{f.__qualname__}:{p}" for f, p, _, _ in COMPONENT_DEFAULTS])
def test_components_take_their_defaults_from_the_options(func, param, cls, key):
    assert inspect.signature(func).parameters[param].default == getattr(cls(), key)


def test_zero_optimizer_has_no_default_stage_of_its_own():
    assert inspect.signature(ZeroOptimizer.__init__).parameters["zero_stage"].default is inspect.Parameter.empty


# ---- the planner composes the same options -------------------------------------------------
def test_layout_defaults_are_the_options_defaults():
    layout = Layout()
    owners = {**{k: ParallelDims for k in ("tp", "pp", "cp", "ep", "etp", "sequence_parallel")},
              **{k: ContextParallelOptions for k in ("cp_comm", "cp_a2a_size")},
              **{k: PipelineOptions for k in ("schedule", "virtual_stages", "split_drain")},
              **{k: ZeroOptions for k in ("zero_stage", "expert_zero_stage", "grad_reduce_dtype", "offload", "zero3_prefetch",
                                          "zero3_reshard")},
              **{k: TrainOptions for k in ("micro_batch_size", "seq_len", "recompute", "precision")}}
    assert set(owners) | {"dp", "global_batch_size"} == {f.name for f in dataclasses.fields(Layout)}
    for key, cls in owners.items():
        assert getattr(layout, key) == getattr(cls(), key), key


def _layout_for(schedule: str) -> Layout:
    return Layout(pp=2, schedule=schedule, virtual_stages=2 if schedule in MULTI_CHUNK else 1, micro_batch_size=1,
                  global_batch_size=4)


def test_the_planner_allows_exactly_the_config_s_schedules():
    assert config.SCHEDULES == SCHEDULES
    for schedule in config.SCHEDULES:
        assert _layout_for(schedule).schedule == schedule
        build_schedule(schedule, 2, 4, 2 if schedule in MULTI_CHUNK else 1)
    with pytest.raises(ConfigError, match=r"^parallel\.schedule='zbx': must be one of " + re.escape(
            ", ".join(config.SCHEDULES))):
        Layout(schedule="zbx")


def test_the_planner_searches_zb_h1_and_only_allowed_values():
    from models import get_config

    layouts = enumerate_layouts(get_config("gpt3_175b"), ClusterSpec.build(64, 8, "a100_80gb"),
                                PlanRequest(global_batch_size=64, seq_len=2048, precision="bf16"))
    searched = {lay.schedule for lay in layouts}
    assert "zb_h1" in searched and searched <= set(config.SCHEDULES)
    assert all(lay.schedule != "zb_h1" for lay in layouts if lay.pp == 1)
    assert RECOMPUTE_ORDER == config.RECOMPUTE and set(PlanRequest(1, 1).zero_stages) <= set(config.ZERO_STAGES)


def test_layout_errors_are_the_options_errors():
    for changes, options in [(dict(zero_stage=4), dict(zero_stage=4)), (dict(offload="nvme"), dict(offload="nvme"))]:
        with pytest.raises(ConfigError) as from_layout:
            Layout(**changes)
        with pytest.raises(ConfigError) as from_options:
            ZeroOptions(**options)
        assert str(from_layout.value) == str(from_options.value)


# ---- ParallelDims -------------------------------------------------------------------------
@pytest.mark.parametrize("value", [2, 4, 8])
def test_context_parallel_degree_builds_its_topology(value):
    dims = ParallelDims(cp=value).with_world(2 * value)
    assert dims.cp_enabled and dims.build_topology().size("cp") == value and dims.dp == 2


@pytest.mark.parametrize("value", [2, 4])
def test_expert_parallel_degree_builds_its_topology(value):
    dims = ParallelDims(ep=value).with_world(2 * value)
    assert dims.build_topology().size("ep") == value and dims.dp == 2 * value


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_expert_grid_folds_over_the_dense_ranks_or_is_refused(tp):
    """ep x etp must divide tp x cp x dp (the expert grid folds over the dense one); null etp = tp."""
    assert ParallelDims(tp=tp).expert_tp == tp
    world = 8
    for etp in (1, 2, 4, 8):
        for ep in (1, 2, 4, 8):
            dims = ParallelDims(tp=tp, etp=etp, ep=ep).with_world(world)
            if world % (ep * etp):
                with pytest.raises(ConfigError, match=r"parallel"):
                    dims.build_topology()
                continue
            topo = dims.build_topology()
            assert (topo.size("etp"), topo.size("ep"), topo.size("edp")) == (etp, ep, world // (ep * etp))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16])
def test_dp_auto_is_what_the_world_leaves(world):
    for tp in (1, 2, 3, 4):
        for pp in (1, 2, 3):
            dims = ParallelDims(tp=tp, pp=pp)
            if world % (tp * pp):
                with pytest.raises(ConfigError, match=r"^parallel\.dp=auto: world_size="):
                    dims.with_world(world)
                continue
            resolved = dims.with_world(world)
            topo = resolved.build_topology()
            assert (topo.tp, topo.pp, topo.dp, topo.world_size) == (tp, pp, world // (tp * pp), world)
            assert resolved.dp_enabled == (world // (tp * pp) > 1) and resolved.tp_enabled == (tp > 1)
            assert resolved.pp_enabled == (pp > 1) and not resolved.cp_enabled and not resolved.ep_enabled
            wrong = world // (tp * pp) + 1
            with pytest.raises(ConfigError, match=r"^parallel\.tp\*pp\*dp = "):
                ParallelDims(tp=tp, pp=pp, dp=wrong).with_world(world)


def test_the_config_s_default_order_is_the_topology_s():
    assert ParallelDims().order == inspect.signature(Topology).parameters["order"].default


def test_the_resolved_job_carries_the_options_it_was_checked_with(tmp_path):
    job = config.job_from_dict({"parallel": {"tp": 2, "zero_stage": 2, "overlap_param_gather": False},
                                "train": {"out_dir": str(tmp_path / "run"), "device": "cpu", "seq_len": 32,
                                          "preempt_signal": ["SIGUSR2"]}}, model="gpt_tiny")
    rj = config.resolve(job, world_size=4)
    assert rj.dims == ParallelDims(tp=2, dp=2) and rj.topology == rj.dims.build_topology()
    assert rj.zero == ZeroOptions(zero_stage=2, overlap_param_gather=False)
    assert rj.stop.preempt_signal == ("SIGUSR2",) and rj.train.seq_len == 32 and rj.device == "cpu"
    assert rj.grad_accum == rj.train.grad_accum(2) == 8 // (4 * 2)


# ---- messages name keys that exist ----------------------------------------------------------
KEY_IN_MESSAGE = re.compile(r"\b((?:parallel|train|optimizer|data|logging|kernels|model)\.[a-z_][a-z0-9_]*"
                            r"(?:\.[a-z_][a-z0-9_]*)*)=")


# Modules whose messages name the fields of another file format, not config keys.
OTHER_FORMATS = {"parallel3d/planning/published_checks.py"}  # rows of planning/published_runs.yaml


def test_every_key_an_error_message_names_is_a_config_key():
    """A message naming ``<section>.<key>=`` must name a real key (``parallel.pp_schedule`` and
    ``data.seq_len`` were not). Scans every string literal of parallel3d/, models/, kernels/."""
    import ast
    from pathlib import Path

    keys = set(_schema_leaves(config.JobConfig))
    root = Path(__file__).resolve().parent.parent
    unknown = []
    for package in ("parallel3d", "models", "kernels"):
        for path in sorted((root / package).rglob("*.py")):
            if path.relative_to(root).as_posix() in OTHER_FORMATS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    unknown += [f"{path.relative_to(root)}:{node.lineno}: {m.group(1)}"
                                for m in KEY_IN_MESSAGE.finditer(node.value) if m.group(1) not in keys]
    assert unknown == []


# (conf file, key, the one tuple of allowed values) for every yaml comment that lists a key's choices
COMMENTED_CHOICES = [
    ("parallel/default.yaml", "schedule", config.SCHEDULES),
    ("parallel/default.yaml", "offload", config.OFFLOAD_MODES),
    ("parallel/default.yaml", "cp_comm", CP_COMM_VARIANTS),
    ("train/default.yaml", "precision", config.PRECISIONS),
    ("train/default.yaml", "recompute", config.RECOMPUTE),
    ("train/default.yaml", "device", config.DEVICES),
    ("kernels/auto.yaml", "backend", config.KERNEL_BACKENDS),
    ("logging/default.yaml", "mode", config.WANDB_MODES),
    ("data/default.yaml", "source", SOURCES),
    ("data/default.yaml", "corpus", CORPORA),
    ("data/default.yaml", "tokenizer", TOKENIZER_KINDS),
]


def _commented_choices(path: str, key: str) -> list[str]:
    """The values a ``key: value  # [what:] a (why) | b | c`` line's comment lists, in order."""
    for line in open(path):
        if line.strip().startswith(f"{key}:") and "#" in line:
            comment = line.split("#", 1)[1]
            pieces = comment.split("|")
            pieces[0] = pieces[0].rsplit(":", 1)[-1]
            return [piece.split()[0] for piece in pieces]
    raise AssertionError(f"{path}: no commented '{key}:' line")


@pytest.mark.parametrize("path, key, allowed", COMMENTED_CHOICES, ids=[f"{p}:{k}" for p, k, _ in COMMENTED_CHOICES])
def test_yaml_comments_list_exactly_the_allowed_values(path, key, allowed):
    """A comment naming a key's choices may not drift from the options' tuple (a new schedule, say)."""
    from parallel3d.train import CONF_DIR

    assert _commented_choices(os.path.join(CONF_DIR, path), key) == list(allowed)
