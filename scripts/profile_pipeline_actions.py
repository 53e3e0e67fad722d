"""Inside the pipeline benchmark's ranks: each F / B / W action's thread CPU time, minor page faults and
weight-gradient GEMM time, per stage, our 1f1b against a split-backward schedule (zb_h1 by default).

Why: ``bench_pipeline.py``'s (B+W)/B compares a split backward's B + W with 1f1b's B inside a
running pipeline, where an action also pays for what the others left behind (the C heap's state,
the cache). This runs the benchmark's process group (``bench_pipeline_group.run_group``: same
model, shapes, alternation of the schedules step by step) with each ``StepRun`` computation
wrapped: CPU time (``time.thread_time``: the executor thread's own, no preemption), minor faults
(``getrusage(RUSAGE_THREAD)``: pages the kernel zero-filled for it) and the time inside
``linear_weight_grads`` (the weight-gradient GEMMs, deferred or not), in ``W``'s direct
accumulation (``leaf_grads.accumulate_each``, one call per closure) and in ``torch.autograd.backward``
(the graph walk).
Medians per action after the first step (its allocations fault in either way). Prints per stage
each kind's numbers, (B+W)/B against the plain 1f1b's B (as ``bench_pipeline.py``), and where
B + W - B goes (``_breakdown``: GEMMs, the rest of the walk, W's accumulation, W's other work, and
work outside autograd such as a graph freed inside the action).

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

import torch  # noqa: E402

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
    samples: dict[str, list[tuple[float, int, float, float, float]]] = {}
    in_gemms, in_accumulate, in_autograd = [0.0], [0.0], [0.0]
    gemms, accumulate = deferrable_linear.linear_weight_grads, deferred_grads.accumulate_each
    backward = torch.autograd.backward

    def timed_gemms(*a):
        t0 = time.thread_time()
        try:
            return gemms(*a)
        finally:
            in_gemms[0] += time.thread_time() - t0

    def timed_accumulate(params, grads) -> None:
        t0 = time.thread_time()
        accumulate(params, grads)
        in_accumulate[0] += time.thread_time() - t0

    def timed_backward(*a, **k):
        t0 = time.thread_time()
        try:
            return backward(*a, **k)
        finally:
            in_autograd[0] += time.thread_time() - t0

    deferrable_linear.linear_weight_grads = timed_gemms
    deferred_grads.accumulate_each = timed_accumulate
    # every backward in the ranks (1f1b's B, a split B, a first chunk's whole backward at W) goes through it
    torch.autograd.backward = timed_backward

    def wrap(name: str) -> None:
        inner = getattr(step_run.StepRun, name)

        def measured(self, c) -> None:
            in_gemms[0] = in_accumulate[0] = in_autograd[0] = 0.0
            faults, t0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
            inner(self, c)
            spent, faults = time.thread_time() - t0, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
            key = f"{_layout(self.engine)}|{self.engine.pstate.coord('pp')}|{c.kind}"
            samples.setdefault(key, []).append((spent, faults, in_gemms[0], in_accumulate[0], in_autograd[0]))

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


def _layout(engine) -> str:
    """The benchmark's name for an engine's layout, less "ours ": 1f1b's two runs (its drain split by
    ``parallel.split_drain`` or not, "plain") are different work and are kept apart."""
    plain = engine.schedule_name == "1f1b" and not engine.split_drain
    return engine.schedule_name + (" plain" if plain else "")


# Per action: thread CPU, minor faults, then CPU inside: the weight GEMMs, W's direct accumulation, and
# torch.autograd.backward (a 1f1b or split B's graph walk, GEMMs run there included; a first chunk's W).
_PARTS = ("cpu", "faults", "gemms", "accumulate", "autograd")


def _breakdown(b_full: list[float], b: list[float], w: list[float]) -> dict[str, float]:
    """Where a split backward's B + W differs from one full backward (medians per action, seconds):
    the weight GEMMs; the rest of autograd's walk (accumulating the undeferred parameters and, in the full
    backward, the deferred ones); W's accumulation; W's other work (its queue, closures, Python); an
    action's work outside autograd (a B's graph freed as its output goes, its bookkeeping). The five sum
    to B + W - full B."""
    g_full, g_b, g_w = b_full[2], b[2], w[2]
    walk_full, walk_b, walk_w = b_full[4] - g_full, b[4] - g_b, max(w[4] - g_w, 0.0)
    w_rest = w[0] - w[3] - g_w - walk_w
    return {"gemms": g_b + g_w - g_full, "autograd walk": walk_b + walk_w - walk_full, "W accumulate": w[3],
            "W other": w_rest, "outside autograd": (b[0] - b[4]) - (b_full[0] - b_full[4])}


def _report(samples: dict[str, list], stages: int, schedule: str, skip: int) -> None:
    base_name = "1f1b plain"  # one full backward, as bench_pipeline's ratio
    for st in range(stages):
        med = {}
        for sched in (base_name, schedule):
            for kind in "FBW":
                got = samples.get(f"{sched}|{st}|{kind}", [])[skip:]
                if got:
                    med[(sched, kind)] = [statistics.median(x[i] for x in got) for i in range(len(_PARTS))]
        print(f"stage {st}:")
        for (s, k), v in med.items():
            print(f"   {s:>10} {k} {1e6 * v[0]:6.0f} us ({v[1]:.0f} faults; GEMMs {1e6 * v[2]:.0f}, accumulate "
                  f"{1e6 * v[3]:.0f}, in autograd.backward {1e6 * v[4]:.0f})")
        base, b, w = med[(base_name, "B")], med[(schedule, "B")], med.get((schedule, "W"), [0.0] * len(_PARTS))
        # the benchmark's ratio is of means: rare long actions (a collection, a fault burst) count there
        mean = {(s, k): statistics.fmean(x[0] for x in samples[f"{s}|{st}|{k}"][skip:]) if (s, k) in med else 0.0
                for s, k in ((base_name, "B"), (schedule, "B"), (schedule, "W"))}
        of_means = (mean[(schedule, "B")] + mean[(schedule, "W")]) / mean[(base_name, "B")]
        parts = _breakdown(base, b, w)
        print(f"   (B+W)/B {(b[0] + w[0]) / base[0]:.3f} (of means {of_means:.3f}); B + W - full B = "
              f"{1e6 * (b[0] + w[0] - base[0]):.0f} us: "
              + ", ".join(f"{name} {1e6 * v:+.0f}" for name, v in parts.items()))


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
