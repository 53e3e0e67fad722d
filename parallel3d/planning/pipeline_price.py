"""A pipeline schedule's step, priced by the same simulator that checks the runtime schedules.

Invariant: ``simulate_pipeline(name, p, m, v, fwd, bwd, p2p)`` equals ``simulate`` of
``build_schedule(name, p, m, v)`` (exactly for m <= 3p, by linear extension in m beyond it, which
is exact once every stage is in its steady state); ``fwd``/``bwd`` are per-(stage, chunk) times
in seconds and ``p2p`` one message's time. Schedules added to the runtime are priced without new
formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel3d.pipeline.schedules import build_schedule, simulate


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

    @property
    def bubble_fraction(self) -> float:
        return sum(1 - b / self.makespan for b in self.busy) / len(self.busy) if self.makespan > 0 else 0.0


def _simulate_once(name: str, p: int, m: int, v: int, fwd, bwd, p2p, w_lags=None) -> PipelineTimes:
    timeline = simulate(build_schedule(name, p, m, v, w_lags=w_lags), fwd, bwd, p2p)
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
                      w_lags: tuple[int, ...] | None = None) -> PipelineTimes:
    """Simulated step of schedule ``name``; long runs are extrapolated from two short ones.
    ``w_lags``: zb_h1's (``build_schedule``; the same at every m >= p, ``planning.zb_lags``).

    Once every stage is in its steady state (m >= 2p covers every schedule, ZB-V's V included),
    each further group of p microbatches (interleaved 1F1B's count must stay a multiple of p)
    adds the same time to every stage, so finish times are linear in m: simulate m = 2p and
    3p and extend the line
    (exact for these schedules; tests compare it with a full simulation). Keeps
    1T-scale layouts (p = 64, m = 512) to seconds.
    """
    step = p  # interleaved 1F1B needs whole groups of p; the others reach steady state by 2p
    base = 2 * p
    if m <= base + step:
        return _simulate_once(name, p, m, v, fwd, bwd, p2p, w_lags)
    a = _simulate_once(name, p, base, v, fwd, bwd, p2p, w_lags)
    b = _simulate_once(name, p, base + step, v, fwd, bwd, p2p, w_lags)
    k = (m - base) / step

    def line(x: float, y: float) -> float:
        return x + (y - x) * k

    # The last backwards are in the cool-down, linear in m like the stage ends; the first forwards are in
    # the warm-up, which more microbatches do not change.
    return PipelineTimes(
        line(a.makespan, b.makespan),
        [line(x, y) for x, y in zip(a.stage_end, b.stage_end)],
        [x * m / base for x in a.busy],
        [[line(x, y) for x, y in zip(ra, rb)] for ra, rb in zip(a.chunk_grads_done, b.chunk_grads_done)],
        a.chunk_first_forward,
    )
