"""Side-by-side benchmark: parallel3d's pipeline engine vs torch.distributed.pipelining.

Same model (parallel3d's GPT built by ``build_model``, one chunk per virtual stage),
same batch, same microbatch count, gloo on this machine's CPUs, one thread per rank:

- ``1f1b``: ``PipelineEngine(schedule="1f1b")`` vs ``Schedule1F1B``;
- ``interleaved_1f1b`` (v virtual stages): ours vs ``ScheduleInterleaved1F1B``.

Per case it prints the median step time (slowest rank, after a barrier), the ratio
ours/theirs, the bubble measured from our per-stage busy time, and the bubbles
``simulate`` predicts from our measured per-chunk F/B times: ``sim`` with
``p2p_time`` = the measured time of one activation-sized send/recv (the number
compared with the measurement, since the measured step pays that latency too) and
``sim0`` with zero message latency; plus the theoretical one ((p-1)/(m+p-1), or
(p-1)/(vm+p-1) interleaved). The per-message time comes from the same processes,
group and message shape, measured between the timed steps (every rank sends one
activation to the next stage and receives one from the previous, as in the
steady state). Writes JSON to ``--out``.

    .venv/bin/python scripts/bench_pipeline.py --stages 2 4 --out bench_results/pipeline.json

Note: with more ranks than cores, ranks time-share and "busy" time includes waiting
for a core, so bubbles at p > cores say little about the schedule.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TorchStage(nn.Module):
    """Adapts a parallel3d chunk to torch.distributed.pipelining (tensor in, tensor out)."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x)


def _build_chunks(args, pstate, v: int) -> list[nn.Module]:
    from models import build_model, get_config
    from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges

    cfg = get_config("gpt_tiny", num_layers=args.layers, hidden_size=args.hidden, num_heads=4,
                     vocab_size=args.vocab, max_seq_len=args.seq, fused_kernels=False)
    ranges = stage_layer_ranges(partition_layers(cfg, pstate.pp_size, v), pstate.pp_size, pstate.pp_rank)
    return [build_model(cfg, pstate, seed=0, layer_range=r) for r in ranges]


def _batch(args, m: int) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (m * args.mbs, args.seq + 1), generator=gen)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    mbs = [{"input_ids": inputs[i * args.mbs:(i + 1) * args.mbs], "labels": labels[i * args.mbs:(i + 1) * args.mbs],
            "sample_ids": torch.arange(i * args.mbs, (i + 1) * args.mbs)} for i in range(m)]
    return mbs, inputs, labels


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest stage does
    return elapsed.item()


def _message_time(pstate, shape: tuple[int, ...], reps: int) -> float:
    """Mean seconds of one activation-sized send/recv between neighbouring stages (pp ring)."""
    p, s = pstate.pp_size, pstate.pp_rank
    nxt = pstate.topology.stage_rank(pstate.rank, (s + 1) % p)
    prev = pstate.topology.stage_rank(pstate.rank, (s - 1) % p)
    out, buf = torch.randn(shape), torch.empty(shape)
    group = pstate.pp_group
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt, group=group),
                                            dist.P2POp(dist.irecv, buf, prev, group=group)]):
            work.wait()
    return (time.perf_counter() - start) / reps


def _case(args, pstate, schedule: str, v: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from parallel3d.pipeline.engine import PipelineEngine
    from parallel3d.pipeline.schedules import build_schedule, simulate

    p, m, s = pstate.pp_size, args.microbatches, pstate.pp_rank
    microbatches, inputs, labels = _batch(args, m)
    ours_chunks = _build_chunks(args, pstate, v)
    engine = PipelineEngine(ours_chunks, pstate, schedule=schedule, num_microbatches=m, micro_batch_size=args.mbs,
                            seq_len=args.seq, hidden_size=args.hidden, prefetch_recvs=args.prefetch)
    theirs_chunks = _build_chunks(args, pstate, v)
    stages = [PipelineStage(_TorchStage(c), s + k * p, p * v, torch.device("cpu"), group=pstate.pp_group)
              for k, c in enumerate(theirs_chunks)]
    vocab = args.vocab

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab).float(), target.reshape(-1))

    theirs = (Schedule1F1B(stages[0], m, loss_fn=loss_fn) if v == 1
              else ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn))
    holds_first = any(st.is_first for st in stages)
    holds_last = any(st.is_last for st in stages)

    def run_theirs() -> None:
        step_args = (inputs,) if holds_first else ()
        step_kwargs = {"target": labels, "losses": []} if holds_last else {}
        theirs.step(*step_args, **step_kwargs)

    results: list = []

    def run_ours() -> None:
        results.append(engine.run_step(microbatches))

    ours_t, theirs_t, bubbles, comm, msg_t, tails = [], [], [], [], [], []
    for i in range(args.warmup + args.steps):
        for c in ours_chunks + theirs_chunks:
            c.zero_grad(set_to_none=True)
        t_ours = _timed(run_ours)  # alternate the two so background load hits both alike
        t_theirs = _timed(run_theirs)
        if i >= args.warmup:
            ours_t.append(t_ours)
            theirs_t.append(t_theirs)
            bubbles.append(max(0.0, 1.0 - results[-1].busy_time / t_ours))
            comm.append(results[-1].comm_time / t_ours)
            # Outside the schedule: end-of-step send waits and the tied-embedding all-reduce.
            tails.append((results[-1].step_time - max(end for _, _, end in results[-1].timeline)) / t_ours)
            msg_t.append(_message_time(pstate, engine.spec.shape, args.p2p_reps))
    # Per (stage, chunk) median F/B times from our measured steps, for the simulation.
    own: dict[tuple[str, int], list[float]] = {}
    for res in results[args.warmup:]:
        for action, start, end in res.timeline:
            if action.is_compute:
                own.setdefault((action.kind, action.chunk), []).append(end - start)
    own_med = {k: statistics.median(vals) for k, vals in own.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (s, own_med, statistics.median(bubbles), statistics.median(comm),
                                      statistics.mean(msg_t), statistics.median(tails)))
    times = {(st, kind, c): t for st, med, *_ in gathered for (kind, c), t in med.items()}
    message_time = statistics.mean(g[4] for g in gathered)
    fwd, bwd = (lambda st, c: times[(st, "F", c)]), (lambda st, c: times[(st, "B", c)])
    sim = simulate(build_schedule(schedule, p, m, v), fwd, bwd, p2p_time=message_time)
    sim0 = simulate(build_schedule(schedule, p, m, v), fwd, bwd)
    measured_bubble = statistics.mean(g[2] for g in gathered)
    theory = (p - 1) / (v * m + p - 1)
    ours_med, theirs_med = statistics.median(ours_t), statistics.median(theirs_t)
    return {
        "stages": p, "schedule": schedule, "virtual_stages": v, "microbatches": m,
        "ours_median_s": ours_med, "theirs_median_s": theirs_med, "ratio": ours_med / theirs_med,
        "ours_steps_s": ours_t, "theirs_steps_s": theirs_t,
        "bubble_measured": measured_bubble, "bubble_simulated": sim.bubble_fraction,
        "bubble_simulated_zero_latency": sim0.bubble_fraction, "bubble_theory": theory,
        "p2p_message_s": message_time, "bubble_simulated_uses": "p2p_time=p2p_message_s",
        "p2p_wait_share": statistics.mean(g[3] for g in gathered),
        "after_schedule_share": statistics.mean(g[5] for g in gathered),
        "bubble_rel_diff": abs(measured_bubble - sim.bubble_fraction) / max(sim.bubble_fraction, 1e-12),
    }


def _worker(rank: int, world: int, port: int, args, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        from parallel3d.parallel_state import ParallelState
        from parallel3d.topology import Topology

        pstate = ParallelState(Topology(1, world, 1))
        rows = [_case(args, pstate, "1f1b", 1)]
        if args.virtual > 1 and args.layers >= world * args.virtual and args.microbatches % world == 0:
            rows.append(_case(args, pstate, "interleaved_1f1b", args.virtual))
        out.put((rank, "ok", rows))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))


def run(args, world: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    got = {}
    for _ in range(world):
        rank, status, payload = out.get(timeout=1800)
        if status == "err":
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        got[rank] = payload
    for proc in procs:
        proc.join()
    return got[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=None,
                    help="receives our engine posts ahead of need (default: the engine's choice for the backend)")
    ap.add_argument("--p2p-reps", type=int, default=20, help="send/recv rounds timed after each step")
    ap.add_argument("--out", default="bench_results/pipeline.json")
    args = ap.parse_args()
    rows = []
    for p in args.stages:
        rows += run(args, p)
    header = (f"{'p':>2} {'schedule':<17} {'v':>2} {'m':>3} {'ours s':>8} {'torch s':>8} {'ratio':>6} "
              f"{'msg ms':>6} {'bubble meas':>11} {'sim':>6} {'sim0':>6} {'theory':>6} {'rel diff':>8} {'tail':>5}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['stages']:>2} {r['schedule']:<17} {r['virtual_stages']:>2} {r['microbatches']:>3} "
              f"{r['ours_median_s']:>8.4f} {r['theirs_median_s']:>8.4f} {r['ratio']:>6.2f} "
              f"{r['p2p_message_s'] * 1e3:>6.2f} {r['bubble_measured']:>11.3f} {r['bubble_simulated']:>6.3f} "
              f"{r['bubble_simulated_zero_latency']:>6.3f} {r['bubble_theory']:>6.3f} {r['bubble_rel_diff']:>8.1%} "
              f"{r['after_schedule_share']:>5.1%}")
    print("sim: simulate(p2p_time=msg ms, the measured mean time of one activation send/recv); "
          "sim0: zero latency; rel diff: |meas - sim| / sim; tail: share of the measured step after "
          "the schedule's last action (send waits, tied-embedding all-reduce), idle in 'meas', absent from 'sim'")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    path.write_text(json.dumps({"config": config, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                                "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
