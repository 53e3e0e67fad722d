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
  at the message latency measured in the run (``sim``: ``in_run_latencies``, from a send's post to
  its blocked receiver waking, less the post's own cost, which the executor time already holds;
  the mean over the round's messages that found their receiver waiting), at the latency of a
  message timed alone after the steps (``sim_isolated``: an idle machine's, which the run's busy
  cores and gloo's background threads do not see), or free (``sim0``). Not an exchange's wall
  time, which counts both ends' posting and waiting a second time. Mean, not median, so that a
  stage's simulated work equals its measured work: the two bubbles then differ only by waiting.

The mean-fed simulator assumes every microbatch costs the mean; ``replay`` feeds it each
computation's own measured duration (plus the stage's executor time per computation), step by
step: where replay and measured agree but the mean-fed ``sim`` does not, the gap is the
variation of the costs (a schedule with little slack passes it on as waiting), not a
difference of definitions.

Time-sharing: with more ranks than cores (pp 4 on 2 cores) a rank blocked in a wait is not idle
hardware (another rank computes on that core) and a computation's wall span includes waiting for
a core. The bubble is then defined, for both sides alike, as each rank's wall time *not runnable*:
blocked in a p2p wait inside the schedule or finished (after its own last computation), as a
share of the window, averaged over ranks; time a rank is ready but waits for a core counts as
work (runnable). The measured one is ``window_bubble`` unchanged (a rank's waits are its blocked
receives; its computations' and executor's spans include waiting for a core). The simulated one
is ``sim_shared``: ``simulate_shared`` with the ranks sharing ``cores`` cores (processor sharing),
fed the computations' and the executor's thread CPU times (the work, which waiting for a core
does not inflate) and the in-run message latency; ``reference`` names it as what the measured
bubble is judged against. Not modelled: gloo's own threads (one per process, delivering
messages) take core time from the ranks, and a woken receiver waits for a core before its wait
returns (measured as waiting, runnable in the model). Other users' load is told to no simulator: it
shows as ``core_share`` (the computations' thread CPU over their wall time, least over stages)
below ``CORE_SHARE_MIN`` times ``sim_core_share`` (the simulated one: work over runnable time,
least over stages; 1 with a core per rank) (``other_load``). Where ranks do not outnumber cores
the measured bubble is then not reported (None; the value stays in the JSON as
``measured_time_shared``); where they do, it is reported and ``rel_diffs`` flags the comparison
(``other_load``): not a test of the model. ``sim_cpu``: the CPU-time feed, a core per rank, free
messages.
"""

from __future__ import annotations

import statistics
from typing import Callable

# Per stage, per measured step: (start_time, own last computation's end relative to start,
# schedule_wait_time, number of computations, busy seconds, step seconds).
StepTimes = tuple[float, float, float, int, float, float]

CORE_SHARE_MIN = 0.9  # below (times the model's own share): the computations waited for others' work (module doc)


def other_load(core_share: float, sim_core_share: float) -> bool:
    """Whether the ranks' computations got clearly less of a core (``core_share``) than the simulator
    on this machine's cores gives them (``sim_core_share``; 1 with a core per rank): others took it."""
    return core_share < CORE_SHARE_MIN * sim_core_share


def in_run_latencies(traces: dict[int, list[tuple]]) -> tuple[list[float], float, dict[int, float]]:
    """(latencies, posting, delivery waits) of one step's messages from every rank's
    ``PipelineP2P.trace`` (``traces``: rank -> its stamps, on one clock).

    gloo matches a pair's messages first in, first out: rank a's k-th send to b is b's k-th receive
    from a. A message's latency is counted where its receiver was already blocked on it when the
    send's post began (the receiver waking is then the message's arrival): woke - post began -
    posting, at least 0; posting is the least time a send's post took (its cost when not
    preempted: the executor's time, no part of the message's). Delivery waits, per receiving rank:
    the seconds blocked on messages whose send was posted before the wait began (gloo's threads
    delivering a message already sent, which ``simulate`` has arrive after the latency, long past)."""
    sends: dict[tuple[int, int], list[tuple]] = {}
    recvs: dict[tuple[int, int], list[tuple]] = {}
    waits: dict[tuple[int, object], tuple[float, float]] = {}
    for rank, trace in traces.items():
        for kind, action, peer, began, end, _ in trace:
            if kind.startswith("SEND"):
                sends.setdefault((rank, peer), []).append((action, began, end))
            elif kind.startswith("RECV"):
                recvs.setdefault((peer, rank), []).append(action)
            else:
                waits[(rank, action)] = (began, end)
    posting = min((end - began for sent in sends.values() for _, began, end in sent), default=0.0)
    latencies: list[float] = []
    delivery = {rank: 0.0 for rank in traces}
    for (src, dst), sent in sends.items():
        for (_, began, _), action in zip(sent, recvs.get((src, dst), [])):
            entered, woke = waits.get((dst, action), (began, began))
            if entered < began:  # the receiver was waiting when the send was posted
                latencies.append(max(0.0, woke - began - posting))
            else:
                delivery[dst] += woke - entered
    return latencies, posting, delivery


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


def _kind_means(per_step: list[list[tuple]]) -> dict[tuple[str, int], float]:
    """Per (kind, chunk), the mean of ``(action, seconds)`` over steps. Where a chunk splits only some
    backwards (1f1b's split drain), "B" is the unsplit backwards' mean less W's, so that the fed
    ``bwd`` (B + W, ``bench_pipeline_bubble.fed_costs``) is a whole backward and a split B ``bwd - W``
    (the split's own overhead is then not in the fed simulators; ``replay`` has each action's time).
    A chunk that splits none (interleaved's split drain never splits the model's first chunk) keeps its
    whole backwards as "B"."""
    own: dict[tuple[str, int], list[float]] = {}
    whole: dict[int, list[float]] = {}
    for step in per_step:
        split = {(a.microbatch, a.chunk) for a, _ in step if a.kind == "W"}
        split_chunks = {chunk for _, chunk in split}
        for a, t in step:
            if a.kind == "B" and a.chunk in split_chunks and (a.microbatch, a.chunk) not in split:
                whole.setdefault(a.chunk, []).append(t)
            else:
                own.setdefault((a.kind, a.chunk), []).append(t)
    means = {k: statistics.fmean(vals) for k, vals in own.items()}
    for c, vals in whole.items():
        means[("B", c)] = statistics.fmean(vals) - means[("W", c)]
    return means


def compute_means(results: list) -> dict[tuple[str, int], float]:
    """Per (kind, chunk): the mean measured time of our F / B / W computations (the mean, so that a
    stage's simulated busy time equals its measured one: the bubbles then differ only by waiting)."""
    return _kind_means([[(a, e - b) for a, b, e in res.timeline if a.is_compute] for res in results])


def compute_cpu_means(results: list) -> dict[tuple[str, int], float]:
    """Per (kind, chunk): the mean thread CPU seconds of our F / B / W computations (their cost on a
    core of their own)."""
    return _kind_means([list(res.compute_cpu) for res in results])


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


def reference(p: int, cores: int) -> str:
    """Which simulated bubble the measured one is judged against (module doc): ``sim_shared`` where
    the ``p`` ranks outnumber the ``cores`` and take turns on them, else ``sim``."""
    return "sim_shared" if p > cores else "sim"


def rel_diffs(bub: dict, p: int, cores: int) -> dict:
    """The measured bubble's (and that less its delivery waits') relative difference to ``reference``'s
    simulated one, in ``bub`` (``simulated_bubbles``' keys); None where the measured one is withheld."""
    ref = bub[reference(p, cores)]

    def rel(x: float | None) -> float | None:
        return None if x is None else abs(x - ref) / max(ref, 1e-12)

    return {"reference": reference(p, cores), "rel_diff": rel(bub["measured"]),
            "rel_diff_less_delivery": rel(bub["measured_less_delivery"]),
            "other_load": other_load(bub["core_share"], bub["sim_core_share"])}


def round_feed(rank_stats: list, name: str, p: int, m: int, msg_s: float) -> dict:
    """What the simulators of one round are fed, for our system ``name`` (``simulated_bubbles``,
    ``bench_pipeline_timeline``): ``per_stage`` stats, the ``schedule`` the engine ran, the ``steps``
    (per step, every stage's ``StepTimes``), the mean ``wall`` and ``cpu`` costs per (stage, kind,
    chunk), the executor's time per computation (``overhead``: wall, ``overhead_cpu``: thread CPU), the
    in-run message latencies (``in_run``; ``msg_run`` their mean, else ``msg_s``) and per step the
    delivery waits' share of the window (``delivered``, mean over ranks)."""
    from parallel3d.pipeline.schedules import build_schedule

    per_stage = {st: ours[name] for st, ours, *_ in rank_stats}
    schedule = build_schedule(per_stage[0]["schedule"], p, m, per_stage[0]["virtual_stages"],
                              w_lags=per_stage[0].get("w_lags"),
                              split_drain=bool(per_stage[0].get("split_drain")))  # the schedule the engine ran
    steps = [list(step) for step in zip(*(o["step_times"] for o in per_stage.values()))]
    in_run: list[float] = []
    delivered: list[float] = []  # per step: delivery waits' share of the window, mean over ranks
    if all(o.get("p2p_traces") for o in per_stage.values()):
        for i, step in enumerate(steps):
            lats, _, delivery = in_run_latencies({o["rank"]: o["p2p_traces"][i] for o in per_stage.values()})
            in_run += lats
            end = max(start + own_end for start, own_end, *_ in step)
            delivered.append(statistics.fmean(delivery[o["rank"]] / (end - x[0])
                                              for o, x in zip(per_stage.values(), step)))
    return {
        "per_stage": per_stage, "schedule": schedule, "steps": steps,
        "wall": {(st, kind, c): t for st, o in per_stage.items() for (kind, c), t in o["compute"].items()},
        "cpu": {(st, kind, c): t for st, o in per_stage.items() for (kind, c), t in o["compute_cpu"].items()},
        "overhead": {st: statistics.fmean(executor_per_compute(x) for x in o["step_times"])
                     for st, o in per_stage.items()},
        "overhead_cpu": {st: statistics.fmean(o["executor_cpu_per_compute"]) for st, o in per_stage.items()},
        "in_run": in_run, "msg_run": statistics.fmean(in_run) if in_run else msg_s, "delivered": delivered,
    }


def simulated_bubbles(rank_stats: list, name: str, p: int, m: int, msg_s: float,
                      cores: int) -> dict[str, float | None]:
    """For our system ``name`` in one round: the measured bubble (window definition; None where
    ranks do not outnumber ``cores`` but ``core_share`` is low: other load), the former whole-step
    one, and ``simulate``'s fed with the measured costs (wall: with the in-run message latency,
    with ``msg_s`` (a message timed alone) and without; CPU: a core per rank; ``sim_shared``: CPU,
    on ``cores`` shared cores, in-run latency; ``replay``: each computation's own duration, with
    the in-run message latency). Without traces (``p2p_traces`` per step) the in-run latency is
    ``msg_s``."""
    from parallel3d.pipeline.schedules import simulate
    from parallel3d.pipeline.simulate_shared import simulate_shared

    fed = round_feed(rank_stats, name, p, m, msg_s)
    per_stage, schedule, steps, overhead, msg_run = (fed[k] for k in ("per_stage", "schedule", "steps", "overhead",
                                                                      "msg_run"))
    wall, cpu, in_run, delivered = fed["wall"], fed["cpu"], fed["in_run"], fed["delivered"]
    fwd, bwd, wgt = fed_costs(wall, overhead)
    cfwd, cbwd, cwgt = fed_costs(cpu, fed["overhead_cpu"])
    measured = statistics.median(window_bubble(s) for s in steps)
    replays = []
    for i in range(len(steps)):
        def own(st: int, a, i: int = i) -> float:
            return per_stage[st]["action_s"][i][(a.kind, a.microbatch, a.chunk)] + overhead[st]
        replays.append(simulate(schedule, 0.0, 0.0, p2p_time=msg_run, action_time=own).bubble_fraction)
    core_share = min(sum(t for (st, _, _), t in cpu.items() if st == stage) /
                     sum(t for (st, _, _), t in wall.items() if st == stage) for stage in per_stage)
    shared = simulate_shared(schedule, cfwd, cbwd, p2p_time=msg_run, wgrad_time=cwgt, cores=cores)
    own_core = simulate(schedule, cfwd, cbwd, wgrad_time=cwgt)  # busy: each stage's work, its CPU time
    sim_core_share = min(w / b if b > 0 else 1.0 for w, b in zip(own_core.busy, shared.busy))
    # Ranks outnumbering cores are modelled (sim_shared), so reported even under other load (flagged
    # by ``rel_diffs``); with a core per rank, other users' load is all there is to see: withheld.
    withheld = reference(p, cores) == "sim" and other_load(core_share, sim_core_share)
    return {
        "measured": None if withheld else measured,
        "core_share": core_share,
        "sim_shared": shared.bubble_fraction,
        # the simulated computations' work over their runnable spans, least over stages
        "sim_core_share": sim_core_share,
        "sim_work_s": sum(own_core.busy),  # the CPU seconds per step the simulators know of, all stages
        "measured_time_shared": measured,
        "measured_whole_step": statistics.median(whole_step_bubble(s) for s in steps),
        "sim": simulate(schedule, fwd, bwd, p2p_time=msg_run, wgrad_time=wgt).bubble_fraction,
        "sim_isolated": simulate(schedule, fwd, bwd, p2p_time=msg_s, wgrad_time=wgt).bubble_fraction,
        "msg_in_run_s": msg_run, "msg_in_run_n": len(in_run),
        "delivery_share": statistics.median(delivered) if delivered else None,
        # per step, the measured bubble less its delivery waits, median (None where not reported)
        "measured_less_delivery": None if not delivered or withheld
        else statistics.median(window_bubble(st) - d for st, d in zip(steps, delivered)),
        "sim0": simulate(schedule, fwd, bwd, wgrad_time=wgt).bubble_fraction,
        "sim_cpu": own_core.bubble_fraction,
        "replay": statistics.median(replays),
    }
