"""Where a pipeline's blocked receives spend their time: stamps of every p2p op on every rank.

Runs our engine (``bench_pipeline.py``'s model and shapes) with ``PipelineP2P.trace`` on, then
matches, per directed pair of ranks, the k-th send with the k-th receive (gloo matches one
pair's messages first in, first out) and splits every blocked wait (entered -> returned) into:

* ``sender``: until the matching send's post began (the peer had not sent yet: a wait the
  schedule and the costs explain, which ``simulate`` sees);
* ``batchmate``: then, until the last peer receive matching a send of the same batch was posted
  (a receive is handed out only once its whole batch completed, and a gloo send completes only
  once its receiver has posted);
* ``delivery``: the rest (the transport: gloo's device threads, the wake-up).

Also counts, per message, whether the receive was posted before the send (the sender then
writes the data in its own post) or after (gloo's rendezvous: the receiver's ready notice wakes
the sender's device thread, which writes it).

    PYTHONPATH=$PWD .venv/bin/python scripts/diag_pipeline_p2p.py --stages 2 --schedules interleaved_1f1b zbv
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_pipeline_group import _batch, _build_chunks  # noqa: E402
from peer_env import RankFailed, free_port, spawn_results  # noqa: E402

Stamp = tuple[str, object, int, float, float, int]


def split_waits(per_rank: dict[int, list[Stamp]]) -> list[dict[str, float]]:
    """Every blocked wait of one step, split as the module doc says; ``per_rank``: rank -> its trace."""
    sends: dict[tuple[int, int], list[Stamp]] = {}
    recvs: dict[tuple[int, int], list[Stamp]] = {}
    for rank, trace in per_rank.items():
        for st in trace:
            if st[0].startswith("SEND"):
                sends.setdefault((rank, st[2]), []).append(st)
            elif st[0].startswith("RECV"):
                recvs.setdefault((st[2], rank), []).append(st)
    by_recv: dict[tuple[int, object], tuple[Stamp, Stamp]] = {}  # (receiver, action) -> (send, receive)
    recv_of_send: dict[tuple[int, object], Stamp] = {}  # (sender, action) -> matching receive
    for (src, dst), sent in sends.items():
        for s, r in zip(sent, recvs.get((src, dst), [])):
            by_recv[(dst, r[1])] = (s, r)
            recv_of_send[(src, s[1])] = r
    rows = []
    for rank, trace in per_rank.items():
        batch_sends: dict[int, list[Stamp]] = {}
        for st in trace:
            if st[0].startswith("SEND"):
                batch_sends.setdefault(st[5], []).append(st)
        for kind, action, _, enter, ret, number in trace:
            if kind != "wait":
                continue
            send, recv = by_recv[(rank, action)]
            own_ready = max(enter, send[3])
            mates = [recv_of_send[(rank, s[1])][3] for s in batch_sends.get(number, [])]
            mate_ready = max([own_ready, *mates])
            rows.append({"blocked": ret - enter, "sender": min(ret, own_ready) - enter,
                         "batchmate": max(0.0, min(ret, mate_ready) - own_ready),
                         "delivery": max(0.0, ret - mate_ready), "recv_late": float(recv[3] > send[3]),
                         "sent_before_wait": float(send[3] < enter), "rank": rank, "action": action,
                         "enter": enter, "ret": ret, "send_began": send[3], "send_end": send[4],
                         "recv_posted": recv[3]})
    late = sum(1 for (s, r) in by_recv.values() if r[3] > s[3])
    for row in rows:
        row["early"], row["late"] = len(by_recv) - late, late
    return rows


def send_lags(per_rank: dict[int, list[Stamp]], computes: dict[int, list]) -> list[float]:
    """Per send: its post's start less the end of the computation that produced it (F for an
    activation, B for a gradient, same microbatch and chunk), on the common clock."""
    lags = []
    for rank, trace in per_rank.items():
        ends = {(a.kind, a.microbatch, a.chunk): e for a, _, e in computes[rank]}
        for kind, action, _, began, _, _ in trace:
            if kind.startswith("SEND"):
                made = ends.get(("F" if kind == "SEND_ACT" else "B", action.microbatch, action.chunk))
                if made is not None:
                    lags.append(began - made)
    return lags


def _worker(rank: int, world: int, port: int, args, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    if args.pin:  # before gloo starts its threads: they inherit the one core
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        from parallel3d.parallel_state import ParallelState
        from parallel3d.pipeline.engine import PipelineEngine
        from parallel3d.topology import Topology

        pstate = ParallelState(Topology(tp=1, pp=world, dp=1))
        microbatches, _, _ = _batch(args, args.microbatches)
        systems = {}  # (schedule, prefetch) -> (engine, its steps)
        for schedule in args.schedules:
            v = 1 if schedule in ("1f1b", "zb_h1") else 2
            chunks = _build_chunks(args, pstate, v, schedule)
            for prefetch in args.prefetch:
                engine = PipelineEngine(chunks, pstate, schedule=schedule, num_microbatches=args.microbatches,
                                        micro_batch_size=args.mbs, seq_len=args.seq, hidden_size=args.hidden,
                                        prefetch_recvs=prefetch)
                systems[(schedule, prefetch)] = (engine, [])
        names = list(systems)
        for i in range(args.warmup + args.steps):
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotate: load hits all alike
                engine, steps = systems[name]
                for c in engine.chunks:
                    c.zero_grad(set_to_none=True)
                engine.p2p.trace = [] if i >= args.warmup else None
                dist.barrier()
                res = engine.run_step(microbatches)
                if i >= args.warmup:
                    steps.append((engine.p2p.trace, res.step_time, res.schedule_wait_time,
                                  [(a, res.start_time + b, res.start_time + e) for a, b, e in res.timeline
                                   if a.is_compute]))
                engine.p2p.trace = None
        got = {name: steps for name, (_, steps) in systems.items()}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (rank, got))
        out.put((rank, "ok", gathered))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1", "interleaved_1f1b", "zbv"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefetch", type=int, nargs="+", default=[None],
                    help="receives posted ahead of need; several: each is a system of its own, steps alternating")
    ap.add_argument("--tails", type=int, default=0, help="print the N longest delivery waits with context")
    ap.add_argument("--pin", action="store_true", help="each rank's threads on one core (rank mod cores)")
    args = ap.parse_args()
    try:  # every rank returns the same all-gathered stamps
        gathered = spawn_results(_worker, args.stages, free_port(), args)[0]
    except RankFailed as failed:
        raise SystemExit(str(failed)) from None
    print(f"load {os.getloadavg()}, pinned {args.pin}, m {args.microbatches}, p {args.stages}")
    names = [(sc, pf) for sc in args.schedules for pf in args.prefetch]
    for schedule in names:
        rows, step_times, waits, lags = [], [], [], []
        for i in range(args.steps):
            per_rank = {rank: got[schedule][i][0] for rank, got in gathered}
            rows += split_waits(per_rank)
            lags += send_lags(per_rank, {rank: got[schedule][i][3] for rank, got in gathered})
            step_times.append(max(got[schedule][i][1] for _, got in gathered))
            waits.append(statistics.fmean(got[schedule][i][2] for _, got in gathered))
        us = {k: [1e6 * r[k] for r in rows] for k in ("blocked", "sender", "batchmate", "delivery")}
        n = len(rows) or 1
        print(f"{schedule[0]:16s} pf {schedule[1]} step {1e3 * statistics.median(step_times):7.2f} ms  sched wait/rank "
              f"{1e3 * statistics.median(waits):6.2f} ms  waits/step {len(rows) / args.steps:5.1f}  "
              + "  ".join(f"{k} sum {sum(v) / args.steps / 1e3:6.2f} ms med {statistics.median(v or [0]):6.0f} "
                          f"p90 {sorted(v)[int(0.9 * (n - 1))] if v else 0:6.0f}" for k, v in us.items())
              + f"  recv early/late {rows[0]['early'] if rows else 0}/{rows[0]['late'] if rows else 0}")
        for flag, late in ((1.0, 0.0), (1.0, 1.0), (0.0, 0.0), (0.0, 1.0)):
            d = [1e6 * r["delivery"] for r in rows
                 if r["sent_before_wait"] == flag and r["recv_late"] == late and r["blocked"] > 0]
            if d:
                print(f"    delivery, sent {'before' if flag else 'after'} the wait began, receive posted "
                      f"{'after' if late else 'before'} the send: n {len(d)} "
                      f"mean {statistics.fmean(d):6.0f} med {statistics.median(d):6.0f} "
                      f"p90 {sorted(d)[int(0.9 * (len(d) - 1))]:6.0f} max {max(d):6.0f} us")
        if args.tails:
            comp = {}  # rank -> its computations on the common clock, this schedule, every step
            for i in range(args.steps):
                for rank, got in gathered:
                    comp.setdefault(rank, []).extend(got[schedule][i][3])

            def doing(rank: int, t: float) -> str:
                for a, b, e in comp[rank]:
                    if b <= t <= e:
                        return f"{a.kind}{a.microbatch}c{a.chunk}@{1e6 * (t - b):.0f}us"
                return "-"
            for r in sorted(rows, key=lambda r: -r["delivery"])[:args.tails]:
                peer = 1 - r["rank"] if args.stages == 2 else -1
                us = {k: 1e6 * (r[k] - r["enter"]) for k in ("send_began", "send_end", "recv_posted", "ret")}
                print(f"    tail {1e6 * r['delivery']:7.0f} us rank {r['rank']} {r['action'].label(True)} "
                      f"sent {'before' if r['sent_before_wait'] else 'after'}: post {us['send_began']:+.0f}.."
                      f"{us['send_end']:+.0f} us, recv posted {us['recv_posted']:+.0f}, woke {us['ret']:+.0f} us from "
                      f"wait; sender at wake: {doing(peer, r['ret']) if peer >= 0 else '?'}, "
                      f"sender at enter: {doing(peer, r['enter']) if peer >= 0 else '?'}")
        base = (schedule[0], args.prefetch[0])
        if schedule != base:
            ratios = [max(got[schedule][i][1] for _, got in gathered) / max(got[base][i][1] for _, got in gathered)
                      for i in range(args.steps)]
            print(f"    step / prefetch {args.prefetch[0]}'s, paired per step: median {statistics.median(ratios):.3f} "
                  f"[{min(ratios):.3f}-{max(ratios):.3f}]")
        if lags:
            us_lags = sorted(1e6 * x for x in lags)
            print(f"    send post after its producing compute: mean {statistics.fmean(us_lags):6.0f} "
                  f"med {statistics.median(us_lags):6.0f} p90 {us_lags[int(0.9 * (len(us_lags) - 1))]:6.0f} "
                  f"max {us_lags[-1]:6.0f} us")


if __name__ == "__main__":
    main()
