"""``bench_pipeline.py``'s bubble: the measured one and ``simulate``'s, defined alike.

``simulate`` starts every stage at 0 on a core of its own; a stage is busy while it computes,
and its bubble is its idle share of the makespan (the last computation's end on any stage),
averaged over stages. The measured bubble here is the same quantity on the ranks' real
timelines, and the simulator is fed what the ranks really spend:

* window: from a rank's step start (after a barrier; ``StepResult.start_time`` is a
  system-wide monotonic clock, so ranks share one axis) to the last computation's end on any
  rank. What follows (``wait_sends``, the gradient finalisation, the loss) is no part of a
  schedule's bubble; it is reported as the step's ``after_schedule_share``, not hidden.
* idle: the rank's blocked p2p waits inside the schedule (``schedule_wait_time``) plus the time
  from its own last computation to the window's end. Everything else on the rank's timeline is
  work: its computations and the executor's own time (posting, bookkeeping).
* simulator feed, per stage and chunk: the mean measured F, B, W, each plus that stage's
  executor time per computation (serial with its computations on the rank's timeline); messages
  at the measured message latency (``sim``: from a send's post to a blocked receiver waking, less
  the post's own cost, which the executor time already holds; not an exchange's wall time, which
  counts both ends' posting and waiting a second time) or free (``sim0``). Mean, not median, so that a stage's
  simulated work equals its measured work: the two bubbles then differ only by waiting.

The mean-fed simulator assumes every microbatch costs the mean; ``replay`` feeds it each
computation's own measured duration (plus the stage's executor time per computation), step by
step: where replay and measured agree but the mean-fed ``sim`` does not, the gap is the
variation of the costs (a schedule with little slack passes it on as waiting), not a
difference of definitions.

Time-sharing: with more ranks than cores (pp 4 on 2 cores, or other users' load) a rank blocked
in a wait is not idle hardware (another rank computes on that core) and a computation's wall
span includes waiting for a core, so the wall-clock bubble is no measure of the schedule. The
ranks' own clocks tell: ``core_share``, the computations' thread CPU time over their wall time
(the least over stages), is about 1 on a core of one's own. Where ranks outnumber cores or
``core_share < CORE_SHARE_MIN`` the measured bubble is not reported (None; the time-shared value
stays in the JSON, labelled), and ``sim_cpu`` feeds the simulator the computations' and the
executor's thread CPU times: the bubble the schedule would have with a core per rank.
"""

from __future__ import annotations

import statistics
from typing import Callable

# Per stage, per measured step: (start_time, own last computation's end relative to start,
# schedule_wait_time, number of computations, busy seconds, step seconds).
StepTimes = tuple[float, float, float, int, float, float]

CORE_SHARE_MIN = 0.9  # below: the ranks' computations waited for a core (module doc)


def window_bubble(step: list[StepTimes]) -> float:
    """One step's measured bubble: per rank, idle (waits inside the schedule, plus the time from its
    last computation to the last one on any rank) over its window, averaged over ranks."""
    end = max(start + own_end for start, own_end, *_ in step)
    shares = []
    for start, own_end, waited, *_ in step:
        window = end - start
        shares.append((window - own_end + waited) / window if window > 0 else 0.0)
    return statistics.fmean(shares)


def whole_step_bubble(step: list[StepTimes]) -> float:
    """The former definition, kept for comparison: 1 - computing / the slowest rank's whole step
    (the executor's own time and everything after the schedule counted as bubble)."""
    longest = max(st for *_, st in step)
    return statistics.fmean(1.0 - busy / longest for *_, busy, _ in step)


def executor_per_compute(step: StepTimes) -> float:
    """A rank's executor time inside the schedule per computation: neither computing nor waiting."""
    _, own_end, waited, n, busy, _ = step
    return max(0.0, own_end - busy - waited) / max(n, 1)


def fed_costs(compute: dict[tuple[int, str, int], float], overhead: dict[int, float]) -> tuple[Callable, ...]:
    """(fwd, bwd, wgrad) cost functions for ``simulate`` from per (stage, kind, chunk) mean times plus
    each stage's per-computation overhead (a split backward's B and W each carry one)."""
    def wgt(st: int, c: int) -> float:
        return compute[(st, "W", c)] + overhead[st] if (st, "W", c) in compute else 0.0

    def fwd(st: int, c: int) -> float:
        return compute[(st, "F", c)] + overhead[st]

    def bwd(st: int, c: int) -> float:  # a whole backward: B, plus W where the schedule splits it
        return compute[(st, "B", c)] + overhead[st] + wgt(st, c)

    return fwd, bwd, wgt


def simulated_bubbles(rank_stats: list, name: str, p: int, m: int, msg_s: float,
                      oversubscribed: bool) -> dict[str, float | None]:
    """For our system ``name`` in one round: the measured bubble (window definition; None when
    time-shared: ``oversubscribed`` (ranks > cores) or ``core_share`` low), the former whole-step
    one, and ``simulate``'s fed with the measured costs (wall: with and without message time; CPU:
    a core per rank; ``replay``: each computation's own duration, with message time)."""
    from parallel3d.pipeline.schedules import build_schedule, simulate

    per_stage = {st: ours[name] for st, ours, *_ in rank_stats}
    schedule = build_schedule(per_stage[0]["schedule"], p, m, per_stage[0]["virtual_stages"],
                              w_lags=per_stage[0].get("w_lags"))  # the schedule the engine ran
    steps = [list(step) for step in zip(*(o["step_times"] for o in per_stage.values()))]
    wall = {(st, kind, c): t for st, o in per_stage.items() for (kind, c), t in o["compute"].items()}
    cpu = {(st, kind, c): t for st, o in per_stage.items() for (kind, c), t in o["compute_cpu"].items()}
    overhead = {st: statistics.fmean(executor_per_compute(x) for x in o["step_times"])
                for st, o in per_stage.items()}
    overhead_cpu = {st: statistics.fmean(o["executor_cpu_per_compute"]) for st, o in per_stage.items()}
    fwd, bwd, wgt = fed_costs(wall, overhead)
    cfwd, cbwd, cwgt = fed_costs(cpu, overhead_cpu)
    measured = statistics.median(window_bubble(s) for s in steps)
    replays = []
    for i in range(len(steps)):
        def own(st: int, a, i: int = i) -> float:
            return per_stage[st]["action_s"][i][(a.kind, a.microbatch, a.chunk)] + overhead[st]
        replays.append(simulate(schedule, 0.0, 0.0, p2p_time=msg_s, action_time=own).bubble_fraction)
    core_share = min(sum(t for (st, _, _), t in cpu.items() if st == stage) /
                     sum(t for (st, _, _), t in wall.items() if st == stage) for stage in per_stage)
    return {
        "measured": None if oversubscribed or core_share < CORE_SHARE_MIN else measured,
        "core_share": core_share,
        "measured_time_shared": measured,
        "measured_whole_step": statistics.median(whole_step_bubble(s) for s in steps),
        "sim": simulate(schedule, fwd, bwd, p2p_time=msg_s, wgrad_time=wgt).bubble_fraction,
        "sim0": simulate(schedule, fwd, bwd, wgrad_time=wgt).bubble_fraction,
        "sim_cpu": simulate(schedule, cfwd, cbwd, wgrad_time=cwgt).bubble_fraction,
        "replay": statistics.median(replays),
    }
