"""The vocabulary of pipeline schedules: actions, and where model chunks sit.

An ``Action`` is one step of one pipeline stage; a schedule is
``dict[stage, list[Action]]`` (see ``schedules``). With ``v`` virtual stages,
stage ``s`` holds model chunks ``s, s + p, ..., s + (v-1) p`` (Narayanan et al.
2021): ``virtual_stage`` / ``stage_and_chunk`` convert between the two views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

COMPUTE_KINDS = ("F", "B")
COMM_KINDS = ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")
ACTION_KINDS = COMPUTE_KINDS + COMM_KINDS
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b")

Schedule = dict[int, list["Action"]]
CostFn = Union[float, int, Callable[[int, int], float]]


class ScheduleError(ValueError):
    """A schedule that breaks the contract stated in ``parallel3d.pipeline.schedules``."""


@dataclass(frozen=True)
class Action:
    """One step of one stage: ``kind`` on ``microbatch`` for model chunk ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ScheduleError(f"Action.kind={self.kind!r} is not one of {ACTION_KINDS}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ScheduleError(f"{self!r}: microbatch and chunk must be >= 0")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def label(self, show_chunk: bool = False) -> str:
        short = {"SEND_ACT": "sa", "RECV_ACT": "ra", "SEND_GRAD": "sg", "RECV_GRAD": "rg"}.get(self.kind, self.kind)
        return f"{short}{self.microbatch}" + (f"c{self.chunk}" if show_chunk else "")


# ---- virtual-stage layout ------------------------------------------------------------
def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    """Position of (stage, chunk) along the model: chunk c of stage s is model chunk s + c*p."""
    return chunk * num_stages + stage


def stage_and_chunk(virtual: int, num_stages: int) -> tuple[int, int]:
    return virtual % num_stages, virtual // num_stages


def schedule_shape(schedule: Schedule) -> tuple[int, int, int]:
    """(num_stages, num_microbatches, num_virtual_stages) read off a schedule."""
    if not schedule:
        raise ScheduleError("empty schedule")
    actions = [a for acts in schedule.values() for a in acts]
    if not actions:
        raise ScheduleError("schedule has no actions")
    return len(schedule), 1 + max(a.microbatch for a in actions), 1 + max(a.chunk for a in actions)
