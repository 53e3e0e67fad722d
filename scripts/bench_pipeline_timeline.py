"""Per-rank timelines of one benchmarked step, measured against the simulators that judge its bubble.

``bench_pipeline.py --raw FILE`` keeps every rank's per-step stats; this reads them and, for one
of our systems, round and step, puts each rank's measured window (its own step start to the last
computation on any rank, the window of ``bench_pipeline_bubble.window_bubble``) beside the same
rank in:

* ``sim C``: ``simulate_shared`` fed what the bench feeds it (mean thread CPU per (stage, kind,
  chunk) plus the executor's CPU per computation, the in-run message latency, this machine's cores);
* ``replay C``: the same on this step's own per-computation CPU times (no mean: what is left between
  it and the measurement is the processor-sharing model, not the costs' variation);
* ``replay``: ``simulate`` (a core per rank) on this step's own wall durations (which hold the
  waiting for a core the ranks really met) plus the executor's wall time per computation.

Per rank, in ms: ``run`` (runnable: computing, or the executor's own work, each including waiting
for a core), ``blk`` (blocked in p2p waits), ``tail`` (after its own last computation), and for the
measured rank the split of ``run`` into computations' wall time, their CPU time and the executor's
wall time. Then the drift: where each rank's computations end, measured minus ``sim C``'s, at
quarters of its action list (ends: the executor's own time around a computation is part of the
simulated computation, so its start is not comparable; its end is). The bubble of each is
``(blk + tail) / window``, mean over ranks (the measured one is ``window_bubble``'s).

Usage: ``.venv/bin/python scripts/bench_pipeline_timeline.py RAW [--system "ours 1f1b"] [--stages 4]
[--round 0] [--step 0]``.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_pipeline_bubble import fed_costs, round_feed  # noqa: E402

from parallel3d.pipeline.simulate import Timeline, simulate  # noqa: E402
from parallel3d.pipeline.simulate_shared import simulate_shared  # noqa: E402

Key = tuple[str, int, int]  # (kind, microbatch, chunk)


def sim_ranks(timeline: Timeline, runnable: list[float]) -> list[dict]:
    """Per stage of a simulated step: runnable, blocked (its receives' spans), tail, in seconds, and
    each computation's end by key."""
    out = []
    for st in range(timeline.num_stages):
        mine = [t for t in timeline.actions if t.stage == st]
        comp = [t for t in mine if t.action.is_compute]
        blocked = sum(t.end - t.start for t in mine if t.action.kind.startswith("RECV"))
        out.append({"run": runnable[st], "blk": blocked, "tail": timeline.makespan - max(t.end for t in comp),
                    "window": timeline.makespan,
                    "ends": {(t.action.kind, t.action.microbatch, t.action.chunk): t.end for t in comp}})
    return out


def measured_ranks(fed: dict, i: int) -> list[dict]:
    """Per rank of measured step ``i``: the same quantities on the common clock (module doc)."""
    step = fed["steps"][i]
    t0 = min(x[0] for x in step)
    end = max(start + own_end for start, own_end, *_ in step)
    out = []
    for (st, o), (start, own_end, waited, _, busy, _) in zip(fed["per_stage"].items(), step):
        cpu = sum(o["action_cpu_s"][i].values())
        out.append({"run": own_end - waited, "blk": waited, "tail": end - start - own_end, "window": end - start,
                    "comp": busy, "cpu": cpu, "exec": own_end - busy - waited,
                    "exec_cpu": o["executor_cpu_per_compute"][i] * len(o["action_cpu_s"][i]),
                    "ends": {(k, mb, c): start - t0 + e for k, mb, c, _, e in o["action_spans"][i]}})
    return out


def bubble(ranks: list[dict]) -> float:
    return statistics.fmean((r["blk"] + r["tail"]) / r["window"] for r in ranks)


def timelines(fed: dict, i: int, cores: int) -> dict[str, list[dict]]:
    """The measured step ``i`` and its three simulated counterparts (module doc), per rank."""
    per_stage, schedule, msg = fed["per_stage"], fed["schedule"], fed["msg_run"]
    cfwd, cbwd, cwgt = fed_costs(fed["cpu"], fed["overhead_cpu"])
    shared = simulate_shared(schedule, cfwd, cbwd, p2p_time=msg, wgrad_time=cwgt, cores=cores)

    def own_cpu(st: int, a) -> float:
        o = per_stage[st]
        return o["action_cpu_s"][i][(a.kind, a.microbatch, a.chunk)] + o["executor_cpu_per_compute"][i]

    def own_wall(st: int, a) -> float:
        return per_stage[st]["action_s"][i][(a.kind, a.microbatch, a.chunk)] + fed["overhead"][st]

    replay_c = simulate_shared(schedule, 0.0, 0.0, p2p_time=msg, action_time=own_cpu, cores=cores)
    replay = simulate(schedule, 0.0, 0.0, p2p_time=msg, action_time=own_wall)
    return {"measured": measured_ranks(fed, i), "sim C": sim_ranks(shared, shared.busy),
            "replay C": sim_ranks(replay_c, replay_c.busy), "replay": sim_ranks(replay, replay.busy)}


def drift(measured: dict, sim: dict, quarters: int = 4) -> list[float]:
    """Measured end minus simulated end of a rank's computations at ``quarters`` of its list."""
    order = sorted(measured["ends"], key=measured["ends"].get)
    picks = [order[min(len(order) - 1, round(q * (len(order) - 1) / (quarters - 1)))] for q in range(quarters)]
    return [measured["ends"][k] - sim["ends"][k] for k in picks]


def report(fed: dict, i: int, cores: int) -> str:
    got = timelines(fed, i, cores)
    meas = got["measured"]
    ms = 1e3
    lines = ["bubble: " + "  ".join(f"{name} {bubble(r):.3f}" for name, r in got.items())
             + f"  (message latency fed {fed['msg_run'] * 1e6:.0f} us)",
             " rank |  window  run  blk tail | comp cpu core exec exec_cpu | "
             + " | ".join(f"{n:>8}: window  run  blk tail" for n in got if n != "measured")]
    for st, r in enumerate(meas):
        row = (f" {st:>4} | {r['window'] * ms:7.1f} {r['run'] * ms:4.1f} {r['blk'] * ms:4.1f} {r['tail'] * ms:4.1f} | "
               f"{r['comp'] * ms:4.1f} {r['cpu'] * ms:4.1f} {r['cpu'] / r['comp']:4.2f} {r['exec'] * ms:4.1f} "
               f"{r['exec_cpu'] * ms:8.2f} | ")
        row += " | ".join(f"{'':>8}  {s[st]['window'] * ms:6.1f} {s[st]['run'] * ms:4.1f} {s[st]['blk'] * ms:4.1f} "
                          f"{s[st]['tail'] * ms:4.1f}" for n, s in got.items() if n != "measured")
        lines.append(row)
    lines.append(" drift (ms), measured end - sim C end of each rank's computations at 0, 1/3, 2/3, last:")
    for st, r in enumerate(meas):
        lines.append(f"   rank {st}: " + " ".join(f"{d * ms:7.2f}" for d in drift(r, got["sim C"][st])))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="a bench_pipeline.py --raw file")
    ap.add_argument("--system", default="ours 1f1b")
    ap.add_argument("--case", default="main")
    ap.add_argument("--stages", type=int, default=None, help="default: the first benchmarked")
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--step", type=int, default=None, help="default: every measured step")
    args = ap.parse_args()
    with open(args.raw, "rb") as f:
        raw = pickle.load(f)
    p = args.stages or next(q for c, q in raw["stats"] if c == args.case)
    rank_stats = raw["stats"][(args.case, p)][args.round]
    m = raw["config"]["small_mb_microbatches" if args.case == "small_mb" else "microbatches"]
    msg_s = statistics.mean(x[2] for x in rank_stats)
    fed = round_feed(rank_stats, args.system, p, m, msg_s)
    steps = range(len(fed["steps"])) if args.step is None else [args.step]
    print(f"{args.system}, pp {p}, m {m}, round {args.round}, {raw['cores']} cores")
    for i in steps:
        print(f"-- step {i}")
        print(report(fed, i, raw["cores"]))


if __name__ == "__main__":
    main()
