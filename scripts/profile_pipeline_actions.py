"""Inside the pipeline benchmark's ranks: each F / B / W action's thread CPU time, minor page faults and
weight-gradient GEMM time, per stage, our 1f1b against a split-backward schedule (zb_h1 by default).

Why: ``bench_pipeline.py``'s (B+W)/B compares a split backward's B + W with 1f1b's B inside a
running pipeline, where an action also pays for what the others left behind (the C heap's state,
the cache). This runs the benchmark's process group (``bench_pipeline_group.run_group``: same
model, shapes, alternation of the schedules step by step) with each ``StepRun`` computation
wrapped: CPU time (``time.thread_time``: the executor thread's own, no preemption), minor faults
(``getrusage(RUSAGE_THREAD)``: pages the kernel zero-filled for it) and the time inside
``linear_weight_grads`` (the weight-gradient GEMMs, deferred or not) and, in ``W``, in its direct
accumulation (``leaf_grads.accumulate``). Medians per action after
the first step (its allocations fault in either way). Prints per stage each kind's numbers and
(B+W)/B; B + W less GEMMs against 1f1b's B less GEMMs isolates what is not the GEMMs.

    .venv/bin/python scripts/profile_pipeline_actions.py --stages 2 --hidden 128 --steps 4

Wrapping adds two clock reads and two ``getrusage`` calls per action to every schedule alike.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import parallel3d.deferred_grads as deferred_grads  # noqa: E402
import parallel3d.pipeline.engine as engine_mod  # noqa: E402
import parallel3d.pipeline.step_run as step_run  # noqa: E402
import parallel3d.tensor_parallel.deferrable_linear as deferrable_linear  # noqa: E402
from bench_pipeline_group import run_group  # noqa: E402

OUT_ENV = "P3D_PROFILE_ACTIONS_DIR"  # where each rank writes its samples (set by main, read in the ranks)


def _instrument() -> None:
    """Wrap StepRun's computations and the weight-gradient GEMMs in this process (every spawned rank
    re-imports this module, so each rank instruments itself). Samples: per (schedule, stage, kind),
    (CPU s, minor faults, GEMM CPU s) per action; written after each step."""
    samples: dict[str, list[tuple[float, int, float, float]]] = {}
    in_gemms, in_accumulate = [0.0], [0.0]
    gemms, accumulate = deferrable_linear.linear_weight_grads, deferred_grads.accumulate

    def timed_gemms(*a):
        t0 = time.thread_time()
        try:
            return gemms(*a)
        finally:
            in_gemms[0] += time.thread_time() - t0

    def timed_accumulate(p, grad) -> None:
        t0 = time.thread_time()
        accumulate(p, grad)
        in_accumulate[0] += time.thread_time() - t0

    deferrable_linear.linear_weight_grads = timed_gemms
    deferred_grads.accumulate = timed_accumulate

    def wrap(name: str) -> None:
        inner = getattr(step_run.StepRun, name)

        def measured(self, c) -> None:
            in_gemms[0] = in_accumulate[0] = 0.0
            faults, t0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
            inner(self, c)
            spent, faults = time.thread_time() - t0, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
            key = f"{self.engine.schedule_name}|{self.engine.pstate.coord('pp')}|{c.kind}"
            samples.setdefault(key, []).append((spent, faults, in_gemms[0], in_accumulate[0]))

        setattr(step_run.StepRun, name, measured)

    for name in ("forward", "backward", "weight_grad"):
        wrap(name)
    run_step = engine_mod.PipelineEngine.run_step

    def run_step_and_save(self, *a, **k):
        out = run_step(self, *a, **k)
        Path(os.environ[OUT_ENV], f"rank{self.pstate.rank}.json").write_text(json.dumps(samples))
        return out

    engine_mod.PipelineEngine.run_step = run_step_and_save


if os.environ.get(OUT_ENV):
    _instrument()


def _report(samples: dict[str, list], stages: int, schedule: str, skip: int) -> None:
    for st in range(stages):
        med = {}
        for sched in ("1f1b", schedule):
            for kind in "FBW":
                got = samples.get(f"{sched}|{st}|{kind}", [])[skip:]
                if got:
                    med[(sched, kind)] = [statistics.median(x[i] for x in got) for i in range(4)]
        print(f"stage {st}: " + "  ".join(f"{s} {k} {1e6 * v[0]:.0f} us ({v[1]:.0f} faults, GEMMs {1e6 * v[2]:.0f}"
                                          + (f", accumulate {1e6 * v[3]:.0f})" if k == "W" else ")")
                                          for (s, k), v in med.items()))
        base, b, w = med[("1f1b", "B")], med[(schedule, "B")], med.get((schedule, "W"), [0.0, 0, 0.0, 0.0])
        rest = (b[0] + w[0] - b[2] - w[2]) / max(base[0] - base[2], 1e-12)
        # the benchmark's ratio is of means: rare long actions (a collection, a fault burst) count there
        mean = {(s, k): statistics.fmean(x[0] for x in samples[f"{s}|{st}|{k}"][skip:]) if (s, k) in med else 0.0
                for s, k in (("1f1b", "B"), (schedule, "B"), (schedule, "W"))}
        of_means = (mean[(schedule, "B")] + mean[(schedule, "W")]) / mean[("1f1b", "B")]
        print(f"   (B+W)/B {(b[0] + w[0]) / base[0]:.3f} (of means {of_means:.3f}); "
              f"GEMMs {(b[2] + w[2]) / max(base[2], 1e-12):.3f}; "
              f"the rest {rest:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--schedule", default="zb_h1")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per schedule (after one warmup step)")
    args = ap.parse_args()
    bench = argparse.Namespace(microbatches=args.microbatches, virtual=2, schedules=["1f1b", args.schedule], peers=[],
                               layers=args.layers, hidden=args.hidden, seq=64, mbs=2, vocab=1024, steps=args.steps,
                               warmup=1, prefetch=None, p2p_reps=2, memory=False)
    with tempfile.TemporaryDirectory() as out:
        os.environ[OUT_ENV] = out  # inherited by the spawned ranks
        run_group(bench, args.stages)
        samples: dict[str, list] = {}
        for f in Path(out).glob("rank*.json"):
            samples.update(json.loads(f.read_text()))
    print(f"{args.schedule} vs 1f1b, pp {args.stages}, hidden {args.hidden}, m {args.microbatches}: medians per "
          f"action, thread CPU, after the first step; load {os.getloadavg()[0]:.1f}")
    _report(samples, args.stages, args.schedule, skip=args.microbatches)


if __name__ == "__main__":
    main()
