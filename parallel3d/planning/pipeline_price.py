"""A pipeline schedule's step, priced by the same simulator that checks the runtime schedules.

Invariant: ``simulate_pipeline(name, p, m, v, fwd, bwd, p2p)`` equals ``simulate`` of
``build_schedule(name, p, m, v)`` (exactly for m <= 3p, by linear extension in m beyond it, which
is exact once every stage is in its steady state); ``fwd``/``bwd`` are per-(stage, chunk) times
in seconds and ``p2p`` one message's time. Schedules added to the runtime are priced without new
formulas. ``pipeline_lower_bound`` never exceeds the simulation, stage by stage (the planner's
pre-ranking relies on it to simulate only what can reach its top).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from parallel3d.pipeline.actions import splits_backward
from parallel3d.pipeline.placement import placement_for
from parallel3d.pipeline.schedules import build_schedule, simulate
from parallel3d.planning.schedule_cache import ScheduleCache


@dataclass(frozen=True)
class PipelineTimes:
    makespan: float
    stage_end: list[float]  # when each stage's last computation ends
    busy: list[float]  # per stage: time spent computing
    # Per stage and local chunk: when its last backward (B or W) ends, after which that chunk's gradients
    # are complete and its data-parallel reduction can finish; and when its first forward starts, counted
    # from the stage's first computation, before which its parameters must be gathered. Empty: not known.
    chunk_grads_done: list[list[float]] = field(default_factory=list)
    chunk_first_forward: list[list[float]] = field(default_factory=list)
    # True: a lower bound (``pipeline_lower_bound``), each time at most what a simulation gives; the chunk
    # timings are not known, so what overlaps the DP traffic can only be bounded (``cost.estimate_step``).
    bound: bool = False

    @property
    def bubble_fraction(self) -> float:
        return sum(1 - b / self.makespan for b in self.busy) / len(self.busy) if self.makespan > 0 else 0.0


def _simulate_once(name: str, p: int, m: int, v: int, fwd, bwd, p2p, w_lags=None, split_drain: bool = False,
                   schedules: ScheduleCache | None = None) -> PipelineTimes:
    built = ScheduleCache.of(schedules).build(name, p, m, v, w_lags=w_lags, split_drain=split_drain)
    timeline = simulate(built, fwd, bwd, p2p)
    end = [0.0] * p
    first = [float("inf")] * p
    grads = [[0.0] * v for _ in range(p)]
    starts = [[float("inf")] * v for _ in range(p)]
    for ta in timeline.actions:
        if ta.action.is_compute:
            s, c = ta.stage, ta.action.chunk
            end[s] = max(end[s], ta.end)
            first[s] = min(first[s], ta.start)
            if ta.action.kind == "F":
                starts[s][c] = min(starts[s][c], ta.start)
            else:
                grads[s][c] = max(grads[s][c], ta.end)
    starts = [[t - first[s] for t in row] for s, row in enumerate(starts)]
    return PipelineTimes(timeline.makespan, end, list(timeline.busy), grads, starts)


def simulate_pipeline(name: str, p: int, m: int, v: int, fwd, bwd, p2p,
                      w_lags: tuple[int, ...] | None = None, split_drain: bool = False,
                      schedules: ScheduleCache | None = None) -> PipelineTimes:
    """Simulated step of schedule ``name``; long runs are extrapolated from short ones.
    ``w_lags``: zb_h1's (``build_schedule``; the same at every m >= p, ``planning.zb_lags``); ``split_drain``:
    1f1b's (``build_schedule``; a split drain ``W`` takes half the backward, ``simulate``'s default).
    ``schedules``: the search's built schedules (a search prices the same (p, m, v) for many layouts).

    Once every stage is in its steady state, each further group of p microbatches (interleaved 1F1B's
    count must stay a multiple of p) adds the same time to every stage, so finish times are linear in
    m: simulate m = 2p, 3p, 4p, check that the two steps add the same (``_same_steps``), and extend the line
    (exact for these schedules; tests compare it with a full simulation). Unequal chunks can keep a
    stage's queue settling past 2p (interleaved 1F1B at p = 2 with a light last chunk still sped up at
    4 -> 6 microbatches, and a line through m = 2p and 3p put the stage's end below its own busy time),
    so while the steps differ the window moves up by p, up to a full simulation at m. Keeps
    1T-scale layouts (p = 64, m = 512) to seconds.
    """
    schedules = ScheduleCache.of(schedules)
    # Priced once per distinct input in a search: settings that differ only where the pipeline does not
    # look (ZeRO stage, offload) give the same per-chunk times. The key holds every value the simulation reads.
    fwd, bwd, p2p = _table(fwd, p, v), _table(bwd, p, v), _table(p2p, p, v)
    key = (name, p, m, v, None if w_lags is None else tuple(w_lags), split_drain, fwd, bwd, p2p)
    return schedules.priced(key, lambda: _simulate_pipeline(name, p, m, v, _read(fwd), _read(bwd), _read(p2p),
                                                            w_lags, split_drain, schedules))


def _table(cost, p: int, v: int):
    """A per-(stage, chunk) cost as a hashable value: a number as it is, a callable as its table of values."""
    return tuple(tuple(cost(s, c) for c in range(v)) for s in range(p)) if callable(cost) else cost


def _read(table):
    """``_table``'s value back as a cost the simulator takes (the same numbers)."""
    return (lambda s, c: table[s][c]) if isinstance(table, tuple) else table


def _simulate_pipeline(name: str, p: int, m: int, v: int, fwd, bwd, p2p, w_lags, split_drain: bool,
                       schedules: ScheduleCache) -> PipelineTimes:
    """``simulate_pipeline`` without the memo."""
    step = p  # interleaved 1F1B needs whole groups of p; the others reach steady state by 2p or so
    base = 2 * p
    a = b = None
    while 3 * (base + step) < m:  # while three short runs cost less than the whole one
        a = a or _simulate_once(name, p, base, v, fwd, bwd, p2p, w_lags, split_drain, schedules)
        b = b or _simulate_once(name, p, base + step, v, fwd, bwd, p2p, w_lags, split_drain, schedules)
        c = _simulate_once(name, p, base + 2 * step, v, fwd, bwd, p2p, w_lags, split_drain, schedules)
        if _same_steps(a, b, c):
            return _extend(a, b, (m - base) / step, m / base)
        a, b, base = b, c, base + step
    return _simulate_once(name, p, m, v, fwd, bwd, p2p, w_lags, split_drain, schedules)


def _ends(t: PipelineTimes) -> list[float]:
    return [t.makespan, *t.stage_end, *(x for row in t.chunk_grads_done for x in row)]


def _same_steps(a: PipelineTimes, b: PipelineTimes, c: PipelineTimes) -> bool:
    """Whether a -> b -> c is the steady state: both steps add the same time to every finish time, and
    that time covers the work a step adds to the busiest stage (a step that adds less is still filling
    idle time left by the warm-up, and a later step will add more)."""
    tol = 1e-9 * c.makespan
    same = all(abs((z - y) - (y - x)) <= tol for x, y, z in zip(_ends(a), _ends(b), _ends(c)))
    return same and c.makespan - b.makespan >= max(z - y for y, z in zip(b.busy, c.busy)) - tol


def _extend(a: PipelineTimes, b: PipelineTimes, k: float, busy_scale: float) -> PipelineTimes:
    """The line through ``a`` and ``b`` (one step of p microbatches apart), ``k`` steps from ``a``."""

    def line(x: float, y: float) -> float:
        return x + (y - x) * k

    # The last backwards are in the cool-down, linear in m like the stage ends; the first forwards are in
    # the warm-up, which more microbatches do not change.
    return PipelineTimes(
        line(a.makespan, b.makespan),
        [line(x, y) for x, y in zip(a.stage_end, b.stage_end)],
        [x * busy_scale for x in a.busy],
        [[line(x, y) for x, y in zip(ra, rb)] for ra, rb in zip(a.chunk_grads_done, b.chunk_grads_done)],
        a.chunk_first_forward,
    )


@lru_cache(maxsize=64)
def _splits_every_backward(name: str, v: int) -> bool:
    """Whether schedule ``name`` at ``v`` chunks splits its backwards (read off a 2-stage, 2-microbatch build).
    Cached: ``plan`` bounds every fitting setting, and a validated build per bound was a tenth of a search
    (session 46 profile of the 175B search in ``tests/test_planning_published.py``)."""
    return splits_backward(build_schedule(name, 2, 2, v)[0])


def pipeline_lower_bound(name: str, p: int, m: int, v: int, fwd, bwd, p2p, split_drain: bool = False) -> PipelineTimes:
    """What no run of schedule ``name`` can beat, per stage, with ``simulate_pipeline``'s arguments:
    ``stage_end[s]`` and ``makespan`` are at most the simulated ones, ``busy`` is exact.

    Why it holds for every schedule the runtime builds (each stage runs a chunk's forwards, and its
    backwards, in microbatch order; a message takes ``p2p``, between two stages only):
    - stage s starts computing after microbatch 0 has run forward through every model chunk before
      its first one (``head``), and then computes ``busy[s]``;
    - its backward of the last microbatch on its first chunk (its last ``B``) comes after all of its
      forwards and ``B``s (``W``s, where the schedule splits them off, may come later), and that
      ``B`` on stage s follows the one on stage s + 1 by a message and its own ``B``; a stage whose
      schedule splits backwards still runs that last ``B``'s ``W`` after it.
    For uniform chunks and 1F1B or interleaved 1F1B this is the closed form
    ``(v m + p - 1)(f + b) / v + 2 (p - 1) p2p``. ``split_drain`` (1f1b, interleaved): every stage but the first
    splits its last ``B``, so that ``B`` costs the stage upstream half a backward and its ``W`` follows it. No chunk timings: ``bound`` tells the step price to
    bound the exposed DP traffic instead of deriving it from them.
    """
    lat = float(p2p) if isinstance(p2p, (int, float)) else 0.0
    split = p > 1 and _splits_every_backward(name, v)
    drain = p > 1 and split_drain and not split
    place = placement_for(name, p, p * v)
    order = [place.stage_and_chunk(k) for k in range(p * v)]  # model chunks in forward order

    def tail(s: int, c: int) -> float:  # the W after a stage's last B (split_drain: not on the first model chunk)
        return bwd(s, c) / 2 if split or (drain and place.model_chunk(s, c) > 0) else 0.0

    def b_in(s: int, c: int) -> float:  # the part of a backward the previous stage waits on
        return bwd(s, c) - tail(s, c)

    busy = [m * sum(fwd(s, c) + bwd(s, c) for c in range(v)) for s in range(p)]
    head, t = [0.0] * p, 0.0
    seen: set[int] = set()
    for k, (s, c) in enumerate(order):
        if s not in seen:
            seen.add(s)
            head[s] = t
        t += fwd(s, c) + (lat if k + 1 < len(order) and order[k + 1][0] != s else 0.0)
    # last_b[s]: the earliest end of stage s's last B (the first model chunk it holds, last microbatch)
    first_chunk = {s: c for s, c in reversed(order)}
    last_b = [head[s] + m * sum(fwd(s, c) + (b_in(s, c) if split else bwd(s, c)) for c in range(v))
              - (0.0 if split else tail(s, first_chunk[s])) for s in range(p)]
    by_first = sorted(range(p), key=lambda s: place.model_chunk(s, first_chunk[s]))
    for i in range(len(by_first) - 2, -1, -1):  # the backward runs the chunks in reverse model order
        s, nxt = by_first[i], by_first[i + 1]
        last_b[s] = max(last_b[s], last_b[nxt] + lat + b_in(s, first_chunk[s]))
    end = [max(head[s] + busy[s], last_b[s] + tail(s, first_chunk[s])) for s in range(p)]
    return PipelineTimes(max(end), end, busy, bound=True)
