"""The vocabulary of pipeline schedules: actions, where model chunks sit, comm batches.

An ``Action`` is one step of one pipeline stage; a ``Schedule`` is
``{stage: [Action, ...]}`` (see ``schedules``) plus its ``placement``: which model
chunk each (stage, local chunk) runs (``placement.ChunkPlacement``; a plain dict is
read as the loop placement: with ``v`` chunks per stage, stage ``s`` holds model chunks
``s, s + p, ..., s + (v-1) p``, Narayanan et al. 2021; ``virtual_stage`` /
``stage_and_chunk`` convert for that placement). Computations: ``F`` forward, ``B``
backward; a schedule that also lists ``W`` splits each backward: ``B`` is then the
input gradient only and ``W`` the weight gradients (``backward_split``), for that
``B``'s microbatch and chunk only (``split_backwards``: a list may split some backwards, not all).

``comm_plan`` is the one place that decides how a stage's communication actions
are grouped into ``batch_isend_irecv`` batches: the engine executes its plan and
``simulate.check_coalesced_progress`` proves the same plan deadlock-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

from parallel3d.pipeline.placement import ChunkPlacement

COMPUTE_KINDS = ("F", "B", "W")  # W: weight gradients of a split backward (B then input grad only)
COMM_KINDS = ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")
SEND_KINDS = ("SEND_ACT", "SEND_GRAD")
RECV_KINDS = ("RECV_ACT", "RECV_GRAD")
ACTION_KINDS = COMPUTE_KINDS + COMM_KINDS

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


class Schedule(dict):
    """``{stage: [Action, ...]}`` with the ``placement`` of its model chunks (see the module doc)."""

    def __init__(self, actions: Mapping[int, list[Action]] | None = None, *,
                 placement: ChunkPlacement | None = None) -> None:
        super().__init__(actions or {})
        self.placement = placement


def placement_of(schedule: Mapping[int, list[Action]]) -> ChunkPlacement:
    """The schedule's placement; the loop placement for a plain dict (or a ``Schedule`` without one)."""
    placement = getattr(schedule, "placement", None)
    if placement is not None:
        return placement
    p, _, v = schedule_shape(schedule)
    return ChunkPlacement(p, v)


# ---- virtual-stage layout (loop placement) --------------------------------------------
def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    """Position of (stage, chunk) along the model: chunk c of stage s is model chunk s + c*p."""
    return chunk * num_stages + stage


def stage_and_chunk(virtual: int, num_stages: int) -> tuple[int, int]:
    return virtual % num_stages, virtual // num_stages


def splits_backward(actions: Sequence[Action]) -> bool:
    """Whether this action list runs split backwards (``B`` input grad, ``W`` weight grads)."""
    return any(a.kind == "W" for a in actions)


def split_backwards(actions: Sequence[Action]) -> frozenset[tuple[int, int]]:
    """The ``(microbatch, chunk)`` whose backward this action list splits: those with a ``W``.

    A stage may split only some of its backwards (``1f1b`` with ``split_drain``: the ones after its last
    forward); every consumer (simulator, engine, peak counts) asks per backward, not per stage.
    """
    return frozenset((a.microbatch, a.chunk) for a in actions if a.kind == "W")


def schedule_shape(schedule: Schedule) -> tuple[int, int, int]:
    """(num_stages, num_microbatches, num_virtual_stages) read off a schedule."""
    if not schedule:
        raise ScheduleError("empty schedule")
    actions = [a for acts in schedule.values() for a in acts]
    if not actions:
        raise ScheduleError("schedule has no actions")
    return len(schedule), 1 + max(a.microbatch for a in actions), 1 + max(a.chunk for a in actions)


# ---- communication batches ---------------------------------------------------------------
@dataclass(frozen=True)
class CommStep:
    """What a stage does with its communication just before ``compute`` (None: the step's end).

    In order: ``batch`` (the sends, then the receives ``compute`` needs that were not posted
    earlier) is posted as ONE ``batch_isend_irecv``; each receive of ``ahead`` is then posted
    as a batch of its own (it is used by a later computation: prefetch); then the stage waits
    for the batches holding ``needs`` (the receives ``compute`` reads) and computes.
    """

    batch: tuple[Action, ...]
    ahead: tuple[Action, ...]
    needs: tuple[Action, ...]
    compute: Action | None


def default_prefetch(coalesced: bool) -> int:
    """Receives the executors post ahead of need unless told (``prefetch_recvs``): 2 where each op progresses on
    its own (gloo), so their transfer overlaps compute; 0 where a rank's batches run as FIFO units (NCCL), where a
    receive posted ahead would stall every later batch of the rank, sends included."""
    return 0 if coalesced else 2


def comm_plan(actions: Sequence[Action], prefetch: int = 0) -> list[CommStep]:
    """Group one stage's actions into ``CommStep``s: the comm actions between two computations.

    Invariants: receives are posted in schedule order (each peer's messages match first in,
    first out); at most ``prefetch`` receives are posted ahead of the ones needed now, and
    only at steps that communicate anyway; with ``prefetch=0`` every batch holds exactly the
    comm actions the schedule lists between two computations. A ``W`` waits for no receive: those
    of the batch posted before it are the next ``F``'s or ``B``'s ``needs`` (the split drain's ``W``
    opens an iteration of interleaved 1F1B's coalesced batches: ``schedules._iterations``).
    """
    recv_order = [a for a in actions if a.kind in RECV_KINDS]
    index = {a: i for i, a in enumerate(recv_order)}
    steps: list[CommStep] = []
    pending: list[Action] = []
    deferred: list[Action] = []  # receives a W's batch posted: the next F or B waits for them
    posted = consumed = 0  # recv_order[:posted] are posted, recv_order[:consumed] needed so far

    def step(compute: Action | None) -> None:
        nonlocal posted, consumed
        waits_here = compute is None or compute.kind != "W"  # a W reads no message
        if not pending:
            steps.append(CommStep((), (), tuple(deferred) if waits_here else (), compute))
            if waits_here:
                deferred.clear()
            return
        sends = tuple(a for a in pending if a.kind in SEND_KINDS)
        needs = tuple(a for a in pending if a.kind in RECV_KINDS)
        consumed = max([index[a] + 1 for a in needs], default=consumed)
        now = tuple(recv_order[posted:consumed])  # needed now, not posted ahead earlier
        horizon = max(posted, consumed + prefetch)
        ahead = tuple(recv_order[max(posted, consumed):horizon])
        posted = horizon
        deferred.extend(needs)
        steps.append(CommStep(sends + now, ahead, tuple(deferred) if waits_here else (), compute))
        if waits_here:
            deferred.clear()
        pending.clear()

    for a in actions:
        if a.is_compute:
            step(a)
        else:
            pending.append(a)
    step(None)
    return steps
