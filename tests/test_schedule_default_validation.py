"""What runs is validated by default (session 46 review, item 2): ``build_schedule``'s default, and so the
``PipelineEngine``'s construction, catches a generator's broken output. Before this test, flipping the default to
``validate=False`` left every schedule test green (they build correct schedules, so validation never had anything to
catch on the default path).

Each schedule's generator is broken the same way (stage 0 repeats its first computation at its end); the reference
that the output is broken is ``validate_schedule`` itself, called explicitly on the unvalidated build.
"""

from __future__ import annotations

import pytest
import torch

from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline import schedules
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.options import SCHEDULES
from parallel3d.pipeline.schedules import ScheduleError, build_schedule, validate_schedule

VIRTUAL = {"interleaved_1f1b": 2, "zbv": 2}  # the others run one chunk per stage
P, M = 2, 4


@pytest.fixture
def broken(monkeypatch) -> None:
    """Stage 0 of every generator repeats its first computation at its end (zbv: its first action)."""
    order, zbv = schedules.stage_compute_order, schedules.zbv_schedule

    def repeating_order(name, stage, *args, **kwargs):
        out = list(order(name, stage, *args, **kwargs))
        return out + out[:1] if stage == 0 else out

    def repeating_zbv(*args, **kwargs):
        built = zbv(*args, **kwargs)
        built[0] = list(built[0]) + list(built[0])[:1]
        return built

    monkeypatch.setattr(schedules, "stage_compute_order", repeating_order)
    monkeypatch.setattr(schedules, "zbv_schedule", repeating_zbv)


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_default_build_refuses_a_broken_generator_output(broken, name):
    v = VIRTUAL.get(name, 1)
    unchecked = build_schedule(name, P, M, v, validate=False)
    with pytest.raises(ScheduleError):  # the reference: the output is broken
        validate_schedule(unchecked, num_microbatches=M, num_virtual_stages=v)
    with pytest.raises(ScheduleError, match="repeats the action"):
        build_schedule(name, P, M, v)


def test_the_engine_refuses_a_broken_generator_output(broken):
    """The engine's own call (one stage, one process: nothing else in its constructor would notice)."""
    with pytest.raises(ScheduleError, match="repeats the action"):
        PipelineEngine([torch.nn.Linear(4, 4)], ParallelState.single_process(), schedule="1f1b", num_microbatches=M,
                       micro_batch_size=1, seq_len=4, hidden_size=4)
