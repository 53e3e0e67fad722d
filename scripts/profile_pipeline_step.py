"""One pipeline step's thread CPU by phase on each rank: our 1F1B against torch.pipelining's Schedule1F1B.

Why: at pp 2 the measured bubble already matches the simulator's, so what separates our step from
torch's is work per step or per action outside the schedule's computations. This runs the
benchmark's ranks (``bench_pipeline_group``'s model, partition, init and batch; gloo, one thread
per rank), alternating the two systems step by step, and wraps each system's phase functions
(forward, loss, backward, p2p post / wait, the tied-embedding sum, grad scaling, output merge, ...)
with an exclusive thread-CPU clock (``time.thread_time``: this rank's main thread only, so other
processes sharing the cores do not inflate it; a phase nested in another is taken out of its parent).
The chunk's own forward (``module F``; ours with its loss) and autograd's backward (``autograd B``)
are wrapped inside F and B on both sides, so ``F`` and ``B`` keep only what each executor does around
them; the interpreter's cyclic collections are phases of their own (``gc gen N``).
Per rank and system it prints the median over the measured steps of each phase's CPU ms, calls and
minor page faults per step, ``rest`` (the step's thread CPU outside every wrapped phase: the
executor's own loop, the schedule's bookkeeping), ``other threads`` (the process's CPU less the main
thread's: gloo's threads) and the wall time, for confirmation only.

    PYTHONPATH=$PWD .venv/bin/python scripts/profile_pipeline_step.py --stages 2 --hidden 128 --steps 10

Invariant: both systems run the same chunks' code on the same batch; the wrappers cost two clock
and two ``getrusage`` reads per wrapped call (a few us), on both sides alike.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_pipeline_group import _TorchStage, _batch, _build_chunks, torch_loss_fn  # noqa: E402
from peer_env import free_port, spawn_results  # noqa: E402


class PhaseClock:
    """Exclusive thread-CPU seconds and calls per phase label (a wrapped call nested in another is
    counted in its own phase only: the parent's clock pauses)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.faults: dict[str, int] = {}  # minor page faults (pages the kernel zero-filled for this thread)
        self._stack: list[list[Any]] = []  # [label, when its current stretch began, faults then]

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)
        clock, stack, spent, calls, faults = time.thread_time, self._stack, self.spent, self.calls, self.faults

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            now, flt = clock(), _faults()
            if stack:
                parent = stack[-1]
                spent[parent[0]] = spent.get(parent[0], 0.0) + now - parent[1]
                faults[parent[0]] = faults.get(parent[0], 0) + flt - parent[2]
            frame = [label, now, flt]
            stack.append(frame)
            try:
                return inner(*args, **kwargs)
            finally:
                now, flt = clock(), _faults()
                stack.pop()
                spent[label] = spent.get(label, 0.0) + now - frame[1]
                faults[label] = faults.get(label, 0) + flt - frame[2]
                calls[label] = calls.get(label, 0) + 1
                if stack:
                    stack[-1][1], stack[-1][2] = now, flt

        setattr(owner, name, timed)

    def watch_gc(self) -> None:
        """Count the interpreter's cyclic collections as phases of their own ("gc gen N"), out of
        whichever phase allocated the object that triggered them."""
        stack, spent, calls, faults = self._stack, self.spent, self.calls, self.faults

        def callback(phase: str, info: dict) -> None:
            now, flt = time.thread_time(), _faults()
            if phase == "start":
                if stack:
                    parent = stack[-1]
                    spent[parent[0]] = spent.get(parent[0], 0.0) + now - parent[1]
                    faults[parent[0]] = faults.get(parent[0], 0) + flt - parent[2]
                stack.append([f"gc gen {info['generation']}", now, flt])
                return
            label, began, flt0 = stack.pop()
            spent[label] = spent.get(label, 0.0) + now - began
            faults[label] = faults.get(label, 0) + flt - flt0
            calls[label] = calls.get(label, 0) + 1
            if stack:
                stack[-1][1], stack[-1][2] = now, flt

        gc.callbacks.append(callback)

    def take(self) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
        """This step's phases (CPU seconds, calls, faults), then zeroed for the next."""
        out = (dict(self.spent), dict(self.calls), dict(self.faults))
        for d in (self.spent, self.calls, self.faults):
            d.clear()
        return out


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _instrument(clock: PhaseClock) -> None:
    """Wrap both systems' phase functions in this rank process (ours, then torch.pipelining's)."""
    import parallel3d.pipeline.engine as engine
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage
    from parallel3d.pipeline import p2p, step_run, tied

    ours = [(step_run.StepRun, "forward", "F (+loss)"), (step_run.StepRun, "backward", "B"),
            (step_run.StepRun, "weight_grad", "W (+GEMMs)"),
            (step_run.StepRun, "communicate", "p2p post+wait"), (step_run.StepRun, "release_sent", "release sent"),
            (step_run.StepRun, "record_peak", "record peak"), (p2p.PipelineP2P, "wait_sends", "p2p wait sends"),
            (p2p.PipelineP2P, "post", "p2p post"), (p2p.P2PBatch, "wait", "p2p wait"),
            (tied.TiedGradFinalizer, "finalize", "tied sum"), (engine, "send_loss_to_last_stage", "loss to last"),
            (engine.PipelineEngine, "_check_microbatches", "check inputs"),
            (step_run.StepRun, "__init__", "step setup"),
            (step_run.StepRun, "free_parked_graphs", "free graphs")]
    theirs = [(stage._PipelineStageBase, "forward_one_chunk", "F (+loss)"),
              (schedules.PipelineScheduleSingle, "_maybe_compute_loss", "loss"),
              (stage._PipelineStageBase, "backward_one_chunk", "B"),
              (schedules, "_batch_p2p", "p2p post"), (schedules, "_wait_batch_p2p", "p2p wait"),
              (stage._PipelineStageBase, "scale_grads", "grad scale"),
              (schedules.PipelineScheduleSingle, "_merge_outputs", "merge outputs"),
              (schedules.PipelineScheduleSingle, "_split_inputs", "split inputs"),
              (schedules.PipelineScheduleSingle, "_update_losses", "losses"),
              (stage._PipelineStageBase, "clear_runtime_states", "step setup"),
              (schedules.PipelineScheduleSingle, "_initialize_stage", "step setup")]  # tied sum: ours's wrap
    # Nested in F and B on both sides: the chunk's own forward (ours: with its loss) and autograd's backward.
    from models.transformer import TransformerLM
    both = [(TransformerLM, "forward", "module F"), (torch.autograd, "backward", "autograd B")]
    for owner, name, label in ours + theirs + both:
        clock.wrap(owner, name, label)


def _worker(rank: int, world: int, port: int, args, out) -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        clock = PhaseClock()
        _instrument(clock)
        clock.watch_gc()
        out.put((rank, "ok", _measure(args, world, clock)))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))


def _measure(args, world: int, clock: PhaseClock) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from parallel3d.parallel_state import ParallelState
    from parallel3d.pipeline import tied
    from parallel3d.pipeline.engine import PipelineEngine
    from parallel3d.topology import Topology

    pstate = ParallelState(Topology(tp=1, pp=world, dp=1))
    m, s = args.microbatches, pstate.coord("pp")
    microbatches, inputs, labels = _batch(args, m)
    ours_chunks = _build_chunks(args, pstate, 1)
    engine = PipelineEngine(ours_chunks, pstate, schedule="1f1b", num_microbatches=m, micro_batch_size=args.mbs,
                            seq_len=args.seq, hidden_size=args.hidden)
    torch_chunks = _build_chunks(args, pstate, 1)
    stage = PipelineStage(_TorchStage(torch_chunks[0]), s, world, torch.device("cpu"), group=pstate.group("pp"))
    schedule = Schedule1F1B(stage, m, loss_fn=torch_loss_fn(args.vocab))

    torch_tied = tied.TiedGradFinalizer(torch_chunks, pstate)

    def run_theirs() -> None:  # as bench_pipeline_group runs it
        schedule.step(*((inputs,) if stage.is_first else ()), **({"target": labels, "losses": []} if stage.is_last else {}))
        torch_tied.finalize()

    systems: dict[str, tuple[Callable[[], Any], list]] = {
        "ours 1f1b": (lambda: engine.run_step(microbatches), ours_chunks),
        "torch 1f1b": (run_theirs, torch_chunks)}
    got: dict[str, list[dict]] = {n: [] for n in systems}
    names = list(systems)
    for i in range(args.warmup + args.steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            run, chunks = systems[name]
            for c in chunks:
                c.zero_grad(set_to_none=True)
            dist.barrier()
            clock.take()
            wall, cpu, proc, flt = time.perf_counter(), time.thread_time(), time.process_time(), _faults()
            run()
            cpu, proc, wall = time.thread_time() - cpu, time.process_time() - proc, time.perf_counter() - wall
            flt = _faults() - flt
            spent, calls, faults = clock.take()
            if i >= args.warmup:
                got[name].append({"cpu": cpu, "threads": proc - cpu, "wall": wall, "spent": spent, "calls": calls,
                                  "faults": faults, "step_faults": flt})
    return {"stage": s, "steps": got}


def _report(ranks: dict[int, dict]) -> None:
    for rank in sorted(ranks):
        steps = ranks[rank]["steps"]
        labels = list(dict.fromkeys(k for st in steps.values() for x in st for k in x["spent"]))
        print(f"stage {ranks[rank]['stage']} (rank {rank}): thread CPU ms per step, median over steps "
              f"(calls per step, minor faults per step)")
        print(f"  {'phase':16s}" + "".join(f"{n:<22s}" for n in steps))
        for label in labels:
            cells = []
            for st in steps.values():
                if not any(label in x["spent"] for x in st):
                    cells.append(f"{'-':>9s}             ")
                    continue
                ms = 1e3 * statistics.median(x["spent"].get(label, 0.0) for x in st)
                calls = statistics.median(x["calls"].get(label, 0) for x in st)
                faults = statistics.median(x["faults"].get(label, 0) for x in st)
                cells.append(f"{ms:9.2f} ({calls:4.0f} {faults:5.0f})")
            print(f"  {label:16s}" + "".join(cells))
        rest = {n: 1e3 * statistics.median(x["cpu"] - sum(x["spent"].values()) for x in st) for n, st in steps.items()}
        for label, value in (("rest", rest),
                             ("main thread", {n: 1e3 * statistics.median(x["cpu"] for x in st) for n, st in steps.items()}),
                             ("other threads", {n: 1e3 * statistics.median(x["threads"] for x in st)
                                                for n, st in steps.items()}),
                             ("faults (step)", {n: statistics.median(x["step_faults"] for x in st)
                                                for n, st in steps.items()}),
                             ("wall", {n: 1e3 * statistics.median(x["wall"] for x in st) for n, st in steps.items()})):
            print(f"  {label:16s}" + "".join(f"{value[n]:9.2f}             " for n in steps))
        a, b = list(steps)
        paired = statistics.median(y["cpu"] / x["cpu"] for x, y in zip(steps[a], steps[b]))
        print(f"  paired main-thread CPU {b} / {a}: {paired:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per system")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    start = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ranks = spawn_results(_worker, args.stages, free_port(), args)
    print(f"pp {args.stages}, hidden {args.hidden}, m {args.microbatches}, {args.steps} steps each; {start} -> "
          f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, load {os.getloadavg()[0]:.1f}")
    _report(ranks)


if __name__ == "__main__":
    main()
