"""``train.eval_only=true`` (Megatron's ``--skip-train``; ``parallel3d/eval_only.py``): a checkpoint evaluated once.

Reference: the eval loss the one-process training run logged at the checkpoint's step (its own evaluation, in the
same ``Evaluator``), so an evaluation-only run is right when it gives that number from the checkpoint alone, at
another layout (torchrun, two ranks) through the real command line, writing nothing but its record.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from parallel3d.checkpoint import complete_checkpoints, step_dir
from parallel3d.config import ConfigError, job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.trainer import train
from parallel3d.wandb_reader import find_offline_runs, read_run
from tests.fault_runs import run_to_end
from tests.harness import run_on_ranks

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")
STEPS, EVERY = 4, 2  # checkpoints and evaluations at steps 2 and 4
TRAIN = {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32, "seed": 7, "device": "cpu",
         "save_every": EVERY, "keep_last": 2, "eval_every": EVERY, "eval_iters": 2, "async_save": False}
DATA = {"valid_fraction": 0.05}


def _values(out: str, cache: str, **train_keys) -> dict:
    return {"train": {**TRAIN, "out_dir": out, **train_keys}, "optimizer": {"warmup_steps": 1},
            "data": {**DATA, "cache_dir": cache}, "logging": {"log_every": 1}}


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, str, dict[int, float]]:
    """A one-process run with checkpoints and evaluations at steps 2 and 4: (run dir, cache, eval loss by step)."""
    root = tmp_path_factory.mktemp("eval_only")
    out, cache = str(root / "run"), str(root / "cache")
    train(resolve(job_from_dict(_values(out, cache), model="gpt_tiny"), 1), ParallelState.single_process())
    logged = {r["step"]: r["eval_loss"] for r in _records(out) if r.get("eval_loss") is not None}
    assert sorted(logged) == [2, 4]
    return out, cache, logged


def _eval_on_rank(rank: int, world: int, values: dict, parallel: dict) -> dict | None:
    rj = resolve(job_from_dict({**values, "parallel": parallel}, model="gpt_tiny"), world)
    result = train(rj, ParallelState(rj.topology))
    assert result.last_step == result.start_step and result.checkpoints == []
    return result.records[0] if result.records else None


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"pp": 2}, {"tp": 2}], ids=["pp2", "tp2"])
def test_two_ranks_evaluate_an_older_checkpoint_to_the_loss_its_run_logged(trained, tmp_path, parallel):
    run, cache, logged = trained
    out = str(tmp_path / "eval")
    values = _values(out, cache, eval_only=True, resume=step_dir(os.path.join(run, "checkpoints"), EVERY))
    records = [r for r in run_on_ranks(_eval_on_rank, 2, values, parallel) if r is not None]
    assert len(records) == 1  # the logging rank's
    record = records[0]
    assert record["step"] == EVERY and record["eval_loss"] == pytest.approx(logged[EVERY], rel=1e-6, abs=0)
    assert _records(out) == [record]
    assert complete_checkpoints(os.path.join(out, "checkpoints")) == []


@pytest.mark.slow
def test_the_cli_on_two_ranks_evaluates_the_newest_checkpoint_and_writes_only_its_record(trained, tmp_path):
    """torchrun, pp 2, in the training run's own directory (``train.resume=auto``), W&B offline."""
    run, cache, logged = trained
    here = str(tmp_path / "run")
    shutil.copytree(run, here)
    history = _records(here)
    saved = {path: os.stat(os.path.join(path, "meta.json")).st_mtime_ns
             for _, path in complete_checkpoints(os.path.join(here, "checkpoints"))}
    args = [f"train.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in TRAIN.items()]
    proc = run_to_end([*args, f"train.out_dir={here}", f"data.cache_dir={cache}", "data.valid_fraction=0.05",
                       "optimizer.warmup_steps=1", "train.eval_only=true", "logging=wandb_offline", "parallel.pp=2"],
                      nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("eval only:")]
    assert len(lines) == 1 and f"step_{STEPS:08d} (step {STEPS}): eval_loss" in lines[0], proc.stdout[-2000:]
    got = _records(here)
    assert got[:-1] == history  # the run's history kept whole, one record appended
    assert got[-1]["step"] == STEPS and got[-1]["eval_loss"] == pytest.approx(logged[STEPS], rel=1e-6, abs=0)
    assert "loss" not in got[-1]  # an evaluation record: nothing was trained
    assert {path: os.stat(os.path.join(path, "meta.json")).st_mtime_ns
            for _, path in complete_checkpoints(os.path.join(here, "checkpoints"))} == saved
    assert sorted(os.listdir(os.path.join(here, "checkpoints"))) == sorted(os.path.basename(p) for p in saved)
    (wandb_file,) = find_offline_runs(here)
    rows = [row for row in read_run(wandb_file, wait_s=60)["history"] if "eval/eval_loss" in row]
    assert [(row["_step"], row["eval/eval_loss"]) for row in rows] == [(STEPS, got[-1]["eval_loss"])]


def test_eval_only_needs_batches_to_evaluate(tmp_path):
    values = _values(str(tmp_path / "run"), str(tmp_path / "cache"), eval_only=True, eval_iters=0)
    with pytest.raises(ConfigError, match=r"^train\.eval_only=true: needs train\.eval_iters > 0"):
        resolve(job_from_dict(values, model="gpt_tiny"), 1)
