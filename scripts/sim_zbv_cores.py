"""How much extra work ZB-V may cost and still tie interleaved 1F1B (v = 2), with a core per rank and with
the ranks sharing fewer cores (``simulate_shared``: processor sharing, the bench's ``sim C``).

Work per chunk (half a stage's layers): F 1/2, a whole backward 1 (interleaved: one B; ZB-V: B and W, W
``--w-share`` of it). ZB-V's computations each cost ``x`` times as much (its split backward's and deferred
grads' overhead, the bench's (B+W)/B and F/F); ``break-even`` is the ``x`` at which its step equals
interleaved's. Where ranks outnumber cores the machine is busy nearly all the step whatever the schedule,
so the step is about the total work over the cores and a smaller bubble buys little: the break-even falls
towards 1.

    .venv/bin/python scripts/sim_zbv_cores.py [--stages 2 4] [--microbatches 8 16] [--w-share 0.45]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.pipeline.schedules import build_schedule  # noqa: E402
from parallel3d.pipeline.simulate_shared import simulate_shared  # noqa: E402


def step(name: str, p: int, m: int, cores: int | None, x: float, w_share: float) -> float:
    """Makespan of ``name`` (v 2) at the work above, ZB-V's scaled by ``x``; ``cores`` None: a core per rank."""
    schedule = build_schedule(name, p, m, 2)
    scale = x if name == "zbv" else 1.0
    return simulate_shared(schedule, 0.5 * scale, 1.0 * scale, wgrad_time=w_share * scale, cores=cores).makespan


def break_even(p: int, m: int, cores: int | None, w_share: float) -> float:
    """The ``x`` at which ZB-V's step equals interleaved's (bisection; its step grows with ``x``)."""
    target = step("interleaved_1f1b", p, m, cores, 1.0, w_share)
    lo, hi = 0.5, 2.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step("zbv", p, m, cores, mid, w_share) < target else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="default: this machine's")
    ap.add_argument("--w-share", type=float, default=0.45)
    args = ap.parse_args()
    print(" p  m  cores   zbv/il at equal work   break-even x (ZB-V's work over interleaved's)")
    for p in args.stages:
        for m in args.microbatches:
            for cores in (None, args.cores) if args.cores < p else (None,):
                ratio = step("zbv", p, m, cores, 1.0, args.w_share) / step("interleaved_1f1b", p, m, cores, 1.0,
                                                                             args.w_share)
                print(f"{p:>2} {m:>2} {cores or p:>6}   {ratio:20.3f}   {break_even(p, m, cores, args.w_share):.3f}")


if __name__ == "__main__":
    main()
