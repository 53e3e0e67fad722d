"""``scripts/bench_pipeline_bubble.py``: the measured bubble is ``simulate``'s quantity on real timelines.

A synthetic "measurement" is made from a simulated execution (what a rank with a core of its own
would record: computations, executor time per computation, waits, then a tail of closing
collectives); fed back, the measured bubble must equal the simulator's, exactly. The former
whole-step definition (1 - computing / step) counted the executor's time and the tail as bubble,
and does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from bench_pipeline_bubble import reference, rel_diffs, simulated_bubbles, window_bubble, whole_step_bubble  # noqa: E402

from parallel3d.pipeline.schedules import build_schedule, simulate  # noqa: E402
from parallel3d.pipeline.simulate_shared import simulate_shared  # noqa: E402

F, B, W, OVERHEAD, TAIL = 1.0, 2.0, 0.8, 0.25, 1.5


def _measured_from_simulation(name: str, p: int, m: int, v: int, starts: list[float], cores: float | None = None,
                              msg_s: float = 0.0) -> tuple[list, float]:
    """Per stage (stage, {name: stats}, msg) as ``bench_pipeline_group`` reports them, recorded
    from a simulated run whose computations each carry ``OVERHEAD`` of executor time, on ``cores``
    cores shared by the stages (None: a core each) with messages taking ``msg_s``. A computation's
    span (longer than its work where it shared a core) is split between it and the executor in
    proportion to their work, as the ranks' clocks would split it; its CPU time is its work."""
    schedule = build_schedule(name, p, m, v)
    split = any(a.kind == "W" for st in range(p) for a in schedule[st])
    b = B if split else B + W
    timeline = simulate_shared(schedule, F + OVERHEAD, (b + OVERHEAD) + ((W + OVERHEAD) if split else 0.0),
                               p2p_time=msg_s, wgrad_time=(W + OVERHEAD) if split else None, cores=cores)
    work = {"F": F, "B": b, "W": W}
    stats = []
    for st in range(p):
        mine = [t for t in timeline.actions if t.stage == st and t.action.is_compute]
        own_end = max(t.end for t in mine)
        waited = sum(t.end - t.start for t in timeline.actions if t.stage == st and t.action.kind.startswith("RECV"))
        own = {(t.action.kind, t.action.microbatch, t.action.chunk):
               (t.end - t.start) * work[t.action.kind] / (work[t.action.kind] + OVERHEAD) for t in mine}
        wall: dict = {}
        for (kind, _, chunk), t in own.items():
            wall.setdefault((kind, chunk), []).append(t)
        compute = {k: sum(ts) / len(ts) for k, ts in wall.items()}
        cpu = {(t.action.kind, t.action.chunk): work[t.action.kind] for t in mine}
        step = (starts[st], own_end, waited, len(mine), sum(own.values()), timeline.makespan + TAIL)
        stats.append((st, {name: {"schedule": name, "virtual_stages": v, "compute": compute, "compute_cpu": cpu,
                                  "step_times": [step, step], "executor_cpu_per_compute": [OVERHEAD],
                                  "action_s": [own, own]}}, msg_s))
    return stats, timeline.bubble_fraction


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 2, 8, 1), ("1f1b", 4, 8, 1), ("zb_h1", 4, 8, 1),
                                        ("interleaved_1f1b", 2, 8, 2), ("zbv", 2, 8, 2)])
def test_measured_bubble_equals_simulated_on_a_simulated_execution(name: str, p: int, m: int, v: int) -> None:
    stats, truth = _measured_from_simulation(name, p, m, v, starts=[100.0] * p)
    got = simulated_bubbles(stats, name, p, m, msg_s=0.0, cores=p)
    assert got["measured"] == pytest.approx(truth, rel=1e-9)
    assert got["sim0"] == pytest.approx(truth, rel=1e-9)  # the feed puts the executor time back in
    assert got["sim_cpu"] == pytest.approx(truth, rel=1e-9)
    assert got["replay"] == pytest.approx(truth, rel=1e-9)  # every microbatch at the mean: the same run
    # The former definition counts executor time and the tail as idle: far off.
    assert abs(got["measured_whole_step"] - truth) > 0.1 * truth


def test_window_uses_the_common_clock_and_other_load_hides_the_measured_bubble() -> None:
    # Only the common clock matters: the absolute start cancels.
    stats, truth = _measured_from_simulation("1f1b", 2, 4, 1, starts=[7250.5, 7250.5])
    steps = [o["1f1b"]["step_times"][0] for _, o, _ in stats]
    assert window_bubble(steps) == pytest.approx(truth)
    assert whole_step_bubble(steps) > truth
    # Ranks outnumbering cores are modelled: the measured bubble is reported and judged against sim C.
    got = simulated_bubbles(stats, "1f1b", 2, 4, msg_s=0.0, cores=1)
    assert got["measured"] == pytest.approx(truth) and reference(2, 1) == "sim_shared" and reference(2, 2) == "sim"
    # Computations that got half a core (CPU time half their wall span) with a core per rank:
    # other load, which nothing simulates, so not reported.
    for _, ours, _ in stats:
        ours["1f1b"]["compute_cpu"] = {k: 0.5 * t for k, t in ours["1f1b"]["compute"].items()}
    got = simulated_bubbles(stats, "1f1b", 2, 4, msg_s=0.0, cores=2)
    assert got["core_share"] == pytest.approx(0.5) and got["measured"] is None
    assert got["measured_time_shared"] == pytest.approx(truth)


@pytest.mark.parametrize("name,p,m,v,cores", [("1f1b", 4, 8, 1, 2), ("1f1b", 4, 16, 1, 2), ("zb_h1", 4, 8, 1, 2),
                                              ("interleaved_1f1b", 4, 8, 2, 2), ("zbv", 4, 8, 2, 2),
                                              ("1f1b", 3, 6, 1, 1)])
def test_time_shared_measured_bubble_equals_sim_shared_on_a_shared_execution(name: str, p: int, m: int, v: int,
                                                                             cores: int) -> None:
    """Ranks outnumbering cores: a "measurement" recorded from a processor-sharing run (spans
    stretched by waiting for a core, CPU time the work) gives, fed back, the not-runnable share
    both ways: measured == sim C, exactly; the one-core-per-rank CPU feed (sim cpu), whose stages
    never wait for a core, is off by more than the issue's 10%."""
    msg = 0.05
    stats, truth = _measured_from_simulation(name, p, m, v, starts=[3.0] * p, cores=cores, msg_s=msg)
    got = simulated_bubbles(stats, name, p, m, msg_s=msg, cores=cores)
    assert got["core_share"] < 0.9  # the computations waited for a core: reported all the same
    assert got["measured"] == pytest.approx(truth, rel=1e-9)
    assert got["sim_shared"] == pytest.approx(truth, rel=1e-9)
    assert abs(got["sim_cpu"] - truth) > 0.1 * truth
    assert got["sim_core_share"] == pytest.approx(got["core_share"], rel=0.05)  # both count work over wall
    schedule = build_schedule(name, p, m, v)
    split = any(a.kind == "W" for st in range(p) for a in schedule[st])
    work = {"F": F, "B": B if split else B + W, "W": W}
    assert got["sim_work_s"] == pytest.approx(sum(work[a.kind] + OVERHEAD for st in range(p)
                                                  for a in schedule[st] if a.is_compute), rel=1e-12)
    judged = rel_diffs(got, p, cores)  # what the table prints: judged against sim C, not sim
    assert judged["reference"] == "sim_shared" and judged["rel_diff"] == pytest.approx(0.0, abs=1e-9)
    assert not judged["other_load"]  # the computations got the share of a core the model gives them
    # Computations that took twice the wall time for their work: others took the cores. Still reported
    # (the ranks outnumber the cores), flagged.
    for _, ours, _ in stats:
        ours[name]["compute"] = {k: 2 * t for k, t in ours[name]["compute"].items()}
    loaded = simulated_bubbles(stats, name, p, m, msg_s=msg, cores=cores)
    assert loaded["measured"] == pytest.approx(truth, rel=1e-9) and rel_diffs(loaded, p, cores)["other_load"]
    assert abs(got["sim"] - truth) > 1e-3  # (sim, a core per rank on wall-time costs, would not do)


def test_replay_uses_each_computations_own_duration() -> None:
    """One slow forward on the first stage delays the whole pipeline in a replay; at the mean cost
    (what ``sim`` assumes) the same total work packs tighter."""
    stats, _ = _measured_from_simulation("1f1b", 2, 4, 1, starts=[0.0, 0.0])
    for _, ours, _ in stats:
        ours["1f1b"]["action_s"] = [dict(s) for s in ours["1f1b"]["action_s"]]
    first = stats[0][1]["1f1b"]
    for step in first["action_s"]:
        step[("F", 0, 0)] += 4.0  # the first microbatch's forward, which every later action waits for
    first["compute"] = {k: t + (1.0 if k == ("F", 0) else 0.0) for k, t in first["compute"].items()}  # mean +4/4
    got = simulated_bubbles(stats, "1f1b", 2, 4, msg_s=0.0, cores=2)
    assert got["replay"] > got["sim0"] + 0.02


# ---- the message latency fed to ``sim`` (bench_pipeline_messages.one_way_latency) ---------------
POST, LAT = 40e-6, 25e-6  # a post's unpreempted cost; the message's latency after it


def _stamps(p: int, reps: int, lat: dict[int, float], preempted: set[tuple[int, int]] = frozenset()) -> list:
    """Per stage (stage, [(post began, post returned)], [woke]) as ``message_latency`` gathers them:
    stage s's k-th message to stage s + 1 leaves at s + k (seconds apart, so a wrong pairing shows)
    and wakes its receiver ``POST + lat[s]`` later; a ``preempted`` (stage, k) post returns 1 ms
    after its receiver woke (gloo handed the message on inside the call)."""
    sent = {s: [] for s in range(p)}
    woke = {s: [] for s in range(p)}
    for k in range(reps):
        for s in range(p):
            began = 10.0 * s + k
            wake = began + POST + lat[s]
            sent[s].append((began, wake + 1e-3 if (s, k) in preempted else began + POST))
            woke[(s + 1) % p].append(wake)
    return [(s, sent[s], woke[s]) for s in reversed(range(p))]  # gathered in any order


def test_message_latency_counts_from_the_post_and_leaves_the_post_to_the_executor() -> None:
    """The feed's message time is post -> blocked receiver waking, less the post's own cost (the
    executor time per computation holds it), not an exchange loop's wall time; a post preempted
    after handing the message on does not move it; stage s's messages go to stage s + 1."""
    from bench_pipeline_messages import one_way_latency

    lat, posting = one_way_latency(_stamps(2, 5, {0: LAT, 1: LAT}, preempted={(0, 1), (1, 3)}), 2)
    assert posting == pytest.approx(POST)
    assert lat == pytest.approx(LAT)
    # pp 3 ring, one latency per link: the median message's, paired link by link
    lat, _ = one_way_latency(_stamps(3, 4, {0: 10e-6, 1: 20e-6, 2: 90e-6}), 3)
    assert lat == pytest.approx(20e-6)


def test_message_latency_is_never_negative() -> None:
    from bench_pipeline_messages import one_way_latency

    lat, _ = one_way_latency(_stamps(2, 3, {0: -POST, 1: -POST}), 2)  # woke as the post began
    assert lat == 0.0


def test_in_run_latency_pairs_messages_first_in_first_out_and_splits_delivery() -> None:
    """Rank a's k-th send to b is b's k-th receive from a (gloo's order, whatever the actions are
    called at each end). A message sent while its receiver was blocked on it gives a latency (woke -
    post began - the least post); one sent before its receiver waited gives a delivery wait instead."""
    from bench_pipeline_bubble import in_run_latencies

    from parallel3d.pipeline.actions import Action

    lat, late, dlv = 40e-6, 70e-6, 300e-6
    s0, s1 = Action("SEND_ACT", 0, 0), Action("SEND_ACT", 1, 0)
    r0, r1 = Action("RECV_ACT", 0, 1), Action("RECV_ACT", 1, 1)  # rank 1's names for the same messages
    g0, h0 = Action("SEND_GRAD", 0, 1), Action("RECV_GRAD", 0, 0)  # the other direction
    traces = {
        0: [("SEND_ACT", s0, 1, 10.0, 10.0 + POST, 1), ("SEND_ACT", s1, 1, 20.0, 20.0 + 3 * POST, 2),
            ("RECV_GRAD", h0, 1, 21.0, 21.0 + 1e-6, 3), ("wait", h0, -1, 29.0, 30.0 + POST + late, 3)],
        1: [("RECV_ACT", r0, 0, 1.0, 1.0 + 1e-6, 1), ("RECV_ACT", r1, 0, 2.0, 2.0 + 1e-6, 2),
            ("wait", r0, -1, 9.0, 10.0 + POST + lat, 1),  # blocked before the send: a latency
            ("wait", r1, -1, 25.0, 25.0 + dlv, 2),  # sent before the wait: a delivery wait
            ("SEND_GRAD", g0, 0, 30.0, 30.0 + 2 * POST, 4)],
    }
    latencies, posting, delivery = in_run_latencies(traces)
    assert posting == pytest.approx(POST)
    assert sorted(latencies) == pytest.approx([lat, late])
    assert delivery == pytest.approx({0: 0.0, 1: dlv})


def test_the_simulator_is_fed_the_in_run_latency_and_delivery_waits_are_reported() -> None:
    """With each rank's p2p stamps, ``sim`` uses the mean in-run latency (``sim_isolated`` the message
    timed alone) and the waits for messages already sent are a share of the window, taken out of
    ``measured_less_delivery``."""
    from parallel3d.pipeline.actions import Action

    stats, truth = _measured_from_simulation("1f1b", 2, 8, 1, starts=[100.0, 100.0])
    (_, o0, _), (_, o1, _) = stats
    window = o0["1f1b"]["step_times"][0][1]  # both stages start together; stage 0's own end is the last
    act, grad = Action("SEND_ACT", 0), Action("RECV_ACT", 0)
    sg, rg = Action("SEND_GRAD", 0), Action("RECV_GRAD", 0)
    lat, dlv = 0.02, 0.05  # a latency of 0.02, and 0.05 blocked on a gradient already sent
    trace0 = [("SEND_ACT", act, 1, 100.0, 100.0 + POST, 1), ("RECV_GRAD", rg, 1, 100.1, 100.1, 2),
              ("wait", rg, -1, 103.0, 103.0 + dlv, 2)]
    trace1 = [("RECV_ACT", grad, 0, 99.0, 99.0, 1), ("wait", grad, -1, 99.5, 100.0 + POST + lat, 1),
              ("SEND_GRAD", sg, 0, 102.0, 102.0 + POST, 2)]
    for st, (o, trace) in enumerate(((o0, trace0), (o1, trace1))):
        o["1f1b"].update(rank=st, p2p_traces=[trace, trace])
    got = simulated_bubbles(stats, "1f1b", 2, 8, msg_s=0.0, cores=2)
    assert got["msg_in_run_s"] == pytest.approx(lat) and got["msg_in_run_n"] == 2
    assert got["sim_isolated"] == pytest.approx(truth, rel=1e-9)
    schedule = build_schedule("1f1b", 2, 8, 1)
    assert got["sim"] == pytest.approx(simulate(schedule, F + OVERHEAD, B + W + OVERHEAD, p2p_time=lat).bubble_fraction)
    assert got["sim"] > got["sim_isolated"]
    assert got["delivery_share"] == pytest.approx(dlv / window / 2)  # mean over the two ranks
    assert got["measured_less_delivery"] == pytest.approx(got["measured"] - dlv / window / 2)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 3, 6, 1), ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2)])
def test_kind_means_feed_whole_backwards_on_split_drain_stages(name: str, p: int, m: int, v: int) -> None:
    """With the drain split, a chunk's fed B is a whole backward less W; a chunk that splits none (the
    model's first chunk under interleaving) keeps its whole backward as B (it has no W to subtract)."""
    from bench_pipeline_bubble import _kind_means
    f, whole, b_split, w = 1.0, 3.0, 2.5, 1.0  # a split B + W costs more than a whole backward
    schedule = build_schedule(name, p, m, v, split_drain=True)
    for stage, actions in schedule.items():
        split = {(a.microbatch, a.chunk) for a in actions if a.kind == "W"}
        cost = {"F": f, "W": w}
        step = [(a, cost.get(a.kind, b_split if (a.microbatch, a.chunk) in split else whole))
                for a in actions if a.is_compute]
        means = _kind_means([step])
        for chunk in {a.chunk for a in actions if a.is_compute}:
            fed = means[("B", chunk)] + means.get(("W", chunk), 0.0)
            assert fed == pytest.approx(whole), f"stage {stage} chunk {chunk}: fed backward {fed}"
