"""Side-by-side pipeline benchmark: our engine (1f1b, zb_h1, interleaved) vs torch.distributed.pipelining and DeepSpeed.

Same model (parallel3d's GPT from ``build_model``, the same partition and init for every
system), same batch and microbatch count, gloo on this machine's CPUs, one thread per rank.
Systems: ours ``1f1b`` (the baseline), ``zb_h1``, ``interleaved_1f1b`` (v chunks);
``torch.distributed.pipelining`` ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``; DeepSpeed
``PipelineModule`` + ``train_batch`` (its 1F1B), run by ``peer_deepspeed_pipeline.py`` under
its OWN virtual environment, ``.cache/peers/deepspeed-venv``, which this script creates on
first use (``DS_BUILD_OPS=0 pip install torch==2.13.0 deepspeed``; never a parallel3d
dependency; ``--no-install`` skips the peer instead, ``--peers torch`` leaves it out).

Timing: a step is the slowest rank's time after a barrier. Each round launches our
process group once (ours and torch's systems alternate step by step, the order rotating
every step) and DeepSpeed once (its own processes; the two launches alternate their order
from round to round), so background load hits every system alike. Per system it prints
min / median / max over all measured steps and the ratio of medians to our 1f1b and to the
fastest 1F1B peer; for ours also the measured bubble (1 - busy / step) and the bubble
``simulate`` predicts from our measured per-chunk F/B/W times (``sim``: plus the measured
time of one activation-sized send/recv; ``sim0``: zero latency), and the issue's schedule
target: the simulated bubble of 1f1b vs zb_h1 at F = B = W. Then (``--small-mb-case``, on by
default) the overhead-bound case of issue 27: m = 16 microbatches of one sample each, our 1f1b
against torch.pipelining's Schedule1F1B only, same shapes, same alternation, its own table
with per-round ratios and the target (torch / ours >= 1, paired) marked met or not. Writes
JSON to ``--out`` (``small_mb_rows``, ``small_mb_targets`` for that case).

    .venv/bin/python scripts/bench_pipeline.py --stages 2 4 --rounds 3 --steps 3 --out bench_results/pipeline.json

On a shared or small machine (p > cores) ranks time-share, "busy" includes waiting for a
core, and numbers are noisy: compare ratios of the same run, never absolute times.
DeepSpeed's step also runs its optimizer step (SGD, tiny here); ours and torch's do not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from peer_env import deepspeed_python, free_port, run_peer  # noqa: E402


class _TorchStage(nn.Module):
    """Adapts a parallel3d chunk to torch.distributed.pipelining (tensor in, tensor out)."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x)


def _build_chunks(args, pstate, v: int, schedule: str = "1f1b") -> list[nn.Module]:
    from models import build_model, get_config
    from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
    from parallel3d.pipeline.placement import placement_for

    cfg = get_config("gpt_tiny", num_layers=args.layers, hidden_size=args.hidden, num_heads=4,
                     vocab_size=args.vocab, max_seq_len=args.seq, fused_kernels=False)
    place = placement_for(schedule, pstate.size("pp"), v)
    ranges = partition_layers(cfg, pstate.size("pp"), v)
    total = len(ranges)
    return [build_model(cfg, pstate, seed=0, layer_range=r, pre_process=k == 0, post_process=k == total - 1)
            for k, r in zip(place.chunks_of(pstate.coord("pp")), stage_layer_ranges(ranges, pstate.size("pp"), pstate.coord("pp"),
                                                                                place))]


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that tensor ops create while active and that are still alive; records
    the peak. Observes every op from outside the engine (autograd's backward ops included); a
    storage counts from the op that allocates it until the last tensor an op returned on it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, int] = {}  # storage data pointer -> live tensors on it

    def _gone(self, ptr: int, nbytes: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if ptr not in self._refs:
                    self._refs[ptr] = 0
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                self._refs[ptr] += 1
                weakref.finalize(t, self._gone, ptr, nbytes)
        return out


def _peak_live_bytes(fn) -> int:
    """Peak bytes that ``fn``'s tensor ops allocated and still held (``_LiveBytes``: measured outside
    the engine, gradients included)."""
    with _LiveBytes() as meter:
        fn()
    return meter.peak


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
    p, s = pstate.size("pp"), pstate.coord("pp")
    nxt = pstate.topology.stage_rank(pstate.rank, (s + 1) % p)
    prev = pstate.topology.stage_rank(pstate.rank, (s - 1) % p)
    out, buf = torch.randn(shape), torch.empty(shape)
    group = pstate.group("pp")
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt, group=group),
                                            dist.P2POp(dist.irecv, buf, prev, group=group)]):
            work.wait()
    return (time.perf_counter() - start) / reps


def _compute_medians(results: list) -> dict[tuple[str, int], float]:
    """Per (kind, chunk): the mean measured time of our F / B / W computations (the mean, so that a
    stage's simulated busy time equals its measured one: the bubbles then differ only by waiting)."""
    own: dict[tuple[str, int], list[float]] = {}
    for res in results:
        for action, start, end in res.timeline:
            if action.is_compute:
                own.setdefault((action.kind, action.chunk), []).append(end - start)
    return {k: statistics.fmean(vals) for k, vals in own.items()}


def _group_round(args, pstate, v: int) -> dict:
    """One round in one process group: every system alternates step by step; returns their step times."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from parallel3d.pipeline.engine import PipelineEngine

    p, m, s = pstate.size("pp"), args.microbatches, pstate.coord("pp")
    microbatches, inputs, labels = _batch(args, m)
    vocab = args.vocab

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab).float(), target.reshape(-1))

    systems: dict[str, tuple] = {}  # name -> (run, chunks, results list or None)
    layouts = [("1f1b", 1), ("zb_h1", 1)] + ([("interleaved_1f1b", v)] if v > 1 else [])
    layouts += [("zbv", 2)] if args.layers >= 2 * p else []
    for schedule, vs in layouts:
        if schedule not in args.schedules and schedule != "1f1b":
            continue
        chunks = _build_chunks(args, pstate, vs, schedule)
        engine = PipelineEngine(chunks, pstate, schedule=schedule, num_microbatches=m, micro_batch_size=args.mbs,
                                seq_len=args.seq, hidden_size=args.hidden, prefetch_recvs=args.prefetch)
        results: list = []
        systems[f"ours {schedule}" + (f" v{vs}" if vs > 1 else "")] = (
            (lambda e=engine, r=results: r.append(e.run_step(microbatches))), chunks, results, engine)
    if "torch" in args.peers:
        for vs in sorted({1, v}):
            chunks = _build_chunks(args, pstate, vs)
            stages = [PipelineStage(_TorchStage(c), s + k * p, p * vs, torch.device("cpu"), group=pstate.group("pp"))
                      for k, c in enumerate(chunks)]
            theirs = (Schedule1F1B(stages[0], m, loss_fn=loss_fn) if vs == 1
                      else ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn))
            first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)

            def run_theirs(sched=theirs, first=first, last=last) -> None:
                sched.step(*((inputs,) if first else ()), **({"target": labels, "losses": []} if last else {}))

            name = "torch.pipelining 1f1b" if vs == 1 else f"torch.pipelining interleaved_1f1b v{vs}"
            systems[name] = (run_theirs, chunks, None, None)
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        order = names[i % len(names):] + names[:i % len(names)]  # rotate: background load hits all alike
        for name in order:
            run, chunks, _, _ = systems[name]
            for c in chunks:
                c.zero_grad(set_to_none=True)
            t = _timed(run)
            if i >= args.warmup:
                times[name].append(t)
    out: dict = {"times": times, "ours": {}}
    for name, (run, chunks, results, engine) in systems.items():
        if results is None:
            continue
        measured = results[args.warmup:]
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()
        peak_measured = _peak_live_bytes(run) if args.memory else None
        results.pop()  # the profiled step is not timed
        out["ours"][name] = {
            "schedule": engine.schedule_name, "virtual_stages": engine.num_virtual_stages,
            "bubble": statistics.median(max(0.0, 1.0 - r.busy_time / r.step_time) for r in measured),
            "busy_s": [r.busy_time for r in measured], "step_s": [r.step_time for r in measured],
            "comm": statistics.median(r.comm_time / r.step_time for r in measured),
            "tail": statistics.median((r.step_time - max(e for _, _, e in r.timeline)) / r.step_time
                                      for r in measured),
            "compute": _compute_medians(measured),
            # the executor's own time (neither computing nor blocked in p2p waits) per action
            "executor_us_per_action": statistics.median(1e6 * r.executor_time / r.num_actions for r in measured),
            # the same in this thread's CPU time: preemption on a busy machine and blocking waits excluded
            "executor_cpu_us_per_action": statistics.median(1e6 * r.executor_cpu_time / r.num_actions
                                                            for r in measured),
            "finalize_s": statistics.median(r.finalize_time for r in measured),
            "peak_activation_bytes": max(r.peak_activation_bytes for r in measured),
            "peak_live_bytes_measured": peak_measured,
        }
    out["msg_s"] = _message_time(pstate, next(e for *_, e in systems.values() if e is not None).spec.shape,
                                 args.p2p_reps)
    return out


def _worker(rank: int, world: int, port: int, args, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        from parallel3d.parallel_state import ParallelState
        from parallel3d.topology import Topology

        pstate = ParallelState(Topology(tp=1, pp=world, dp=1))
        v = args.virtual if args.virtual > 1 and args.layers >= world * args.virtual and \
            args.microbatches % world == 0 and "interleaved_1f1b" in args.schedules else 1
        result = _group_round(args, pstate, v)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (pstate.coord("pp"), result["ours"], result["msg_s"]))
        rows = {"times": result["times"], "per_rank": gathered}
        out.put((rank, "ok", rows))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))


def run_group(args, world: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
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


def run_deepspeed(args, py: str, world: int) -> list[float]:
    cmd = [f"--{key}={getattr(args, key)}" for key in ("microbatches", "layers", "hidden", "seq", "mbs", "vocab",
                                                         "steps", "warmup")]
    return run_peer(py, "peer_deepspeed_pipeline.py", [*cmd, f"--stages={world}"])["step_times_s"]


def _simulated(rank_stats: list, name: str, p: int, m: int, msg_s: float) -> tuple[float, float, float]:
    """(measured bubble, simulated with measured message time, simulated at zero latency) for our ``name``."""
    from parallel3d.pipeline.schedules import build_schedule, simulate

    per_stage = {st: ours[name] for st, ours, _ in rank_stats}
    sched = per_stage[0]["schedule"]
    v = per_stage[0]["virtual_stages"]
    med = {(st, kind, c): t for st, o in per_stage.items() for (kind, c), t in o["compute"].items()}

    def fwd(st, c):
        return med[(st, "F", c)]

    def wgt(st, c):
        return med.get((st, "W", c), 0.0)

    def bwd(st, c):  # a whole backward: B, plus W where the schedule splits it
        return med[(st, "B", c)] + wgt(st, c)

    schedule = build_schedule(sched, p, m, v)
    sim = simulate(schedule, fwd, bwd, p2p_time=msg_s, wgrad_time=wgt)
    sim0 = simulate(schedule, fwd, bwd, wgrad_time=wgt)
    # Like simulate(): each stage's idle share of the step's global end (the slowest rank's step),
    # averaged over stages, per step; the median over the round's steps.
    steps = zip(*(zip(o["busy_s"], o["step_s"]) for o in per_stage.values()))
    measured = statistics.median(
        statistics.mean(1.0 - busy / max(st for _, st in step) for busy, _ in step) for step in steps)
    return measured, sim.bubble_fraction, sim0.bubble_fraction


def _split_backward_ratio(per_round_stats: list, name: str) -> float | None:
    """For a split-backward schedule: a microbatch's B + W (mean times, summed over a stage's chunks)
    over our 1f1b's B on the same layers; 1.0: the split costs exactly one backward. Per stage (the
    largest) where the schedule places the layers as 1f1b does; over the whole pipeline for ZB-V,
    whose stages hold other layers. Median over rounds."""
    ratios = []
    for rank_stats in per_round_stats:
        split, base = {}, {}
        for stage, ours, _ in rank_stats:
            own = ours[name]["compute"]
            if not any(kind == "W" for kind, _ in own):
                return None
            split[stage] = sum(t for (kind, _), t in own.items() if kind in ("B", "W"))
            base[stage] = sum(t for (kind, _), t in ours["ours 1f1b"]["compute"].items() if kind == "B")
        if ours[name]["schedule"] == "zbv":
            ratios.append(sum(split.values()) / sum(base.values()))
        else:
            ratios.append(max(split[s] / base[s] for s in split))
    return statistics.median(ratios)


def _stats(values: list[float]) -> dict:
    return {"n": len(values), "min_s": min(values), "median_s": statistics.median(values), "max_s": max(values),
            "steps_s": values}


def bench_stages(args, p: int, ds_py: str | None, case: str = "main") -> list[dict]:
    """Rounds alternate the process-group systems (ours, torch) and DeepSpeed (its own processes)."""
    times: dict[str, list[float]] = {}
    per_round: list[dict[str, list[float]]] = []  # per round: system -> its step times in that round
    per_round_stats = []
    for r in range(args.rounds):
        order = ["group", "deepspeed"] if r % 2 == 0 else ["deepspeed", "group"]
        per_round.append({})
        for what in order:
            if what == "group":
                got = run_group(args, p)
                for name, ts in got["times"].items():
                    times.setdefault(name, []).extend(ts)
                    per_round[-1][name] = ts
                per_round_stats.append(got["per_rank"])
            elif ds_py is not None:
                ts = run_deepspeed(args, ds_py, p)
                times.setdefault("deepspeed PipelineModule 1f1b", []).extend(ts)
                per_round[-1]["deepspeed PipelineModule 1f1b"] = ts
        print(f"[bench] {case} pp={p} round {r + 1}/{args.rounds} done", flush=True)
    base = statistics.median(times["ours 1f1b"])
    peers = [n for n in times if not n.startswith("ours") and "interleaved" not in n]
    fastest_peer = min((statistics.median(times[n]) for n in peers), default=None)
    rows = []
    for name, ts in times.items():
        row = {"stages": p, "microbatches": args.microbatches, "micro_batch_size": args.mbs, "case": case,
               "system": name, **_stats(ts),
               "vs_ours_1f1b": statistics.median(ts) / base,
               "vs_fastest_1f1b_peer": statistics.median(ts) / fastest_peer if fastest_peer else None,
               # Load on a shared machine drifts between launches: the ratio within each round, then
               # the median over rounds, compares systems under the same background load.
               "paired_vs_ours_1f1b": statistics.median(
                   statistics.median(rnd[name]) / statistics.median(rnd["ours 1f1b"])
                   for rnd in per_round if name in rnd),
               "round_medians_s": [statistics.median(rnd[name]) for rnd in per_round if name in rnd],
               "ours_1f1b_round_medians_s": [statistics.median(rnd["ours 1f1b"]) for rnd in per_round if name in rnd]}
        if name.startswith("ours"):
            stats = per_round_stats[-1]
            msg_s = statistics.mean(x[2] for x in stats)
            measured = [_simulated(rs, name, p, args.microbatches, statistics.mean(x[2] for x in rs))
                        for rs in per_round_stats]
            meas = statistics.median(x[0] for x in measured)
            sim = statistics.median(x[1] for x in measured)
            row.update(bubble_measured=meas, bubble_simulated=sim,
                       bubble_simulated_zero_latency=statistics.median(x[2] for x in measured),
                       bubble_rel_diff=abs(meas - sim) / max(sim, 1e-12), p2p_message_s=msg_s,
                       after_schedule_share=statistics.mean(o[name]["tail"] for _, o, _ in stats),
                       executor_us_per_action=statistics.median(
                           o[name]["executor_us_per_action"] for rs in per_round_stats for _, o, _ in rs),
                       executor_cpu_us_per_action=statistics.median(
                           o[name]["executor_cpu_us_per_action"] for rs in per_round_stats for _, o, _ in rs),
                       peak_activation_bytes=max(o[name]["peak_activation_bytes"] for _, o, _ in stats),
                       peak_live_bytes_measured=max((o[name]["peak_live_bytes_measured"] or 0) for _, o, _ in stats),
                       backward_ratio=_split_backward_ratio(per_round_stats, name))
        rows.append(row)
    return rows


def _simulated_unit_bubbles(p: int, m: int) -> dict:
    """The issue's schedule target: bubbles at F = B = W = 1 (a whole backward costs 2)."""
    from parallel3d.pipeline.schedules import build_schedule, simulate

    layouts = [("1f1b", 1), ("zb_h1", 1), ("zbv", 2)] + ([("interleaved_1f1b", 2)] if m % p == 0 else [])
    return {name: simulate(build_schedule(name, p, m, v), 1.0, 2.0).bubble_fraction for name, v in layouts}


def _print_main(rows: list[dict], args, unit: dict) -> None:
    """The main case's two tables and the unit-cost bubbles."""
    header = (f"{'p':>2} {'system':<40} {'min s':>7} {'median s':>8} {'max s':>7} {'/ours1f1b':>9} {'paired':>6} "
              f"{'/peer':>6} "
              f"{'bubble meas':>11} {'sim':>6} {'sim0':>6} {'rel diff':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        bub = (f"{r['bubble_measured']:>11.3f} {r['bubble_simulated']:>6.3f} {r['bubble_simulated_zero_latency']:>6.3f}"
               f" {r['bubble_rel_diff']:>8.1%}") if "bubble_measured" in r else ""
        peer = f"{r['vs_fastest_1f1b_peer']:>6.2f}" if r["vs_fastest_1f1b_peer"] else f"{'-':>6}"
        print(f"{r['stages']:>2} {r['system']:<40} {r['min_s']:>7.4f} {r['median_s']:>8.4f} {r['max_s']:>7.4f} "
              f"{r['vs_ours_1f1b']:>9.2f} {r['paired_vs_ours_1f1b']:>6.2f} {peer} {bub}")
    print(f"m={args.microbatches}; {args.rounds} rounds x {args.steps} measured steps per system, alternating; "
          "/ours1f1b, /peer: ratio of medians to our 1f1b and to the fastest 1F1B peer; paired: median over rounds of "
          "the same ratio within one round; bubble meas: idle share of the slowest rank's step; sim: simulate() with our "
          "measured per-chunk F/B/W and message times; sim0: zero message latency; deepspeed's step includes its "
          "(SGD) optimizer step")
    print()
    head2 = (f"{'p':>2} {'ours':<28} {'exec us/action':>14} {'cpu us/action':>13} {'(B+W)/B':>8} {'act peak MiB':>12} {'live peak MiB':>13}")
    print(head2)
    print("-" * len(head2))
    for r in rows:
        if "executor_us_per_action" not in r:
            continue
        ratio = f"{r['backward_ratio']:>8.3f}" if r["backward_ratio"] is not None else f"{'-':>8}"
        live = f"{r['peak_live_bytes_measured'] / 2**20:>13.2f}" if r["peak_live_bytes_measured"] else f"{'-':>13}"
        print(f"{r['stages']:>2} {r['system']:<28} {r['executor_us_per_action']:>14.1f} "
              f"{r['executor_cpu_us_per_action']:>13.1f} {ratio} "
              f"{r['peak_activation_bytes'] / 2**20:>12.2f} {live}")
    print("exec us/action: the executor's own time (step - computing - blocked in p2p waits - the closing "
          "collectives) per action of the stage's schedule, median over ranks and steps; cpu us/action: the same in "
          "the executor thread's CPU time (no preemption, no blocking waits); (B+W)/B: a split backward's B + W over our 1f1b's B on "
          "the same layers (worst stage; zbv: whole pipeline); act peak: the engine's count of activation bytes "
          "(max over ranks); live peak (--memory): peak bytes tensor ops hold during one step, metered outside the engine "
          "(max over ranks; includes gradients)")
    for p, b in unit.items():
        print(f"simulated bubble at F=B=W (p={p}, m={args.microbatches}): "
              + ", ".join(f"{name} {value:.3f}" for name, value in b.items()))


def _print_small_mb(rows: list[dict], args) -> dict[str, dict]:
    """The overhead-bound case's table; per pp, the issue's target (torch.pipelining's step over
    ours, paired: >= 1, our 1F1B no slower) marked met or not."""
    print()
    print(f"overhead-bound case: m={args.small_mb_microbatches}, micro-batch {args.small_mb_mbs}, "
          f"hidden {args.hidden}, seq {args.seq}; our 1f1b vs torch.pipelining Schedule1F1B")
    head = (f"{'p':>2} {'system':<28} {'min s':>7} {'median s':>8} {'max s':>7} {'/ours1f1b':>9} {'paired':>6} "
            f"{'per-round ratios':<30}")
    print(head)
    print("-" * len(head))
    targets: dict[str, dict] = {}
    for r in rows:
        per_round = [a / b for a, b in zip(r["round_medians_s"], r["ours_1f1b_round_medians_s"])]
        print(f"{r['stages']:>2} {r['system']:<28} {r['min_s']:>7.4f} {r['median_s']:>8.4f} {r['max_s']:>7.4f} "
              f"{r['vs_ours_1f1b']:>9.2f} {r['paired_vs_ours_1f1b']:>6.2f} "
              + " ".join(f"{x:.2f}" for x in per_round))
        if r["system"] == "torch.pipelining 1f1b":
            # their step / ours: >= 1 means our 1F1B is no slower
            targets[f"pp{r['stages']}"] = {"torch_over_ours_paired": r["paired_vs_ours_1f1b"],
                                           "torch_over_ours_per_round": per_round,
                                           "met": r["paired_vs_ours_1f1b"] >= 1.0}
    for pp, t in targets.items():
        print(f"target (issue 27) {pp}, m={args.small_mb_microbatches} mbs={args.small_mb_mbs}: our 1f1b no slower "
              f"than torch.pipelining (paired torch/ours >= 1): {t['torch_over_ours_paired']:.3f} "
              f"{'met' if t['met'] else 'NOT met'}")
    return targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1", "interleaved_1f1b", "zbv"],
                    help="our schedules to time (1f1b always runs: it is the baseline)")
    ap.add_argument("--peers", nargs="*", default=["torch", "deepspeed"], choices=["torch", "deepspeed"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each alternates our group and DeepSpeed")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per system per round")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps per system per round")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="receives our engine posts ahead of need (default: the engine's choice for the backend)")
    ap.add_argument("--p2p-reps", type=int, default=20, help="send/recv rounds timed after the steps")
    ap.add_argument("--peer-venv", default=str(Path(__file__).resolve().parent.parent / ".cache/peers/deepspeed-venv"))
    ap.add_argument("--no-install", action="store_true", help="skip DeepSpeed if its environment is missing")
    ap.add_argument("--memory", action="store_true",
                    help="one more (untimed) step per schedule of ours under torch's profiler: peak live bytes")
    ap.add_argument("--small-mb-case", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the overhead-bound case (issue 27): our 1f1b vs torch.pipelining's "
                         "Schedule1F1B at --small-mb-microbatches microbatches of --small-mb-mbs sample(s), "
                         "same shapes otherwise, alternating steps as above, at every --stages")
    ap.add_argument("--small-mb-only", action="store_true", help="time only the overhead-bound case")
    ap.add_argument("--small-mb-microbatches", type=int, default=16)
    ap.add_argument("--small-mb-mbs", type=int, default=1)
    ap.add_argument("--out", default="bench_results/pipeline.json")
    args = ap.parse_args()
    ds_py = (deepspeed_python(args.peer_venv, args.no_install)
             if "deepspeed" in args.peers and not args.small_mb_only else None)
    rows = []
    for p in args.stages if not args.small_mb_only else ():
        rows += bench_stages(args, p, ds_py)
    small_rows = []
    if args.small_mb_case or args.small_mb_only:
        small = argparse.Namespace(**{**vars(args), "microbatches": args.small_mb_microbatches, "mbs": args.small_mb_mbs,
                                      "schedules": ["1f1b"], "peers": ["torch"]})
        for p in args.stages:
            small_rows += bench_stages(small, p, None, case="small_mb")
    unit = {p: _simulated_unit_bubbles(p, args.microbatches) for p in sorted({*args.stages, 4})}
    if rows:
        _print_main(rows, args, unit)
    small_targets = _print_small_mb(small_rows, args) if small_rows else {}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "peer_venv")}
    path.write_text(json.dumps({"config": config, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "load_average": os.getloadavg(), "unit_cost_bubbles": unit, "rows": rows,
                                "small_mb_rows": small_rows, "small_mb_targets": small_targets},
                               indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
