"""Schedules as data: structure, deadlock freedom by simulation (also under NCCL's batch semantics),
bubble formulas (pure Python)."""

from __future__ import annotations

import pytest

from parallel3d.pipeline.schedules import (
    Action,
    ScheduleError,
    build_schedule,
    check_coalesced_progress,
    comm_plan,
    format_schedule,
    format_timeline,
    peak_in_flight,
    simulate,
    validate_schedule,
)

SHAPES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]


def _compute(actions):
    return [(a.kind, a.microbatch, a.chunk) for a in actions if a.is_compute]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SHAPES)
def test_every_microbatch_once_and_bubble_formula(name, p, m):
    schedule = build_schedule(name, p, m)
    assert sorted(schedule) == list(range(p))
    for s, actions in schedule.items():
        comp = _compute(actions)
        assert sorted(k for k in comp if k[0] == "F") == [("F", i, 0) for i in range(m)]
        assert sorted(k for k in comp if k[0] == "B") == [("B", i, 0) for i in range(m)]
        # Only stage 0 lacks RECV_ACT, only the last stage lacks SEND_ACT.
        assert any(a.kind == "RECV_ACT" for a in actions) == (s > 0)
        assert any(a.kind == "SEND_ACT" for a in actions) == (s < p - 1)
    # Uniform costs: the idle share is exactly (p-1)/(m+p-1) for both.
    for f, b in ((1.0, 1.0), (1.0, 2.0)):
        timeline = simulate(schedule, f, b)
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert timeline.makespan == pytest.approx((m + p - 1) * (f + b))
        assert timeline.busy == [pytest.approx(m * (f + b))] * p


@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_phases_and_memory(p, m):
    schedule = build_schedule("1f1b", p, m)
    peaks = peak_in_flight(schedule)
    gpipe_peaks = peak_in_flight(build_schedule("gpipe", p, m))
    for s in range(p):
        warmup = min(p - s - 1, m)
        comp = _compute(schedule[s])
        # warm-up of p-s-1 forwards, then strictly alternating, then the cool-down backwards.
        assert [k[0] for k in comp[:warmup]] == ["F"] * warmup
        steady = comp[warmup : warmup + 2 * (m - warmup)]
        assert [k[0] for k in steady] == ["F", "B"] * (m - warmup)
        assert [k[0] for k in comp[warmup + 2 * (m - warmup) :]] == ["B"] * warmup
        assert peaks[s] == min(p - s, m)
        assert gpipe_peaks[s] == m


INTERLEAVED = [(p, m, v) for p in (2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_valid_and_bubble_smaller_by_v(p, m, v):
    schedule = build_schedule("interleaved_1f1b", p, m, v)
    for s, actions in schedule.items():
        comp = _compute(actions)
        for kind in ("F", "B"):
            assert sorted(k for k in comp if k[0] == kind) == sorted((kind, i, c) for i in range(m) for c in range(v))
    # Each chunk costs 1/v of a stage's work; the idle/busy ratio is (p-1)/(v m) vs 1F1B's (p-1)/m.
    inter = simulate(schedule, 1.0 / v, 2.0 / v)
    plain = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    ratio_inter = inter.bubble_fraction / (1 - inter.bubble_fraction)
    ratio_plain = plain.bubble_fraction / (1 - plain.bubble_fraction)
    assert ratio_inter == pytest.approx(ratio_plain / v, rel=1e-9)
    assert inter.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)


def test_interleaved_wraps_from_last_stage_to_first():
    schedule = build_schedule("interleaved_1f1b", 2, 2, 2)
    # Stage 1 chunk 0 sends to stage 0 chunk 1; stage 0 chunk 0 gets no activations.
    assert Action("SEND_ACT", 0, 0) in schedule[1]
    assert Action("RECV_ACT", 0, 1) in schedule[0]
    assert Action("RECV_ACT", 0, 0) not in schedule[0]
    assert Action("SEND_ACT", 0, 1) not in schedule[1]


def test_simulate_with_per_stage_costs_and_p2p_latency():
    p, m = 3, 4
    schedule = build_schedule("1f1b", p, m)
    # The slowest stage sets the pace: makespan >= m * its work, and every stage idles at least as much.
    t = simulate(schedule, lambda s, c: 1.0 + s, lambda s, c: 2.0 * (1.0 + s), p2p_time=0.5)
    assert t.makespan >= m * 9.0
    assert t.busy == [pytest.approx(m * 3.0 * (1 + s)) for s in range(p)]
    for s in range(p):
        for a in schedule[s]:
            assert t.end(s, a) >= t.start(s, a)
    # A receive ends no earlier than its send's start plus the latency.
    assert t.end(1, Action("RECV_ACT", 0)) >= t.start(0, Action("SEND_ACT", 0)) + 0.5


def test_printable_views():
    text = format_schedule(build_schedule("1f1b", 2, 3))
    assert text.splitlines() == ["stage 0: F0 F1 B0 F2 B1 B2", "stage 1: F0 B0 F1 B1 F2 B2"]
    inter = format_schedule(build_schedule("interleaved_1f1b", 2, 2, 2))
    assert "F0c1" in inter
    assert "sa0" in format_schedule(build_schedule("gpipe", 2, 1), show_comms=True)
    chart = format_timeline(simulate(build_schedule("1f1b", 2, 2), 1.0, 1.0), columns=12)
    assert chart.splitlines()[1] == "stage 1: ..FFBBFFBB.."
    assert "bubble=0.333" in chart


# ---- the validator catches broken schedules ------------------------------------------------
def test_validator_catches_deadlock():
    schedule = build_schedule("1f1b", 2, 2)
    # Stage 0 waits for microbatch 0's gradient before sending the activation stage 1 needs to make it.
    bad = {0: [Action("F", 0), Action("RECV_GRAD", 0), Action("SEND_ACT", 0), Action("B", 0),
               Action("F", 1), Action("SEND_ACT", 1), Action("RECV_GRAD", 1), Action("B", 1)], 1: schedule[1]}
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(bad)


def test_validator_catches_mismatched_order():
    schedule = build_schedule("gpipe", 2, 2)
    s1 = schedule[1]
    # Receiving microbatch 1 before 0 would hand the wrong activations to F.
    bad = {0: schedule[0], 1: [Action("RECV_ACT", 1), Action("RECV_ACT", 0)] + [a for a in s1 if a.kind != "RECV_ACT"]}
    with pytest.raises(ScheduleError, match="oldest pending message"):
        validate_schedule(bad)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda acts: [a for a in acts if a not in (Action("B", 1), Action("SEND_GRAD", 1))],
         r"no B for microbatches \[1\]"),
        (lambda acts: acts + [Action("F", 0)], "repeats"),
        (lambda acts: [Action("B", 0)] + [a for a in acts if a != Action("B", 0)], "backward before its forward"),
        (lambda acts: [a for a in acts if a != Action("RECV_ACT", 0)], "needs an earlier RECV_ACT"),
    ],
)
def test_validator_catches_structural_errors(mutate, message):
    schedule = build_schedule("1f1b", 2, 2)
    bad = {0: schedule[0], 1: mutate(schedule[1])}
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(bad)


def test_validator_catches_unreceived_send_and_memory_limit():
    schedule = build_schedule("1f1b", 2, 2)
    bad = {0: schedule[0] , 1: [a for a in schedule[1] if a.kind != "SEND_GRAD"]}
    bad[0] = [a for a in bad[0] if a.kind != "RECV_GRAD" and a.kind != "B"] + [Action("B", 0), Action("B", 1)]
    with pytest.raises(ScheduleError, match="RECV_GRAD|never received"):
        validate_schedule(bad)
    gpipe = build_schedule("gpipe", 3, 4)
    with pytest.raises(ScheduleError, match="stage 0 holds 4 microbatches in flight"):
        validate_schedule(gpipe, max_in_flight=lambda s: 3 - s)


@pytest.mark.parametrize(
    "args, message",
    [
        (("zero_bubble", 2, 2), "parallel.schedule='zero_bubble': must be one of 1f1b, gpipe, interleaved_1f1b, zb_h1"),
        (("1f1b", 0, 2), "num_stages=0"),
        (("1f1b", 2, 0), "num_microbatches=0"),
        (("1f1b", 2, 2, 2), "has no virtual stages"),
        (("interleaved_1f1b", 1, 2, 2), "needs num_stages >= 2"),
        (("interleaved_1f1b", 4, 6, 2), "num_microbatches divisible by num_stages: num_microbatches=6, num_stages=4"),
    ],
)
def test_bad_arguments_fail_fast(args, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)


def test_action_kind_checked():
    with pytest.raises(ScheduleError, match="Action.kind='X'"):
        Action("X", 0)
    with pytest.raises(ValueError, match="fwd_time=-1"):
        simulate(build_schedule("1f1b", 2, 2), -1, 1)


# ---- NCCL batch semantics: one unit per batch, FIFO batches, rendezvous sends ---------------------
COALESCED = (
    [(name, p, m, 1) for name in ("gpipe", "1f1b") for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 5, 8, 16)]
    + [("interleaved_1f1b", p, m, v) for p in (2, 3, 4, 8) for v in (2, 3, 4) for m in range(p, 17, p)]
)


def test_comm_plan_batches_the_comms_between_two_computations():
    actions = build_schedule("1f1b", 3, 4)[1]
    plan = comm_plan(actions)
    assert [step.compute for step in plan] == [a for a in actions if a.is_compute] + [None]
    # Without prefetch every batch is exactly the comm actions listed before its computation.
    comms, i = [], 0
    for a in actions + [None]:
        if a is None or a.is_compute:
            step = plan[i]
            assert sorted(map(str, step.batch)) == sorted(map(str, comms)) and step.ahead == ()
            assert list(step.needs) == [c for c in comms if c.kind.startswith("RECV")]
            comms, i = [], i + 1
        else:
            comms.append(a)
    # With prefetch 2, receives go out in schedule order, at most two ahead of need, each on its own.
    ahead_plan = comm_plan(actions, prefetch=2)
    posted = [a for step in ahead_plan for a in (*step.batch, *step.ahead) if a.kind.startswith("RECV")]
    assert posted == [a for a in actions if a.kind.startswith("RECV")]
    assert all(len(step.ahead) <= 2 for step in ahead_plan)


def test_every_schedule_progresses_under_nccl_batch_semantics():
    """build_schedule(coalesced_p2p=True) proves it (validate_schedule); gloo's default plan passes too."""
    for name, p, m, v in COALESCED:
        schedule = build_schedule(name, p, m, v, coalesced_p2p=True)  # raises ScheduleError on a deadlock
        gloo = build_schedule(name, p, m, v)
        check_coalesced_progress(gloo, prefetch=2, coalesced=False)  # the engine's gloo plan
        if name != "interleaved_1f1b":
            assert schedule == gloo, (name, p, m)  # one placement serves both backends
        else:  # Megatron's per-iteration placement loses nothing on an ideal machine
            t = simulate(schedule, 1.0 / v, 2.0 / v)
            assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9), (p, m, v)


def test_receives_posted_ahead_deadlock_under_fifo_batches():
    """A receive batched ahead of need holds up the rank's later batches, the sends its peer waits for too."""
    for name in ("gpipe", "1f1b"):
        schedule = build_schedule(name, 2, 2)
        check_coalesced_progress(schedule, prefetch=1, coalesced=False)  # gloo: each op progresses alone
        with pytest.raises(ScheduleError, match=r"deadlock under NCCL .* prefetch=1"):
            check_coalesced_progress(schedule, prefetch=1)


def test_per_computation_interleaving_deadlocks_under_fifo_batches():
    """Simulation (sends never block) accepts it; NCCL's rendezvous sends in FIFO batches do not."""
    schedule = build_schedule("interleaved_1f1b", 2, 4, 2)  # receive right before, send right after each compute
    validate_schedule(schedule)
    with pytest.raises(ScheduleError, match=r"deadlock under NCCL .*stage -> the batches it waits for") as info:
        check_coalesced_progress(schedule)
    assert "SEND_ACT" in str(info.value)  # stuck behind a send whose receiver has not posted yet
    with pytest.raises(ScheduleError, match="deadlock under NCCL"):
        validate_schedule(schedule, coalesced_p2p=True)
    validate_schedule(build_schedule("interleaved_1f1b", 2, 4, 2, coalesced_p2p=True), coalesced_p2p=True)


def test_coalesced_check_catches_out_of_order_receives():
    schedule = build_schedule("gpipe", 2, 2)
    s1 = schedule[1]
    bad = {0: schedule[0], 1: [Action("RECV_ACT", 1), Action("RECV_ACT", 0)] + [a for a in s1 if a.kind != "RECV_ACT"]}
    with pytest.raises(ScheduleError, match="message 0 on channel"):
        check_coalesced_progress(bad)


def test_simulate_action_time_replays_each_computation() -> None:
    """``action_time`` gives each computation its own duration: at the per-kind costs it is the same
    run; one slower microbatch moves only what depends on it."""
    from parallel3d.pipeline.schedules import build_schedule, simulate

    sched = build_schedule("zb_h1", 3, 6, 1)
    base = simulate(sched, 1.0, 2.5, wgrad_time=1.0)
    same = simulate(sched, 0.0, 0.0, action_time=lambda s, a: {"F": 1.0, "B": 1.5, "W": 1.0}[a.kind])
    assert [(t.stage, t.action, t.start, t.end) for t in same.actions] == \
        [(t.stage, t.action, t.start, t.end) for t in base.actions]
    slow = simulate(sched, 0.0, 0.0, action_time=lambda s, a: {"F": 1.0, "B": 1.5, "W": 1.0}[a.kind]
                    + (3.0 if (s, a.kind, a.microbatch) == (0, "F", 0) else 0.0))
    assert slow.makespan == pytest.approx(base.makespan + 3.0)
    assert slow.busy[0] == pytest.approx(base.busy[0] + 3.0) and slow.busy[1:] == base.busy[1:]


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (2, 16), (4, 16)])
def test_simulate_charges_messages_only_between_stages(p, m):
    """zbv's turn (model chunk p-1 -> p, both on stage p-1) is no message, so the simulator charges
    it no latency; interleaved's wrap (last stage -> first) is one and is charged: 2p-2 vs 2p-1
    messages per microbatch and direction, one latency each on the critical path."""
    lat = 5.0
    zbv, inter = build_schedule("zbv", p, m, 2), build_schedule("interleaved_1f1b", p, m, 2)
    for schedule, links in ((zbv, 2 * p - 2), (inter, 2 * p - 1)):
        for kind in ("SEND_ACT", "SEND_GRAD"):
            assert sum(a.kind == kind for s in range(p) for a in schedule[s]) == m * links
    t = simulate(zbv, 1.0, 2.0, p2p_time=lat)
    # F(0) chunk 1 ends one forward (1.0) after F(0) chunk 0, plus only the stage's own other work
    turn = t.end(p - 1, Action("F", 0, 1)) - 1.0 - t.end(p - 1, Action("F", 0, 0))
    assert 0.0 <= turn < lat
    t = simulate(inter, 1.0, 2.0, p2p_time=lat)
    wrap = t.start(0, Action("F", 0, 1)) - t.end(p - 1, Action("F", 0, 0))
    assert wrap >= lat
