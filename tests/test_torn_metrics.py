"""A run killed in the middle of writing a ``metrics.jsonl`` line (SIGKILL, a full disk, a lost node).

Its checkpoint is intact, so ``train.resume=auto`` must go on: the resume used to fail on every try with a
bare ``JSONDecodeError`` from re-reading the file, and ``python -m parallel3d.report`` refused to draw it.
Reference: the same run uninterrupted (a resume gives bit-identical losses at the same layout).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

from parallel3d import report
from parallel3d.checkpoint import step_dir
from parallel3d.faults import ENV as FAULT_ENV
from parallel3d.jsonl_records import read_records
from parallel3d.config import job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.metrics import JsonlSink
from parallel3d.trainer import train

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")

TORN_TAILS = {"cut short": lambda line: line[: len(line) // 2], "zero bytes": lambda line: "\x00" * 64}


def _train(out: str, cache: str) -> None:
    values = {"train": {"steps": 4, "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 32, "device": "cpu",
                        "out_dir": out, "save_every": 2, "async_save": False, "eval_iters": 0},
              "optimizer": {"warmup_steps": 1}, "data": {"cache_dir": cache, "valid_fraction": 0.0},
              "logging": {"log_every": 1}}
    train(resolve(job_from_dict(values, model="gpt_tiny"), 1), ParallelState.single_process())


def _lines(run_dir: str) -> list[str]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return fh.readlines()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("torn")
    _train(str(root / "run"), str(root / "cache"))
    return str(root / "run"), str(root / "cache")


def _killed_during_step_4s_write(uninterrupted: tuple[str, str], tmp_path, tail: str) -> tuple[str, list[str]]:
    """A copy of the run as a kill while writing step 4's record would leave it: no step-4 checkpoint,
    records 1-3 whole, step 4's line torn."""
    run, _ = uninterrupted
    killed = str(tmp_path / "killed")
    shutil.copytree(run, killed)
    shutil.rmtree(step_dir(os.path.join(killed, "checkpoints"), 4))
    lines = _lines(run)
    with open(os.path.join(killed, "metrics.jsonl"), "w") as fh:
        fh.writelines(lines[:3])
        fh.write(TORN_TAILS[tail](lines[3]))
    return killed, lines


@pytest.mark.parametrize("tail", TORN_TAILS)
def test_a_run_killed_mid_write_resumes_with_the_uninterrupted_losses(uninterrupted, tmp_path, tail):
    killed, want = _killed_during_step_4s_write(uninterrupted, tmp_path, tail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(killed, uninterrupted[1])  # resumes from step 2
    assert any("skipped 1 line(s) that are not a JSON record (line 4" in str(w.message) for w in caught)
    got = [json.loads(line) for line in _lines(killed)]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["loss"] for r in got] == [json.loads(line)["loss"] for line in want]


def test_the_report_draws_a_file_with_a_torn_last_line(uninterrupted, tmp_path, capsys):
    killed, want = _killed_during_step_4s_write(uninterrupted, tmp_path, "cut short")
    records = report.read_records(killed)
    assert records == [json.loads(line) for line in want[:3]]
    assert "skipped 1 line(s)" in capsys.readouterr().err
    assert report.main([killed, "--format", "html"]) == 0


def test_a_resume_whose_rewrite_fails_keeps_the_whole_history(uninterrupted, tmp_path, monkeypatch):
    """A resume rewrites metrics.jsonl without the records after its checkpoint; a full disk during that
    rewrite (``P3D_FAULT``'s ENOSPC) fails the resume, but must not leave the file truncated."""
    run, _ = uninterrupted
    path = str(tmp_path / "metrics.jsonl")
    shutil.copy(os.path.join(run, "metrics.jsonl"), path)
    before = _lines(str(tmp_path))
    monkeypatch.setenv(FAULT_ENV, "metrics.rewrite@*")
    with pytest.raises(OSError, match="No space left"):
        JsonlSink(path, keep_through_step=2)
    assert _lines(str(tmp_path)) == before and len(before) == 4
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # nothing left beside it


def test_a_torn_line_in_the_middle_costs_only_itself(uninterrupted, tmp_path):
    """A line cut short between whole ones (a crashed node's lost page, then later writes) is skipped and named;
    the records after it are read, not lost."""
    lines = _lines(uninterrupted[0])
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as fh:
        fh.writelines([lines[0], lines[1][:40] + "\n", "\x00" * 16 + "\n", *lines[2:]])
    records, bad = read_records(path)
    assert records == [json.loads(line) for line in (lines[0], *lines[2:])] and bad == [2, 3]
