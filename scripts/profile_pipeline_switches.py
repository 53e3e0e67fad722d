"""Where the executor's thread blocks and where it is preempted, per phase of a pipeline step.

``bench_pipeline.py`` counts a rank's time outside its computations and blocked p2p waits as the
executor's own, *runnable* (its ``exec us/action`` wall time is many times its CPU time at pp 4 on 2
cores). Whether that is right is a question of the kernel's context switches: a *voluntary* one is the
thread blocking (not runnable), an *involuntary* one its being preempted (runnable, waiting for a core).
This runs our engine on ``bench_pipeline.py``'s model and shapes and wraps, with the thread's
``getrusage(RUSAGE_THREAD)`` switch counts, wall and CPU clocks, the p2p posts (``PipelineP2P.post``),
the receive takes (``take``: the blocked waits are in there), the computations (``StepRun.forward`` /
``backward`` / ``weight_grad``) and the whole ``run_step``; ``rest`` is the step less those phases.

Per schedule, rank and measured step: wall ms / CPU ms / voluntary / involuntary switches / calls.

    PYTHONPATH=$PWD .venv/bin/python scripts/profile_pipeline_switches.py --stages 4 --microbatches 16
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_pipeline_group import _batch, _build_chunks, _w_lags  # noqa: E402
from peer_env import free_port, spawn_results  # noqa: E402

PHASES = ("post", "take", "F", "B", "W")
Stamp = tuple[float, float, int, int]  # wall, thread CPU, voluntary, involuntary switches


def _stamp() -> Stamp:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return time.perf_counter(), time.thread_time(), r.ru_nvcsw, r.ru_nivcsw


def _counted(fn: Callable, key: str, acc: dict[str, list]) -> Callable:
    """``fn`` adding each call's stamp difference and one call to ``acc[key]``."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before = _stamp()
        try:
            return fn(*args, **kwargs)
        finally:
            after = _stamp()
            total = acc.setdefault(key, [0.0, 0.0, 0, 0, 0])
            for i in range(4):
                total[i] += after[i] - before[i]
            total[4] += 1
    return wrapped


def _worker(rank: int, world: int, port: int, args, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        from parallel3d.parallel_state import ParallelState
        from parallel3d.pipeline import p2p, step_run
        from parallel3d.pipeline.engine import PipelineEngine
        from parallel3d.topology import Topology

        pstate = ParallelState(Topology(tp=1, pp=world, dp=1))
        acc: dict[str, list] = {}
        # the worker's own process: patching the classes here touches no one else's
        for cls, name, key in ((p2p.PipelineP2P, "post", "post"), (p2p.PipelineP2P, "take", "take"),
                               (step_run.StepRun, "forward", "F"), (step_run.StepRun, "backward", "B"),
                               (step_run.StepRun, "weight_grad", "W")):
            setattr(cls, name, _counted(getattr(cls, name), key, acc))
        got: dict[str, dict] = {}
        for schedule in args.schedules:
            v = 2 if schedule in ("zbv", "interleaved_1f1b") else 1
            chunks = _build_chunks(args, pstate, v, schedule)
            engine = PipelineEngine(chunks, pstate, schedule=schedule, num_microbatches=args.microbatches,
                                    micro_batch_size=args.mbs, seq_len=args.seq, hidden_size=args.hidden,
                                    w_lags=_w_lags(args, world, args.microbatches, schedule))
            step = _counted(engine.run_step, "step", acc)
            microbatches, _, _ = _batch(args, args.microbatches)
            for i in range(args.warmup + args.steps):
                if i == args.warmup:
                    acc.clear()
                dist.barrier()
                step(microbatches)
            got[schedule] = {k: list(x) for k, x in acc.items()}
            acc.clear()
        out.put((rank, "ok", got))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))


def per_step(counts: dict[str, list]) -> dict[str, list[float]]:
    """A rank's totals per measured step, with ``rest``: the step less the wrapped phases."""
    n = counts["step"][4]
    rows = {k: [x / n for x in counts[k]] for k in ("step", *PHASES) if k in counts}
    rows["rest"] = [rows["step"][i] - sum(rows[k][i] for k in PHASES if k in rows) for i in range(4)] + [0.0]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved_1f1b", "zbv"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    args.virtual, args.prefetch = 2, None  # what _build_chunks / _w_lags read besides the shapes
    got = spawn_results(_worker, args.stages, free_port(), args)
    print(f"pp {args.stages}, m {args.microbatches}, {args.steps} steps, load {os.getloadavg()[0]:.1f}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%H:%M} UTC; per rank and step: wall ms / CPU ms / "
          "voluntary (blocked) / involuntary (preempted) switches / calls")
    for schedule in args.schedules:
        print(f"== {schedule}")
        for rank in sorted(got):
            rows = per_step(got[rank][schedule])
            print(f" rank {rank}: " + "  ".join(f"{k} {r[0] * 1e3:.1f}/{r[1] * 1e3:.1f}/{r[2]:.0f}/{r[3]:.0f}/{r[4]:.0f}"
                                               for k, r in rows.items()))


if __name__ == "__main__":
    main()
