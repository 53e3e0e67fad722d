"""The Hydra config: composition, YAML vs models registry, documentation, validation messages."""

from __future__ import annotations

import dataclasses
import os
import re
import typing

import functools

import pytest
from omegaconf import OmegaConf

from models import config_names, get_config
from models.config import ModelConfig
from parallel3d.config import (
    ConfigError,
    JobConfig,
    ModelSchema,
    build_model_config,
    job_from_dict,
    resolve,
)
from parallel3d.train import CONF_DIR, compose_job, to_job


def _resolve(overrides: list[str], world_size: int = 1):
    job, _ = compose_job(overrides)
    return resolve(job, world_size)


@functools.lru_cache(maxsize=1)
def _default_cfg():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config")


def _resolve_fast(overrides: list[str], world_size: int = 1):
    """Plain ``key=value`` overrides merged onto the composed default (Hydra composes in ~1 s)."""
    cfg = OmegaConf.merge(_default_cfg(), OmegaConf.from_dotlist(overrides))
    job, _ = to_job(cfg)
    return resolve(job, world_size)


@pytest.mark.parametrize("name", config_names())
def test_model_yaml_agrees_with_registry(name):
    yaml_values = OmegaConf.load(os.path.join(CONF_DIR, "model", f"{name}.yaml"))
    schema = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelSchema), yaml_values))
    values = {f.name: getattr(schema, f.name) for f in dataclasses.fields(ModelSchema)}
    assert ModelConfig(**values) == get_config(name)


def test_every_registry_model_has_a_yaml_and_back():
    yamls = {f[:-5] for f in os.listdir(os.path.join(CONF_DIR, "model")) if f.endswith(".yaml")}
    assert yamls == set(config_names())


def test_model_schema_mirrors_model_config():
    fields = {f.name for f in dataclasses.fields(ModelSchema)}
    assert fields | {"kernel_backend"} == {f.name for f in dataclasses.fields(ModelConfig)}


def _leaf_keys(schema: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_every_key_is_documented_in_conf():
    """Each non-model key appears with a comment in its group's default YAML (model keys: models/config.py)."""
    defaults = {"parallel": "default", "train": "default", "optimizer": "adamw", "data": "default",
                "logging": "default", "kernels": "auto"}
    undocumented = []
    for key in _leaf_keys(JobConfig):
        group, *rest = key.split(".")
        if group == "model":
            continue
        text = open(os.path.join(CONF_DIR, group, defaults[group] + ".yaml")).read()
        leaf = rest[-1]
        if not re.search(rf"^\s*{leaf}:.*#", text, re.M) and not re.search(rf"^\s*#.*\b{leaf}\b", text, re.M):
            undocumented.append(key)
    assert undocumented == []


def test_default_job_resolves():
    rj = _resolve([])
    assert rj.model.name == "gpt_tiny"
    t = rj.job.train
    assert rj.grad_accum * t.micro_batch_size * rj.topology.dp == t.global_batch_size
    assert rj.job.train.out_dir == "runs/gpt_tiny"  # interpolated, same on every rank


def test_dp_auto_and_grad_accum():
    rj = _resolve_fast(["parallel.tp=2", "parallel.pp=2", "train.global_batch_size=16", "train.micro_batch_size=2"], 8)
    assert (rj.topology.tp, rj.topology.pp, rj.topology.dp) == (2, 2, 2)
    assert rj.grad_accum == 4


def test_overrides_reach_the_model_and_kernels():
    rj = _resolve(["model=llama_tiny", "model.num_layers=6", "model.dropout=0.1", "kernels.backend=torch"])
    assert rj.model.arch == "llama" and rj.model.num_layers == 6 and rj.model.dropout == 0.1
    assert rj.model.kernel_backend == "torch"


BAD = [
    (["train.global_batch_size=10"], 1, r"train\.global_batch_size=10 is not divisible by .*16\*1 = 16"),
    (["parallel.tp=3"], 1, r"parallel\.dp=auto: world_size=1 is not divisible by .*3"),
    (["parallel.tp=2", "parallel.dp=2"], 8, r"tp\*pp\*dp = 2\*1\*2 = 4 .* world_size=8"),
    (["parallel.dp=x"], 1, r"parallel\.dp='x': must be an integer >= 1 or 'auto'"),
    (["parallel.zero_stage=4"], 1, r"parallel\.zero_stage=4: must be one of 0, 1, 2, 3"),
    (["parallel.offload=nvme"], 1, r"parallel\.offload='nvme': must be one of none, cpu, disk"),
    (["parallel.offload=cpu"], 1, r"parallel\.offload=cpu: needs parallel\.zero_stage >= 1 \(with stage 0"),
    (["parallel.zero_stage=3", "parallel.offload=disk"], 1,
     r"parallel\.offload_dir=null: parallel\.offload=disk needs a directory"),
    (["parallel.zero_stage=1", "parallel.offload=disk", "parallel.offload_dir=/proc/p3d"], 1,
     r"parallel\.offload_dir='/proc/p3d': must be a writable directory \(cannot write in /proc: "),
    (["parallel.zero_stage=1", "parallel.offload=disk", "parallel.offload_dir=/etc/hostname"], 1,
     r"parallel\.offload_dir='/etc/hostname': must be a writable directory \(/etc/hostname is not a directory\)"),
    (["parallel.zero_stage=2", "parallel.offload_dir=/tmp/x"], 1,
     r"parallel\.offload_dir='/tmp/x': only used with parallel\.offload=disk \(offload is 'none'\)"),
    (["parallel.zero_stage=2", "parallel.offload=disk", "parallel.offload_dir=/tmp/x", "parallel.offload_buffer_mb=0"],
     1, r"parallel\.offload_buffer_mb=0"),
    (["parallel.zero_stage=3", "parallel.zero3_prefetch=-1"], 1, r"parallel\.zero3_prefetch=-1: must be an integer >= 0"),
    (["parallel.zero_stage=3", "parallel.zero3_reshard=layer"], 1,
     r"parallel\.zero3_reshard='layer': must be one of auto, microbatch, step"),
    (["parallel.zero_stage=2", "parallel.zero3_reshard=step"], 1,
     r"parallel\.zero3_reshard=step: only used with parallel\.zero_stage=3 \(zero_stage is 2\)"),
    (["parallel.schedule=zb"], 1, r"parallel\.schedule='zb': must be one of 1f1b, gpipe, interleaved_1f1b"),
    (["parallel.virtual_stages=2"], 1, r"parallel\.virtual_stages=2: only parallel\.schedule=interleaved_1f1b"),
    (["parallel.schedule=zbv"], 1, r"parallel\.schedule=zbv runs two chunks per stage: set parallel\.virtual_stages=2"),
    (["parallel.sequence_parallel=true"], 1, r"parallel\.sequence_parallel=true: needs parallel\.tp > 1"),
    (["parallel.order=tp-pp", "parallel.dp=2"], 2, r"parallel\.order='tp-pp': .*does not name 'dp', but dp=2 > 1"),
    (["parallel.pp=2", "parallel.pp_layers=[1,2]"], 2, r"parallel\.pp_layers=\[1, 2\]: sums to 3"),
    (["parallel.pp=8"], 8, r"num_layers=4 is fewer than pipeline chunks"),
    (["model=llama_tiny", "parallel.tp=4"], 4, r"num_kv_heads=2 is not divisible by tp=4"),
    (["parallel.bucket_size_mb=0"], 1, r"parallel\.bucket_size_mb=0"),
    (["train.steps=0"], 1, r"train\.steps=0: must be an integer >= 1"),
    (["train.seq_len=65"], 1, r"train\.seq_len=65: must be <= model\.max_seq_len=64"),
    (["train.precision=fp8"], 1, r"train\.precision='fp8': must be one of fp32, bf16, fp16"),
    (["train.recompute=some"], 1, r"train\.recompute='some': must be one of none, selective, full"),
    (["train.resume=/no/such/dir"], 1, r"train\.resume='/no/such/dir'"),
    (["train.device=tpu"], 1, r"train\.device='tpu': must be one of auto, cpu, cuda"),
    (["train.timeout_s=0"], 1, r"train\.timeout_s=0"),
    (["train.keep_last=0"], 1, r"train\.keep_last=0: must be an integer >= 1"),
    (["optimizer.lr=0"], 1, r"optimizer\.lr=0"),
    (["optimizer.min_lr=1.0"], 1, r"optimizer\.min_lr=1\.0: must be a number >= 0\.0 and <= 0\.003"),
    (["optimizer.warmup_steps=1000"], 1, r"optimizer\.warmup_steps=1000: must be <= train\.steps=500"),
    (["optimizer.beta2=1.0"], 1, r"optimizer\.beta2=1\.0: must be in \[0, 1\)"),
    (["model.dropout=1.5"], 1, r"model\.dropout=1\.5"),
    (["model.num_heads=3"], 1, r"hidden_size=64 is not divisible by model\.num_heads=3"),
    (["data.source=web"], 1, r"data\.source='web': must be one of default, indexed"),
    (["data=indexed"], 1, r"data\.paths=\[\]: data\.source=indexed needs at least one"),
    (["data.source=indexed", "data.paths=[/nope/x]"], 1, r"data\.paths entry '/nope/x': file /nope/x\.bin"),
    (["data.tokenizer=gpt9"], 1, r"data\.tokenizer='gpt9': must be one of bpe, byte"),
    (["logging.log_every=0"], 1, r"logging\.log_every=0"),
    (["logging.wandb.mode=maybe"], 1, r"logging\.wandb\.mode='maybe': must be one of online, offline, disabled"),
    (["kernels.backend=cuda"], 1, r"kernels\.backend='cuda': must be one of auto, triton, apex, torch"),
    (["model.num_layerz=3"], 1, r"model\.num_layerz: unknown key; model accepts: arch, num_layers"),
    (["+train.foo=1"], 1, r"train\.foo: unknown key; train accepts: steps"),
    (["model.num_layers=abc"], 1, r"model\.num_layers: Value 'abc' of type 'str' could not be converted to Integer"),
    (["model=nope"], 1, r"Could not find 'model/nope' Available options in 'model': .*gpt_tiny"),
]


HYDRA_SPECIFIC = ("data=", "model=", "+", "model.num_layerz", "model.num_layers=abc")


@pytest.mark.parametrize("overrides,world,pattern", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_values_give_one_clear_line(overrides, world, pattern):
    # Group choices, '+' additions and type errors go through Hydra's own composition.
    hydra_path = any(o.startswith(HYDRA_SPECIFIC) for o in overrides)
    with pytest.raises(ConfigError) as info:
        (_resolve if hydra_path else _resolve_fast)(overrides, world)
    message = str(info.value)
    assert "\n" not in message
    assert re.search(pattern, message), message


def test_zero_choices_are_the_optimizer_s():
    """The validator's choices are the ones the optimizer implements (the layout matrix draws from them)."""
    from parallel3d import config, zero

    assert config.ZERO_STAGES == zero.ZERO_STAGES
    assert config.OFFLOAD_MODES == zero.OFFLOAD_MODES
    assert config.ZERO3_RESHARD == zero.RESHARD_MODES


def test_stage3_and_offload_combinations_resolve(tmp_path):
    for stage in (1, 2, 3):
        for offload in ("none", "cpu", "disk"):
            extra = [f"parallel.offload_dir={tmp_path}/off"] if offload == "disk" else []
            rj = _resolve_fast([f"parallel.zero_stage={stage}", f"parallel.offload={offload}", *extra], 1)
            assert rj.job.parallel.offload == offload
    rj = _resolve_fast(["parallel.zero_stage=3", "parallel.pp=2", "parallel.zero3_reshard=microbatch",
                        "parallel.zero3_prefetch=0"], 2)
    assert rj.job.parallel.zero3_reshard == "microbatch" and rj.job.parallel.zero3_prefetch == 0


def test_world_size_comes_from_the_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    job, _ = to_job(OmegaConf.merge(_default_cfg(), OmegaConf.from_dotlist(["parallel.pp=2"])))
    assert resolve(job).topology.dp == 2
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match="WORLD_SIZE='four'"):
        resolve(job)


def test_job_from_dict_matches_compose():
    model = {k: v for k, v in dataclasses.asdict(get_config("gpt_tiny")).items() if k != "kernel_backend"}
    job = job_from_dict({"model": model, "train": {"seq_len": 32}})
    assert build_model_config(job) == get_config("gpt_tiny")
    assert job.train.seq_len == 32
    with pytest.raises(ConfigError, match="train.stepz"):
        job_from_dict({"train": {"stepz": 3}})



def test_job_from_dict_leaves_no_trace_on_the_next_job():
    """job_from_dict merges into one per-process schema: a job's values must not leak into the next one's
    defaults (the reference: the dataclass defaults themselves), nor a refused job's."""
    job_from_dict({"parallel": {"tp": 3, "schedule": "interleaved"}, "train": {"seq_len": 48}})
    with pytest.raises(ConfigError):
        job_from_dict({"train": {"steps": "many"}})
    assert job_from_dict({}) == JobConfig()
    assert job_from_dict({"train": {"seq_len": 32}}) == dataclasses.replace(
        JobConfig(), train=dataclasses.replace(JobConfig().train, seq_len=32))

def test_resume_none_refuses_to_mix_with_old_checkpoints(tmp_path):
    from parallel3d.checkpoint import CheckpointManager
    from parallel3d.parallel_state import ParallelState

    out = str(tmp_path / "run")
    CheckpointManager(os.path.join(out, "checkpoints"), ParallelState.single_process()).save(5, lambda d: None, {})
    with pytest.raises(ConfigError, match=r"train\.resume=none but train\.out_dir=.* holds checkpoints of steps \[5\]"):
        _resolve_fast([f"train.out_dir={out}", "train.resume=none"])
    assert _resolve_fast([f"train.out_dir={out}", "train.resume=auto"]).job.train.resume == "auto"


def test_resume_none_counts_a_complete_tmp_the_ranks_would_publish(tmp_path):
    """Session 45 (review45): a complete ``step_N.tmp`` (a kill among a save's renames) is published by the next
    job's ranks before training, so under ``resume=none`` it mixed an old run's step into the new run."""
    from parallel3d.checkpoint import CheckpointManager, step_dir
    from parallel3d.parallel_state import ParallelState

    out = str(tmp_path / "run")
    root = os.path.join(out, "checkpoints")
    CheckpointManager(root, ParallelState.single_process()).save(6, lambda d: None, {})
    os.rename(step_dir(root, 6), step_dir(root, 6) + ".tmp")
    with pytest.raises(ConfigError, match=r"train\.resume=none but train\.out_dir=.* holds checkpoints of steps \[6\]"):
        _resolve_fast([f"train.out_dir={out}", "train.resume=none"])


def test_the_already_trained_line_advises_only_what_the_config_accepts(tmp_path):
    """Session 43: resuming a run already at train.steps advised "train.resume=none starts over", which the
    check above refuses for that very directory. Every key=value the line names must resolve there."""
    import re

    from parallel3d.checkpoint import CheckpointManager
    from parallel3d.parallel_state import ParallelState
    from parallel3d.resume_notes import already_trained_line

    out = str(tmp_path / "run")
    CheckpointManager(os.path.join(out, "checkpoints"), ParallelState.single_process()).save(5, lambda d: None, {})
    line = already_trained_line(4, 5)
    advice = re.findall(r"\b(\w+\.\w+=\S+?)[,;)]?(?:\s|$)", line)
    assert advice, line
    for override in advice:
        _resolve_fast([f"train.out_dir={out}", "optimizer.warmup_steps=1", override])


def test_moe_pad_to_capacity_reaches_the_dispatcher(tmp_path, monkeypatch):
    """docs/moe.md's ``model.moe.pad_to_capacity=true`` is a key of the job (it was only a layer option): the built
    MoE layers' all-to-all pads, and without a capacity factor the job is refused in one line."""
    from models import build_model
    from parallel3d.parallel_state import ParallelState

    monkeypatch.chdir(tmp_path)
    job, _ = compose_job(["model=mixtral_tiny", "model.moe.capacity_factor=1.25", "model.moe.pad_to_capacity=true"])
    model = build_model(resolve(job).model, ParallelState.single_process(device="meta"), device="meta")
    dispatchers = [m.dispatcher for m in model.modules() if hasattr(m, "dispatcher")]
    assert dispatchers and all(d.pad_to_capacity for d in dispatchers)
    job, _ = compose_job(["model=mixtral_tiny", "model.moe.pad_to_capacity=true"])
    with pytest.raises(ConfigError, match="pad_to_capacity=True: needs a capacity_factor"):
        resolve(job)
