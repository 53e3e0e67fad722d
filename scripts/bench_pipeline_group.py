"""``bench_pipeline.py``'s systems inside one process group: ours and torch.distributed.pipelining.

Each spawned rank (``_worker``, launched by ``run_group``) builds parallel3d's GPT chunks
(the same partition and init for every system), then times our schedules and torch's
Schedule1F1B / ScheduleInterleaved1F1B step by step, the order rotating every step, and
returns per system its step times (the slowest rank's, after a barrier), its CPU seconds per step
(summed over ranks: ``_timed``) and, for ours,
what the engine measured (busy, per-chunk F/B/W, executor us per action, activation
peaks). Invariant: every system of a round sees the same batch, shapes and background load.
"""

from __future__ import annotations

import datetime
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

from bench_pipeline_bubble import compute_cpu_means, compute_means  # noqa: E402
from bench_pipeline_messages import message_latency, message_time  # noqa: E402
from peer_env import free_port, spawn_results  # noqa: E402


class _TorchStage(nn.Module):
    """Adapts a parallel3d chunk to torch.distributed.pipelining (tensor in, tensor out)."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x)


def _model_config(args):
    from models import get_config

    return get_config("gpt_tiny", num_layers=args.layers, hidden_size=args.hidden, num_heads=4,
                      vocab_size=args.vocab, max_seq_len=args.seq, fused_kernels=False)


def torch_loss_fn(vocab: int):
    """torch.pipelining's ``loss_fn`` for the GPT's logits: the mean token cross entropy our chunks
    compute inside their forward when given labels."""

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab).float(), target.reshape(-1))

    return loss_fn


def _w_lags(args, p: int, m: int, schedule: str) -> tuple[int, ...] | None:
    """zb_h1's W lags for the benchmark's model, as the trainer picks them (``planning.zb_lags``)."""
    if schedule != "zb_h1":
        return None
    from parallel3d.planning.layout import Layout
    from parallel3d.planning.zb_lags import zb_h1_w_lags

    layout = Layout(pp=p, schedule=schedule, micro_batch_size=args.mbs, seq_len=args.seq,
                    global_batch_size=m * args.mbs, precision="fp32")
    return zb_h1_w_lags(_model_config(args), layout)


def _build_chunks(args, pstate, v: int, schedule: str = "1f1b") -> list[nn.Module]:
    from models import build_model
    from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
    from parallel3d.pipeline.placement import placement_for

    cfg = _model_config(args)
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


def _timed(fn) -> tuple[float, float]:
    """(wall seconds of the step: the slowest rank's; CPU seconds of the step summed over ranks).

    The CPU time is the process's (its gloo threads included): the work a system does for a step,
    which, unlike wall time, time-sharing the cores with other ranks or other users does not inflate.
    """
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    cpu = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step ends when the slowest stage does
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    return wall.item(), cpu.item()




def _grad_diff(systems: dict, ours: str, theirs: str) -> float | None:
    """Largest |difference| between the gradients two systems' last steps left (same layers, init and
    batch), over all ranks: ~0 when both did the same work, tied embedding sum included."""
    if ours not in systems or theirs not in systems:
        return None
    worst = 0.0
    for a, b in zip(systems[ours][1], systems[theirs][1]):
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            ga = pa.grad if pa.grad is not None else torch.zeros_like(pa)
            gb = pb.grad if pb.grad is not None else torch.zeros_like(pb)
            worst = max(worst, (ga - gb).abs().max().item())
    value = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _group_round(args, pstate, v: int) -> dict:
    """One round in one process group: every system alternates step by step; returns their step times."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from parallel3d.pipeline.engine import PipelineEngine
    from parallel3d.pipeline.tied import TiedGradFinalizer

    p, m, s = pstate.size("pp"), args.microbatches, pstate.coord("pp")
    microbatches, inputs, labels = _batch(args, m)
    loss_fn = torch_loss_fn(args.vocab)

    systems: dict[str, tuple] = {}  # name -> (run, chunks, results list or None)
    # (schedule, chunks per stage, split_drain); ours 1f1b runs as the default does, its drain split
    # (parallel.split_drain=auto), "ours 1f1b plain" without, so the table shows what the split gains
    layouts = [("1f1b", 1, True), ("1f1b", 1, False), ("zb_h1", 1, False)]
    layouts += [("interleaved_1f1b", v, True)] if v > 1 else []  # its drain split too, as the default runs it
    layouts += [("zbv", 2, False)] if args.layers >= 2 * p else []
    for schedule, vs, split_drain in layouts:
        if schedule not in args.schedules and schedule != "1f1b":
            continue
        chunks = _build_chunks(args, pstate, vs, schedule)
        engine = PipelineEngine(chunks, pstate, schedule=schedule, num_microbatches=m, micro_batch_size=args.mbs,
                                seq_len=args.seq, hidden_size=args.hidden, prefetch_recvs=args.prefetch,
                                w_lags=_w_lags(args, p, m, schedule), split_drain=split_drain)
        results: list = []
        traces: list = []  # per step: this rank's p2p stamps (PipelineP2P.trace), for the in-run latency

        def run_ours(e=engine, r=results, t=traces) -> None:
            # The first step (a warmup one) measures the activation bytes; the timed ones run as the
            # trainer's unlogged steps do, without the accounting's saved-tensor hooks. Every step is
            # stamped (about 1 us per message, inside the executor time the simulator is fed).
            e.p2p.trace = []
            r.append(e.run_step(microbatches, account_activations=not r))
            t.append(e.p2p.trace)
            e.p2p.trace = None

        name = f"ours {schedule}" + (f" v{vs}" if vs > 1 else "") + (" plain" if schedule == "1f1b" and not split_drain else "")
        systems[name] = (run_ours, chunks, results, engine, traces)
    if "torch" in args.peers:
        for vs in sorted({1, v}):
            chunks = _build_chunks(args, pstate, vs)
            stages = [PipelineStage(_TorchStage(c), s + k * p, p * vs, torch.device("cpu"), group=pstate.group("pp"))
                      for k, c in enumerate(chunks)]
            theirs = (Schedule1F1B(stages[0], m, loss_fn=loss_fn) if vs == 1
                      else ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn))
            first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)

            def run_theirs(sched=theirs, first=first, last=last, tied=TiedGradFinalizer(chunks, pstate)) -> None:
                sched.step(*((inputs,) if first else ()), **({"target": labels, "losses": []} if last else {}))
                # torch.pipelining knows nothing of the GPT's tied input/output embedding: a user
                # training it must sum the two copies' gradients after the step, which our engine
                # does in its step (grad_sync.finalize). Same work on both sides, same code (our
                # engine's finaliser, its tied parameters found once).
                tied.finalize()

            name = "torch.pipelining 1f1b" if vs == 1 else f"torch.pipelining interleaved_1f1b v{vs}"
            systems[name] = (run_theirs, chunks, None, None, None)
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu_times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        order = names[i % len(names):] + names[:i % len(names)]  # rotate: background load hits all alike
        for name in order:
            run, chunks, *_ = systems[name]
            for c in chunks:
                c.zero_grad(set_to_none=True)
            t, cpu = _timed(run)
            if i >= args.warmup:
                times[name].append(t)
                cpu_times[name].append(cpu)
    out: dict = {"times": times, "cpu_times": cpu_times, "ours": {},
                 "grad_diff_vs_ours_1f1b": _grad_diff(systems, "ours 1f1b", "torch.pipelining 1f1b")}
    for name, (run, chunks, results, engine, traces) in systems.items():
        if results is None:
            continue
        measured = results[args.warmup:]
        measured_traces = traces[args.warmup:len(results)]
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()
        peak_measured = _peak_live_bytes(run) if args.memory else None
        results.pop()  # the profiled step is not timed
        out["ours"][name] = {
            "schedule": engine.schedule_name, "virtual_stages": engine.num_virtual_stages,
            "w_lags": _w_lags(args, p, m, engine.schedule_name), "split_drain": engine.split_drain,
            "bubble": statistics.median(max(0.0, 1.0 - r.busy_time / r.step_time) for r in measured),
            "busy_s": [r.busy_time for r in measured], "step_s": [r.step_time for r in measured],
            "comm": statistics.median(r.comm_time / r.step_time for r in measured),
            "tail": statistics.median((r.step_time - max(e for _, _, e in r.timeline)) / r.step_time
                                      for r in measured),
            "compute": compute_means(measured),
            "compute_cpu": compute_cpu_means(measured),
            # per step: what bench_pipeline_bubble puts on the ranks' common axis
            "step_times": [(r.start_time, max(e for a, _, e in r.timeline if a.is_compute), r.schedule_wait_time,
                            len(r.compute_cpu), r.busy_time, r.step_time) for r in measured],
            "executor_cpu_per_compute": [r.executor_cpu_time / len(r.compute_cpu) for r in measured],
            # per step: each computation's own wall duration, for a replay in simulate()
            "action_s": [{(a.kind, a.microbatch, a.chunk): e - b for a, b, e in r.timeline if a.is_compute}
                         for r in measured],
            # per step: each computation's (kind, microbatch, chunk, start, end) from the step's start and its
            # thread CPU seconds, for the per-rank timelines (bench_pipeline_timeline.py, ``--raw``)
            "action_spans": [[(a.kind, a.microbatch, a.chunk, b, e) for a, b, e in r.timeline if a.is_compute]
                             for r in measured],
            "action_cpu_s": [{(a.kind, a.microbatch, a.chunk): t for a, t in r.compute_cpu} for r in measured],
            # the executor's own time (neither computing nor blocked in p2p waits) per action
            "executor_us_per_action": statistics.median(1e6 * r.executor_time / r.num_actions for r in measured),
            # the same in this thread's CPU time: preemption on a busy machine and blocking waits excluded
            "executor_cpu_us_per_action": statistics.median(1e6 * r.executor_cpu_time / r.num_actions
                                                            for r in measured),
            "finalize_s": statistics.median(r.finalize_time for r in measured),
            # per measured step: this rank's p2p stamps (bench_pipeline_bubble.in_run_latencies)
            "rank": pstate.rank, "p2p_traces": measured_traces,
            "peak_activation_bytes": max(r.peak_activation_bytes for r in results
                                         if r.peak_activation_bytes is not None),
            "peak_live_bytes_measured": peak_measured,
        }
    shape = next(e for _, _, _, e, _ in systems.values() if e is not None).spec.shape
    out["msg_s"], out["msg_post_s"] = message_latency(pstate, shape, args.p2p_reps)
    out["msg_exchange_s"] = message_time(pstate, shape, args.p2p_reps)
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
        dist.all_gather_object(gathered, (pstate.coord("pp"), result["ours"], result["msg_s"], result["msg_exchange_s"],
                                           result["msg_post_s"]))
        rows = {"times": result["times"], "cpu_times": result["cpu_times"], "per_rank": gathered,
                "grad_diff_vs_ours_1f1b": result["grad_diff_vs_ours_1f1b"]}
        out.put((rank, "ok", rows))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))


def run_group(args, world: int) -> dict:
    """Rank 0's results of one group (``spawn_results``; a failed rank raises ``RankFailed``)."""
    return spawn_results(_worker, world, free_port(), args)[0]
