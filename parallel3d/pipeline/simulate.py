"""Time a schedule on an idealised machine, and draw the result.

``simulate`` runs every stage's action list in order, all stages in parallel: a
computation takes its given time, a send costs the sender nothing and arrives
``p2p_time`` later, a receive waits for its message. It raises ``ScheduleError``
on a deadlock or on a receive that does not match the oldest message pending
between two stages, which is how ``validate_schedule`` proves a schedule safe.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from parallel3d.pipeline.actions import (
    Action,
    CostFn,
    Schedule,
    ScheduleError,
    schedule_shape,
    stage_and_chunk,
    virtual_stage,
)

@dataclass(frozen=True)
class TimedAction:
    stage: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """When each action of a simulated (or measured) step started and ended."""

    num_stages: int
    actions: list[TimedAction]
    busy: list[float]  # per stage: time spent in F and B
    makespan: float
    by_action: dict[tuple[int, Action], TimedAction] = field(default_factory=dict, repr=False)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step, averaged over stages."""
        if self.makespan <= 0:
            return 0.0
        return sum(1.0 - b / self.makespan for b in self.busy) / self.num_stages

    def start(self, stage: int, action: Action) -> float:
        return self.by_action[(stage, action)].start

    def end(self, stage: int, action: Action) -> float:
        return self.by_action[(stage, action)].end


def _as_cost(cost: CostFn, name: str) -> Callable[[int, int], float]:
    if callable(cost):
        return cost
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or cost < 0:
        raise ValueError(f"{name}={cost!r} must be a number >= 0 or a callable (stage, chunk) -> float")
    return lambda stage, chunk: float(cost)


def _message(kind: str, microbatch: int, from_virtual: int) -> tuple[str, int, int]:
    return ("act" if kind.endswith("ACT") else "grad", microbatch, from_virtual)


def simulate(schedule: Schedule, fwd_time: CostFn, bwd_time: CostFn, p2p_time: CostFn = 0) -> Timeline:
    """Run the schedule on an idealised machine: stages in parallel, actions of a stage in order.

    A computation takes ``fwd_time(stage, chunk)`` / ``bwd_time(stage, chunk)``; a send
    costs its stage nothing and its message arrives ``p2p_time`` later; a receive waits
    for its message. Raises ``ScheduleError`` on a deadlock or a receive that does not
    match the oldest pending send between the two stages.
    """
    fwd, bwd, lat = _as_cost(fwd_time, "fwd_time"), _as_cost(bwd_time, "bwd_time"), _as_cost(p2p_time, "p2p_time")
    p, _, v = schedule_shape(schedule)
    clock = [0.0] * p
    busy = [0.0] * p
    pos = [0] * p
    channels: dict[tuple[int, int], deque] = {}
    timed: list[TimedAction] = []
    runnable = deque(range(p))
    waiting: dict[tuple[int, int], int] = {}  # channel (from, to) -> the stage blocked on it
    while runnable:
        s = runnable.popleft()
        actions = schedule[s]
        while pos[s] < len(actions):
            a = actions[pos[s]]
            vs = virtual_stage(s, a.chunk, p)
            start = clock[s]
            if a.is_compute:
                cost = (fwd if a.kind == "F" else bwd)(s, a.chunk)
                clock[s] += cost
                busy[s] += cost
            elif a.kind.startswith("SEND"):
                peer, _ = stage_and_chunk(vs + 1 if a.kind == "SEND_ACT" else vs - 1, p)
                channels.setdefault((s, peer), deque()).append(
                    (_message(a.kind, a.microbatch, vs), clock[s] + lat(s, a.chunk))
                )
                if (s, peer) in waiting:
                    runnable.append(waiting.pop((s, peer)))
            else:
                src_vs = vs - 1 if a.kind == "RECV_ACT" else vs + 1
                peer, _ = stage_and_chunk(src_vs, p)
                queue = channels.get((peer, s))
                if not queue:
                    waiting[(peer, s)] = s  # blocked until the peer sends
                    break
                message, arrival = queue[0]
                expected = _message(a.kind, a.microbatch, src_vs)
                if message != expected:
                    raise ScheduleError(
                        f"stage {s} posts {a} expecting {expected} from stage {peer}, "
                        f"but the oldest pending message on that channel is {message}"
                    )
                queue.popleft()
                clock[s] = max(clock[s], arrival)
            timed.append(TimedAction(s, a, start, clock[s]))
            pos[s] += 1
    stuck = {s: str(schedule[s][pos[s]]) for s in range(p) if pos[s] < len(schedule[s])}
    if stuck:
        raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
    leftover = {k: [m for m, _ in q] for k, q in channels.items() if q}
    if leftover:
        raise ScheduleError(f"sends never received (channel (from, to) -> messages): {leftover}")
    makespan = max(clock) if clock else 0.0
    timeline = Timeline(p, timed, busy, makespan)
    timeline.by_action = {(t.stage, t.action): t for t in timed}
    return timeline


def format_timeline(timeline: Timeline, *, columns: int = 80) -> str:
    """A Gantt chart: one row per stage, ``F``/``B`` where it computes, ``.`` where it idles."""
    scale = columns / timeline.makespan if timeline.makespan > 0 else 1.0
    rows = [["."] * columns for _ in range(timeline.num_stages)]
    for t in timeline.actions:
        if not t.action.is_compute:
            continue
        for col in range(int(round(t.start * scale)), min(columns, int(round(t.end * scale)))):
            rows[t.stage][col] = t.action.kind if t.action.kind == "B" else "F"
    lines = [f"stage {s}: " + "".join(r) for s, r in enumerate(rows)]
    lines.append(f"makespan={timeline.makespan:g} bubble={timeline.bubble_fraction:.3f}")
    return "\n".join(lines)
