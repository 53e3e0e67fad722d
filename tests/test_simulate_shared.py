"""``simulate_shared``: the schedule on fewer cores than stages (processor sharing).

References are independent of the code under test: ``simulate`` (a core per stage) where cores
suffice; conservation of work (one core, free messages: never idle) where they do not; and a
two-stage run worked out by hand.
"""

from __future__ import annotations

import pytest

from parallel3d.pipeline.options import MULTI_CHUNK, SCHEDULES
from parallel3d.pipeline.schedules import Action, ScheduleError, Timeline, build_schedule, simulate
from parallel3d.pipeline.simulate_shared import simulate_shared


def _shapes() -> list[tuple[str, int, int, int]]:
    """Every schedule at p in 2..6, m in p..3p (interleaved: m a multiple of p)."""
    out = []
    for name in SCHEDULES:
        v = 2 if name in MULTI_CHUNK else 1
        for p in range(2, 7):
            out += [(name, p, m, v) for m in range(p, 3 * p + 1) if name != "interleaved_1f1b" or m % p == 0]
    return out


# Uneven costs, different per stage and chunk, none a round binary number (so float order matters).
def FWD(s: int, c: int) -> float:
    return 0.31 + 0.17 * s + 0.05 * c


def BWD(s: int, c: int) -> float:
    return 0.73 + 0.29 * ((s * 7) % 3) + 0.03 * c


def WGT(s: int, c: int) -> float:
    return 0.21 + 0.04 * s


def LAT(s: int, c: int) -> float:
    return 0.013 * (1 + s % 2)


def _per_stage(t: Timeline) -> dict[int, list[tuple[Action, float, float]]]:
    return {s: [(x.action, x.start, x.end) for x in t.actions if x.stage == s] for s in range(t.num_stages)}


def _total_work(schedule, fwd, bwd, wgt) -> float:
    """Every stage's computations summed, read off the one-core-per-stage timeline's spans."""
    return sum(simulate(schedule, fwd, bwd, wgrad_time=wgt).busy)


@pytest.mark.parametrize("name,p,m,v", _shapes())
def test_enough_cores_is_simulate_exactly(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    ref = simulate(schedule, FWD, BWD, p2p_time=LAT, wgrad_time=WGT)
    for cores in (p, p + 1.5):
        got = simulate_shared(schedule, FWD, BWD, p2p_time=LAT, wgrad_time=WGT, cores=cores)
        assert _per_stage(got) == _per_stage(ref)
        assert got.busy == ref.busy
        assert got.makespan == ref.makespan and got.bubble_fraction == ref.bubble_fraction
    assert simulate_shared(schedule, FWD, BWD, p2p_time=LAT, wgrad_time=WGT).busy == ref.busy  # cores=None


@pytest.mark.parametrize("name,p,m,v", _shapes())
def test_one_core_and_free_messages_never_idle(name: str, p: int, m: int, v: int) -> None:
    """One core, messages free: some stage is always runnable until the end, so the step is all
    stages' work end to end, and every stage is runnable (busy) a share of it."""
    schedule = build_schedule(name, p, m, v)
    got = simulate_shared(schedule, FWD, BWD, wgrad_time=WGT, cores=1)
    work = _total_work(schedule, FWD, BWD, WGT)
    assert got.makespan == pytest.approx(work, rel=1e-12)
    assert got.makespan > simulate(schedule, FWD, BWD, wgrad_time=WGT).makespan


@pytest.mark.parametrize("name,p,m,v", _shapes())
@pytest.mark.parametrize("cores", [1, 2, 2.5])
def test_sharing_never_finishes_an_action_earlier(name: str, p: int, m: int, v: int, cores: float) -> None:
    """Fewer cores only slow computations down; every dependency is a max of earlier ends, so no
    action ends before it does with a core per stage, and no computation's span is below its cost."""
    schedule = build_schedule(name, p, m, v)
    ref = simulate(schedule, FWD, BWD, p2p_time=LAT, wgrad_time=WGT)
    got = simulate_shared(schedule, FWD, BWD, p2p_time=LAT, wgrad_time=WGT, cores=cores)
    tol = 1e-12 * ref.makespan
    for key, timed in ref.by_action.items():
        shared = got.by_action[key]
        assert shared.end >= timed.end - tol
        if key[1].is_compute:  # a receive may wait less: its stage got there later
            assert shared.end - shared.start >= timed.end - timed.start - tol
    assert got.makespan >= ref.makespan - tol
    assert all(b >= r - tol for b, r in zip(got.busy, ref.busy))


def test_two_stages_on_one_core_by_hand() -> None:
    """1f1b, p 2, m 2, F = 1, B = 2, one core, free messages:
    0-1 s0 F0 alone; 1-3 s0 F1 | s1 F0 at half speed; 3-5 s1 B0 alone (s0 waits for its gradient);
    5-7 s0 B0 | s1 F1 halves (s1 F1 done, s0 B0 half done); 7-9 s0 B0 | s1 B1 halves (s0 B0 done);
    9-10 s1 B1 alone; 10-12 s0 B1 alone. Runnable: s0 1+2+4+2, s1 2+2+2+3, each 9 of 12."""
    schedule = build_schedule("1f1b", 2, 2)
    got = simulate_shared(schedule, 1.0, 2.0, cores=1)
    spans = {(s, str(a)): (start, end) for s, runs in _per_stage(got).items() for a, start, end in runs
             if a.is_compute}
    assert spans == {
        (0, str(Action("F", 0))): (0.0, 1.0), (0, str(Action("F", 1))): (1.0, 3.0),
        (0, str(Action("B", 0))): (5.0, 9.0), (0, str(Action("B", 1))): (10.0, 12.0),
        (1, str(Action("F", 0))): (1.0, 3.0), (1, str(Action("B", 0))): (3.0, 5.0),
        (1, str(Action("F", 1))): (5.0, 7.0), (1, str(Action("B", 1))): (7.0, 10.0),
    }
    assert got.busy == [9.0, 9.0] and got.makespan == 12.0 and got.bubble_fraction == 0.25
    # Messages taking 0.5: 0-1 s0 F0; 1-1.5 s0 F1 alone (s1's act 0 in flight); 1.5-2.5 both halves
    # (s0 F1 done); 2.5-3 s1 F0 alone; 3-5 s1 B0; 5-5.5 s1 F1 alone (grad 0 in flight); 5.5-6.5 s0 B0 |
    # s1 F1 halves; 6.5-9.5 s0 B0 | s1 B1 halves (s0 B0 done); 9.5-10 s1 B1 alone; 10-10.5 the core
    # idles (grad 1 in flight); 10.5-12.5 s0 B1. Runnable: s0 1+1.5+4+2, s1 1.5+2+1.5+3.5.
    late = simulate_shared(schedule, 1.0, 2.0, p2p_time=0.5, cores=1)
    assert late.makespan == 12.5 and late.busy == [8.5, 8.5]
    assert late.start(0, Action("RECV_GRAD", 1)) == 9.5 and late.end(0, Action("RECV_GRAD", 1)) == 10.5


def test_bad_cores_and_deadlocks_fail_like_simulate() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="cores"):
            simulate_shared(schedule, 1.0, 2.0, cores=bad)
    broken = build_schedule("1f1b", 2, 2)
    broken[1] = [a for a in broken[1] if a.kind != "SEND_GRAD"]  # stage 0 waits forever
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_shared(broken, 1.0, 2.0, cores=1)
