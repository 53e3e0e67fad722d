"""A resume that changes the learning-rate schedule warns once, naming each changed key and the next step's lr
under both schedules (``parallel3d/resume_notes.py``); an unchanged one does not. Session 43: such a resume was
silent (Megatron-LM refuses it without --override-opt_param-scheduler)."""

from __future__ import annotations

import re
import warnings

import pytest

from parallel3d.config import job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.trainer import train
from parallel3d.user_warnings import RunWarning
from tests.test_train_e2e import job_values

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")


def _train(values: dict):
    rj = resolve(job_from_dict(values, model="gpt_tiny"), 1)
    # the resolved config meta.json records; these overrides carry every schedule key
    return train(rj, ParallelState.single_process(), full_config=values)


def _schedule_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RunWarning) and "learning-rate schedule" in str(w.message)]


def test_a_changed_schedule_on_resume_is_named_with_the_lr_it_gives(tmp_path):
    out, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    first = job_values(out, cache, train={"steps": 4})
    _train(first)
    with warnings.catch_warnings(record=True) as caught:  # the same schedule: nothing to say
        warnings.simplefilter("always")
        _train(first)
    assert _schedule_warnings(caught) == []
    changed = job_values(out, cache, train={"steps": 6}, optimizer={"lr": 1e-3})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _train(changed)
    notes = _schedule_warnings(caught)
    assert len(notes) == 1, notes
    assert "optimizer.lr 0.003 -> 0.001" in notes[0] and "train.steps 4 -> 6" in notes[0], notes[0]
    after, before = map(float, re.search(r"next step's lr is (\S+) where the checkpoint's schedule gives (\S+);",
                                         notes[0]).groups())
    logged = {r["step"]: r["lr"] for r in result.records}
    assert after == pytest.approx(logged[5], rel=1e-2)  # what step 5 then trained with
    # the checkpoint's schedule ended at its train.steps = 4: from there it stays at min_lr
    assert before == pytest.approx(first["optimizer"]["min_lr"], rel=1e-2)
