"""A pipeline schedule's step, priced by the same simulator that checks the runtime schedules.

Invariant: ``simulate_pipeline(name, p, m, v, fwd, bwd, p2p)`` equals ``simulate`` of
``build_schedule(name, p, m, v)`` (exactly for m <= 3p, by linear extension in m beyond it, which
is exact once every stage is in its steady state); ``fwd``/``bwd`` are per-(stage, chunk) times
in seconds and ``p2p`` one message's time. Schedules added to the runtime are priced without new
formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.pipeline.schedules import build_schedule, simulate


@dataclass(frozen=True)
class PipelineTimes:
    makespan: float
    stage_end: list[float]  # when each stage's last computation ends
    busy: list[float]  # per stage: time spent computing

    @property
    def bubble_fraction(self) -> float:
        return sum(1 - b / self.makespan for b in self.busy) / len(self.busy) if self.makespan > 0 else 0.0


def _simulate_once(name: str, p: int, m: int, v: int, fwd, bwd, p2p, w_lags=None) -> PipelineTimes:
    timeline = simulate(build_schedule(name, p, m, v, w_lags=w_lags), fwd, bwd, p2p)
    end = [0.0] * p
    for ta in timeline.actions:
        if ta.action.is_compute:
            end[ta.stage] = max(end[ta.stage], ta.end)
    return PipelineTimes(timeline.makespan, end, list(timeline.busy))


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

    return PipelineTimes(
        line(a.makespan, b.makespan),
        [line(x, y) for x, y in zip(a.stage_end, b.stage_end)],
        [x * m / base for x in a.busy],
    )
