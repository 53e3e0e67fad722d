"""Inputs no issue named, found by fuzzing the entry points a user types: each must fail before any rank
starts, in one line naming the key, with a nonzero exit and no traceback.

Three kinds of case:
- generated from the schema (``JobConfig``'s float keys, the same walk as ``test_config_errors``): nan,
  +inf and -inf for every one (inf compares as in range against "> 0" and overflowed deep in a run:
  ``int(inf)`` in the gradient buckets and the MoE capacity, a nan loss from ``init_std=inf``);
  and, for every bool key, a number (OmegaConf had read ``model.tie_embeddings=2`` as true);
- cross-key and environment cases through ``parallel3d.train.main`` in this process (the CLI's entry
  function, Hydra's app replaced by a failure: a case that got past the checks would start training);
- the other CLIs (``scripts/plan.py``, ``scripts/estimate_memory.py``, ``python -m parallel3d.dryrun``)
  through real processes, run together.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import typing

import pytest

from parallel3d import train as train_cli
from parallel3d.checkpoint_io.compat import FORMAT
from parallel3d.config import ConfigError
from tests.fault_runs import REPO, cli_env
from tests.test_config import _resolve_fast
from tests.test_config_errors import _base, _leaves, _run_in_process

NON_FINITE = ("nan", "inf", "-inf")


def non_finite_cases() -> list[tuple[str, str]]:
    """``(key, value)``: every float key of the schema with every non-finite value."""
    return [(key, value) for key, hint in _leaves() if _base(hint) is float for value in NON_FINITE]


NON_FINITE_CASES = non_finite_cases()


def test_non_finite_cases_cover_the_float_keys():
    keys = {k for k, _ in NON_FINITE_CASES}
    assert {"optimizer.lr", "parallel.bucket_size_mb", "model.init_std", "train.max_minutes"} <= keys, keys


@pytest.mark.parametrize("case", NON_FINITE_CASES, ids=[f"{k}={v}" for k, v in NON_FINITE_CASES])
def test_every_float_key_refuses_nan_and_infinity(case, tmp_path):
    key, value = case
    with pytest.raises(ConfigError) as caught:  # model.moe.* are checked on a dense model too
        _resolve_fast([f"train.out_dir={tmp_path}/run", f"{key}={value}"])
    message = str(caught.value)
    assert key.split(".")[-1] in message and "\n" not in message, message


def cluster_cases() -> list[tuple[str, typing.Any]]:
    """``(key, value)``: the planners' ``cluster.*`` float keys (their schema, ``ClusterConfig``) with every
    non-finite value, and ``cluster.device_mem`` as a size that reads as infinite."""
    from parallel3d.planning.cli import ClusterConfig

    hints = typing.get_type_hints(ClusterConfig)
    floats = [f.name for f in dataclasses.fields(ClusterConfig) if _base(hints[f.name]) is float]
    return [(k, float(v)) for k in floats for v in NON_FINITE] + [("device_mem", "1e400GB")]


CLUSTER_CASES = cluster_cases()


@pytest.mark.parametrize("case", CLUSTER_CASES, ids=[f"cluster.{k}={v}" for k, v in CLUSTER_CASES])
def test_planner_cluster_keys_refuse_nan_and_infinity(case):
    from parallel3d.planning.cli import ClusterConfig, cluster_from

    key, value = case
    with pytest.raises(ValueError, match=f"cluster.{key}="):
        cluster_from(ClusterConfig(gpus=8, **{key: value}))


BOOL_KEYS = [key for key, hint in _leaves() if _base(hint) is bool]


def test_bool_keys_cover_the_schema():
    assert {"model.tie_embeddings", "parallel.sequence_parallel", "data.document_mask"} <= set(BOOL_KEYS), BOOL_KEYS


@pytest.mark.parametrize("value", ["2", "'1'"])
@pytest.mark.parametrize("key", BOOL_KEYS)
def test_every_bool_key_refuses_a_number(key, value, monkeypatch, capsys, tmp_path):
    """OmegaConf reads any nonzero number as true (``model.tie_embeddings=2``): refused as typed."""
    code, out, err = _run_in_process([f"{key}={value}", f"train.out_dir={tmp_path}/run"], 1, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"{key}=" in lines[0] and "must be true or false" in lines[0], err[-2000:]


def test_every_bool_key_keeps_its_spellings():
    """true/false and the words OmegaConf reads as bools still pass the check (composed once)."""
    from omegaconf import OmegaConf

    from parallel3d.command_line import _check_bool_overrides, _parse_overrides
    from tests.test_config import _default_cfg

    cfg = _default_cfg()
    spellings = ("true", "false", "True", "yes", "no", "on", "off")
    _check_bool_overrides(cfg, _parse_overrides([f"{key}={word}" for key in BOOL_KEYS for word in spellings]))
    for key in BOOL_KEYS:  # and OmegaConf reads them as the bool they spell
        merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{key}=yes"]))
        assert OmegaConf.select(merged, key) is True, key


CHECKPOINTS = ("empty", "bad_json", "json_list", "other_model", "lost_file")  # train.resume directories no rank can resume from


def _make_bad_paths(tmp: str) -> None:
    """A file where a directory is expected, and each directory of ``CHECKPOINTS``."""
    with open(os.path.join(tmp, "a_file"), "w") as fh:
        fh.write("not a directory")
    for name in CHECKPOINTS:
        os.makedirs(os.path.join(tmp, name))
    with open(os.path.join(tmp, "bad_json", "meta.json"), "w") as fh:
        fh.write("{not json")
    with open(os.path.join(tmp, "json_list", "meta.json"), "w") as fh:  # JSON, but not a checkpoint's
        fh.write("[]")
    with open(os.path.join(tmp, "lost_file", "meta.json"), "w") as fh:  # lists a file it does not hold
        json.dump({"format": FORMAT, "step": 1, "files": ["state/__0_0.distcp"]}, fh)
    with open(os.path.join(tmp, "other_model", "meta.json"), "w") as fh:  # complete: it lists no files
        json.dump({"format": FORMAT, "step": 1, "files": [],
                   "model": {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 512,
                             "max_seq_len": 64}}, fh)


# Path keys an empty value would silently turn into the working directory, with what makes the key used.
NON_EMPTY_PATHS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train.out_dir", ()), ("data.cache_dir", ()),
    ("parallel.offload_dir", ("parallel.zero_stage=1", "parallel.offload=disk")))


def hand_cases(tmp: str) -> list[tuple[str, list[str], str, int]]:
    """``(id, overrides, text the one line must hold, world size)``; paths under ``tmp`` (``_make_bad_paths``)."""
    return [
        ("ep:experts", ["model=mixtral_tiny", "parallel.ep=3", "train.global_batch_size=48"], "parallel.ep=3", 3),
        ("etp:expert-width", ["model=mixtral_tiny", "parallel.etp=3", "train.global_batch_size=48"],
         "parallel.etp=3", 3),
        # ep / etp on a dense model did nothing (ep folded into dp, silently)
        ("ep:dense-model", ["parallel.ep=2"], "parallel.ep=2: splits the routed experts", 2),
        ("etp:dense-model", ["parallel.tp=2", "parallel.etp=1"], "parallel.etp=1: splits the routed experts", 2),
        ("resume:empty-dir", [f"train.resume={tmp}/empty"], "train.resume=", 1),
        ("resume:corrupt-meta", [f"train.resume={tmp}/bad_json"], "train.resume=", 1),
        ("resume:meta-not-an-object", [f"train.resume={tmp}/json_list"], "not a complete checkpoint directory", 1),
        ("resume:lost-file", [f"train.resume={tmp}/lost_file"], "not a complete checkpoint directory", 1),
        ("resume:another-model", [f"train.resume={tmp}/other_model"], "holds another model", 1),
        ("cache_dir:a-file", [f"data.cache_dir={tmp}/a_file"], "data.cache_dir=", 1),
        ("kernels:triton-on-cpu", ["train.device=cpu", "kernels.backend=triton"], "kernels.backend='triton'", 1),
        ("kernels:apex-on-cpu", ["train.device=cpu", "kernels.backend=apex"], "kernels.backend='apex'", 1),
        ("out_dir:name-too-long", [f"train.out_dir={tmp}/{'x' * 300}"], "the filesystem allows", 1),
        ("hydra:run-dir-under-a-file", [f"hydra.run.dir={tmp}/a_file/run"], "hydra.run.dir=", 1),
        ("group:null", ["model=null"], "model=null: model is a config group; must be one of", 1),
        ("rope:odd-kv-channels", ["model=llama_tiny", "model.kv_channels=15"], "model.kv_channels=15", 1),
        *[(f"{key}:empty", [*setup, f"{key}="], f"{key}='': must be a non-empty path", 1)
          for key, setup in NON_EMPTY_PATHS],
    ]


HAND_IDS = [c[0] for c in hand_cases("/tmp")]


def test_resume_auto_skips_a_meta_json_of_another_shape(tmp_path):
    """On the ranks (``resume=auto`` picks among checkpoints there): damaged, refused in one line, no crash."""
    from parallel3d.checkpoint import CheckpointError, CheckpointManager, step_dir
    from parallel3d.parallel_state import ParallelState

    root = str(tmp_path / "checkpoints")
    os.makedirs(step_dir(root, 1))
    with open(os.path.join(step_dir(root, 1), "meta.json"), "w") as fh:
        fh.write("[]")
    with pytest.raises(CheckpointError, match="no intact checkpoint .*not a checkpoint's meta.json") as caught:
        CheckpointManager(root, ParallelState.single_process()).find("auto")
    assert "\n" not in str(caught.value)


ENV_CASES = [({"RANK": "abc"}, "environment RANK='abc'"), ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5"),
             ({"LOCAL_WORLD_SIZE": "two"}, "environment LOCAL_WORLD_SIZE='two'")]


@pytest.mark.parametrize("case", ENV_CASES, ids=[" ".join(f"{k}={v}" for k, v in c[0].items()) for c in ENV_CASES])
def test_a_launcher_variable_set_by_hand(case, monkeypatch, capsys, tmp_path):
    env, expect = case
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train_cli, "hydra_app", lambda *a, **k: pytest.fail(f"{env} was accepted"))
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main([f"train.out_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("config error: ") and expect in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("index", range(len(HAND_IDS)), ids=HAND_IDS)
def test_cross_key_and_environment_inputs(index, monkeypatch, capsys, tmp_path):
    _make_bad_paths(str(tmp_path))
    _, overrides, expect, world = hand_cases(str(tmp_path))[index]
    if not any(o.startswith("train.out_dir=") for o in overrides):
        overrides = [*overrides, f"train.out_dir={tmp_path}/run"]
    code, out, err = _run_in_process(overrides, world, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error: "), err[-2000:]
    assert expect in lines[0], (expect, lines[0])
    assert "Traceback" not in out + err


def cli_cases(tmp: str) -> list[tuple[list[str], str]]:
    """``(argv after python, text the one line must hold)`` for the non-training CLIs."""
    return [
        (["scripts/plan.py", "parallel.tp=two"], "parallel.tp"),  # estimate_memory.py: the same run_app
        (["scripts/plan.py", "plan.uneven_stages=2"], "plan.uneven_stages=2: must be true or false"),  # its own schema
        (["scripts/plan.py", "model=gpt_tiny", "cluster.gpus=8", "train.seq_len=64", f"plan.json={tmp}/no_dir/x.json"],
         "plan.json="),
        (["-m", "parallel3d.dryrun", "dryrun.world_size=2", f"dryrun.json={tmp}/no_dir/x.json",
          f"train.out_dir={tmp}/run"], "dryrun.json="),
    ]


def test_planning_and_dry_run_clis_fail_in_one_line(tmp_path):
    cases = cli_cases(str(tmp_path))
    procs = [subprocess.Popen([sys.executable, *argv], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv, _ in cases]
    for proc, (argv, expect) in zip(procs, cases):
        out, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert proc.returncode == 2, (argv, proc.returncode, err[-2000:])
        assert len(lines) == 1 and "error: " in lines[0] and expect in lines[0], (argv, err[-2000:])
        assert "Traceback" not in out + err
