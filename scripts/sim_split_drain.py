"""Simulated step of 1F1B with its drain split (``parallel.split_drain``) over plain 1F1B, and the control
zb_h1 at lag 0 (every backward split, each W right after its B), for p in 2 3 4 8 and m in 4 8 16.

Costs per computation: F, a full B, a split B and its W (the split's overhead is B + W - full B); the last
stage ``--heavy`` times the others. Defaults: F 1, B 2, split 1.1 + 1.0. The measured hidden-128 costs of
``scripts/profile_pipeline_actions.py`` (docs/benchmarks.md): ``--costs 4.3 8.65 5.30 3.65``.

    .venv/bin/python scripts/sim_split_drain.py [--costs F B Bsplit W] [--heavy 1.3] [--interleaved]

``--interleaved``: the same split for interleaved 1F1B (``parallel.split_drain``; v 2 and 4): each stage's
backwards from the one after its last forward on, but the model's first chunk's, split, W right after B.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.pipeline.actions import Action, Schedule, split_backwards  # noqa: E402
from parallel3d.pipeline.schedules import build_schedule, simulate  # noqa: E402


def step(schedule: Schedule, costs: tuple[float, float, float, float], heavy: float) -> float:
    f, b, b_split, w = costs
    p = len(schedule)
    split = {s: split_backwards(acts) for s, acts in schedule.items()}

    def cost(s: int, a: Action) -> float:
        base = f if a.kind == "F" else w if a.kind == "W" else b_split if (a.microbatch, a.chunk) in split[s] else b
        return base * (heavy if s == p - 1 else 1.0)

    return simulate(schedule, f, b, action_time=cost).makespan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--costs", nargs=4, type=float, default=[1.0, 2.0, 1.1, 1.0], metavar=("F", "B", "BSPLIT", "W"))
    ap.add_argument("--heavy", type=float, default=1.0)
    ap.add_argument("--interleaved", action="store_true")
    args = ap.parse_args()
    costs = tuple(args.costs)
    if args.interleaved:
        print(f"costs F B Bsplit W = {costs}, last stage x{args.heavy}: interleaved split-drain / plain")
        for p in (2, 4, 8):
            for m in (p, 2 * p, 4 * p):
                ratios = [step(build_schedule("interleaved_1f1b", p, m, v, split_drain=True), costs, args.heavy)
                          / step(build_schedule("interleaved_1f1b", p, m, v), costs, args.heavy) for v in (2, 4)]
                print(f"p {p} m {m:2d}: v 2 {ratios[0]:.4f}  v 4 {ratios[1]:.4f}")
        return
    print(f"costs F B Bsplit W = {costs}, last stage x{args.heavy}: split-drain / plain, zb_h1 lag 0 / plain")
    for p in (2, 3, 4, 8):
        for m in (4, 8, 16):
            plain = step(build_schedule("1f1b", p, m), costs, args.heavy)
            drain = step(build_schedule("1f1b", p, m, split_drain=True), costs, args.heavy)
            lag0 = step(build_schedule("zb_h1", p, m, w_lags=(0,) * p), costs, args.heavy)
            print(f"p {p} m {m:2d}: plain {plain:8.2f}  split-drain {drain / plain:.4f}  zb_h1 lag 0 {lag0 / plain:.4f}")


if __name__ == "__main__":
    main()
