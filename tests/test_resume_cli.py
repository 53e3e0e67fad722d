"""What a resume says when it trains nothing or cannot resume (session 45).

- ``train.stop_after`` at or below the checkpoint's step trained 0 steps and exited 0 without a word; it now says
  so in one line (exit 0, as a run already at ``train.steps`` does, and as Megatron-LM from a checkpoint at
  ``--train-iters``). Reference: the real trainer, whose records show whether it trained.
- ``train.resume=auto`` onto a checkpoint of another model failed on every rank (``[rank 0] failed:
  CheckpointError``, exit 1); it is now one ``config error:`` line and exit 2 before any process group, as an
  explicit ``train.resume=DIR`` already was (``preflight._check_newest``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import typing
from concurrent.futures import ThreadPoolExecutor

import pytest

from models import get_config
from models.config import ModelConfig
from parallel3d import train as train_cli
from parallel3d.checkpoint import CheckpointManager, complete_checkpoints
from models.params import parameter_shapes
from parallel3d.checkpoint_io.compat import FORMAT, model_signature
from parallel3d.config import ConfigError, job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.train import compose_job
from parallel3d.trainer import train
from tests.fault_runs import TINY, run_to_end

pytestmark = [pytest.mark.filterwarnings("ignore:no peak TFLOP/s known"),
              pytest.mark.filterwarnings("ignore:resuming with another learning-rate schedule")]
SAVED = 4  # the checkpoint's step


def _args(out: str, cache: str, *extra: str) -> list[str]:
    return [*TINY, f"train.out_dir={out}", f"data.cache_dir={cache}", "train.async_save=false", *extra]


def _train_in_process(args: list[str]) -> tuple[list[dict], str]:
    """``train`` on this process with the CLI's overrides, composed as the CLI composes them (``conf/``): its
    records and what it printed."""
    job, plain = compose_job(args)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = train(resolve(job, 1), ParallelState.single_process(), full_config=plain)
    return result.records, printed.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, str]:
    """A run directory holding one checkpoint, of step ``SAVED``: (run dir, cache)."""
    root = tmp_path_factory.mktemp("resume_cli")
    out, cache = str(root / "run"), str(root / "cache")
    _train_in_process(_args(out, cache, f"train.steps={SAVED}"))
    assert [step for step, _ in complete_checkpoints(os.path.join(out, "checkpoints"))] == [SAVED]
    return out, cache


# (train.steps, train.stop_after) around the checkpoint's step: below, at, one past it; and a run at its end.
STOP_CASES = [(2 * SAVED, SAVED - 1), (2 * SAVED, SAVED), (2 * SAVED, SAVED + 1), (SAVED, "null")]


@pytest.mark.parametrize("steps,stop_after", STOP_CASES, ids=[f"steps{s}-stop{a}" for s, a in STOP_CASES])
def test_a_resume_that_trains_nothing_says_why_in_one_line(saved, tmp_path, steps, stop_after):
    run, cache = saved
    here = str(tmp_path / "run")
    shutil.copytree(run, here)
    records, printed = _train_in_process(_args(here, cache, f"train.steps={steps}", f"train.stop_after={stop_after}"))
    said = [line for line in printed.splitlines() if "nothing to do" in line]
    assert len(said) == (0 if records else 1), printed  # a line exactly when no step was trained
    if said and stop_after != "null":
        assert said[0].startswith(f"train.stop_after={stop_after} is at or below the checkpoint's step {SAVED}")


def _other_models() -> list[tuple[str, ModelConfig, str, str, dict, str]]:
    """``(id, model, the job's preset, the model's preset and keys, the setting the line names first)``: gpt_tiny
    and llama_tiny with each int field doubled and each bool flipped, kept where that is a valid model with other
    parameters (``model_signature``, or the parameter names and shapes themselves: what a resume may not change),
    and the other tiny presets."""
    hints, out = typing.get_type_hints(ModelConfig), []
    for preset in ("gpt_tiny", "llama_tiny"):
        base = get_config(preset)
        for f in dataclasses.fields(ModelConfig):
            value = getattr(base, f.name)
            if hints[f.name] not in (int, bool, int | None, bool | None):
                continue
            changed = (not value) if hints[f.name] in (bool, bool | None) else 2 * (value or base.hidden_size)
            try:
                other = dataclasses.replace(base, **{f.name: changed})
            except (ValueError, TypeError):
                continue
            first = [k for k, v in model_signature(base).items() if model_signature(other).get(k) != v]
            if first or parameter_shapes(other) != parameter_shapes(base):
                out.append((f"{preset}:{f.name}={changed}", other, preset, preset, {f.name: changed},
                            (first or [f.name])[0]))
    return out + [(f"model={name}", get_config(name), "gpt_tiny", name, {}, "arch")
                  for name in ("llama_tiny", "mixtral_tiny")]


OTHER_MODELS = _other_models()


@pytest.mark.parametrize("index", range(len(OTHER_MODELS)), ids=[case[0] for case in OTHER_MODELS])
def test_resume_auto_onto_another_model_is_a_config_error(tmp_path, index):
    """The checkpoint's meta.json as a run writes it (format, model); the job is gpt_tiny or llama_tiny. Session 45
    (user45): a llama checkpoint trained with ``model.qk_norm=true`` resumed with ``false`` silently, its q/k norm
    weights dropped (the signature left them out, and a load reads only what the new model asks for)."""
    _, other, job, preset, keys, first = OTHER_MODELS[index]
    out = str(tmp_path / "run")
    CheckpointManager(os.path.join(out, "checkpoints"), ParallelState.single_process()).save(
        3, lambda d: None, {"format": FORMAT, "model": dataclasses.asdict(other)})
    values = {"train": {"out_dir": out, "seq_len": 32}, "data": {"cache_dir": str(tmp_path / "cache")}}
    with pytest.raises(ConfigError, match=rf"^train\.resume=auto: checkpoint .*step_00000003 holds another model "
                                          rf"\({first}=.*; resume it with its model, or start over in another"):
        resolve(job_from_dict(values, model=job), 1)
    resolve(job_from_dict({**values, "model": keys}, model=preset), 1)  # its own model resumes


def test_the_entry_point_refuses_another_model_in_one_line_and_exit_2(saved, tmp_path, monkeypatch, capsys):
    """The CLI's entry function (``parallel3d.train.main``), with Hydra's app replaced by a failure: before the
    fix the job was accepted here and every rank failed after the spawn (exit 1)."""
    run, cache = saved
    here = str(tmp_path / "run")
    shutil.copytree(run, here)

    def started(*_a, **_k):
        raise AssertionError("a job resuming another model's checkpoint was accepted")

    monkeypatch.setattr(train_cli, "hydra_app", started)
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(_args(here, cache, f"train.steps={2 * SAVED}", "model.num_layers=3"))
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert err.splitlines() == [f"config error: train.resume=auto: checkpoint {here}/checkpoints/step_{SAVED:08d} "
                                f"holds another model (num_layers=4 there, 3 here): a layout may change on resume, the "
                                f"model's shape may not; resume it with its model, or start over in another "
                                f"train.out_dir"]


@pytest.mark.slow
@pytest.mark.extended  # the same two, in real processes: the tests above run them through the same functions
def test_the_cli_says_it_in_one_line_each(saved, tmp_path):
    """The two through the real command line: a stop before the checkpoint (exit 0, its line, nothing written) and
    a changed model (exit 2, one ``config error:`` line)."""
    run, cache = saved
    stop, other = str(tmp_path / "stop"), str(tmp_path / "other")
    shutil.copytree(run, stop)
    shutil.copytree(run, other)
    before = open(os.path.join(stop, "metrics.jsonl")).read()
    with ThreadPoolExecutor(2) as both:  # two processes at once: half the wall time
        stopped, refused = both.map(lambda args: run_to_end(args, timeout=300), [
            _args(stop, cache, f"train.steps={2 * SAVED}", f"train.stop_after={SAVED - 1}"),
            _args(other, cache, f"train.steps={2 * SAVED}", "model.num_layers=3")])
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert sum("nothing to do" in line for line in stopped.stdout.splitlines()) == 1, stopped.stdout[-2000:]
    assert open(os.path.join(stop, "metrics.jsonl")).read() == before
    proc = refused
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: train.resume=auto: checkpoint "), proc.stderr
    assert "num_layers=4 there, 3 here" in lines[0]
