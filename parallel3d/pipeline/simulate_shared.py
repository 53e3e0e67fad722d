"""Time a schedule on a machine with fewer cores than stages: processor sharing.

``simulate`` gives every stage a core of its own. ``simulate_shared(..., cores=C)`` runs the
same schedule under the same dependency rules (``simulate.ScheduleReplay``: costs, sends,
FIFO receives, deadlock checks) on ``C`` cores shared by all stages: a stage is *runnable*
while it computes, and with ``r`` runnable stages each progresses at rate ``min(1, C / r)``
(ideal processor sharing, the limit of a fair time-slicing scheduler). A stage blocked on a
receive, or done, is not runnable and uses no core. Sends and receives take no core time;
a message arrives ``p2p_time`` after its send, as in ``simulate``.

Event-driven: between two events (a computation finishing, a message arriving) every rate is
constant. A computation's rate is re-read only when it changes, so with ``C`` >= stages (every
rate 1) each computation ends at exactly start + cost and the result is ``simulate``'s,
bit for bit. ``Timeline.busy`` is each stage's wall time runnable (computing or waiting for
a core), so ``bubble_fraction`` is the share of the step a stage is blocked or finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from parallel3d.pipeline.actions import Action, CostFn, Schedule
from parallel3d.pipeline.simulate import ScheduleReplay, TimedAction, Timeline, make_timeline, simulate


@dataclass
class _Running:
    """A computation in progress: since ``since`` it has ``left`` work to do at ``rate``."""

    action: Action
    start: float
    since: float
    left: float
    rate: float

    @property
    def finish(self) -> float:
        return self.since + self.left / self.rate


def _check_cores(cores: float) -> None:
    if isinstance(cores, bool) or not isinstance(cores, (int, float)) or not cores > 0:
        raise ValueError(f"cores={cores!r} must be a number > 0 (or None: a core per stage)")


def simulate_shared(schedule: Schedule, fwd_time: CostFn, bwd_time: CostFn, p2p_time: CostFn = 0,
                    wgrad_time: CostFn | None = None,
                    action_time: Callable[[int, Action], float] | None = None, *,
                    cores: float | None = None) -> Timeline:
    """``simulate``'s arguments and result, with the stages sharing ``cores`` cores (module doc).

    A computation's cost is its work in core-seconds; its span in the timeline is longer where it
    shared a core. ``cores=None``: a core per stage, ``simulate`` itself.
    """
    if cores is None:
        return simulate(schedule, fwd_time, bwd_time, p2p_time, wgrad_time, action_time)
    _check_cores(cores)
    run = ScheduleReplay(schedule, fwd_time, bwd_time, p2p_time, wgrad_time, action_time)
    p = run.p
    busy = [0.0] * p
    ends = [0.0] * p  # when each stage's last completed action ended: when it reached its current one
    timed: list[TimedAction] = []
    running: dict[int, _Running] = {}
    arriving: dict[int, tuple[float, Action, float]] = {}  # stage -> (arrival, its receive, wait began)
    ready = deque(range(p))
    now = 0.0
    while True:
        while ready:  # zero-time actions at ``now``, up to each stage's next computation or block
            s = ready.popleft()
            while (a := run.next_action(s)) is not None:
                if a.is_compute:
                    running[s] = _Running(a, now, now, run.cost(s, a), 0.0)  # rate set below
                    break
                if a.kind.startswith("SEND"):
                    woken = run.send(s, a, now)
                    if woken is not None:
                        ready.append(woken)
                else:
                    arrival = run.receive(s, a)
                    if arrival is None:
                        break  # the peer has not sent yet: its send wakes this stage
                    if arrival > now:  # sent, still in flight: the stage blocks until it lands
                        arriving[s] = (arrival, a, ends[s])
                        break
                timed.append(TimedAction(s, a, ends[s], now))  # a receive began where the stage reached it
                ends[s] = now
                run.advance(s)
        if not running and not arriving:
            break
        rate = 1.0 if len(running) <= cores else cores / len(running)
        for s, job in running.items():
            if job.rate != rate:  # a new segment: what the old rate did so far counts as runnable time
                if job.rate > 0:
                    busy[s] += now - job.since
                    job.left = max(0.0, job.left - (now - job.since) * job.rate)
                job.since, job.rate = now, rate
        now = min([job.finish for job in running.values()] + [t for t, _, _ in arriving.values()])
        for s in [s for s, job in running.items() if job.finish == now]:
            job = running.pop(s)
            busy[s] += job.left / job.rate  # the last segment's span, by construction
            timed.append(TimedAction(s, job.action, job.start, now))
            ends[s] = now
            run.advance(s)
            ready.append(s)
        for s in [s for s, (t, _, _) in arriving.items() if t == now]:
            _, a, began = arriving.pop(s)
            timed.append(TimedAction(s, a, began, now))
            ends[s] = now
            run.advance(s)
            ready.append(s)
    run.finish()
    return make_timeline(p, timed, busy, ends)
