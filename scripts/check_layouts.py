"""Run the generated layout-equivalence matrix and print a table (plus JSON).

    python scripts/check_layouts.py            # the CI sample (what `bash scripts/test.sh` runs)
    python scripts/check_layouts.py --all      # the whole matrix (tests/layout_matrix.py: ALL_CASES + CI sample)
    python scripts/check_layouts.py --case 17 10001   # single cases, by id
    python scripts/check_layouts.py --list     # print the cases without running them
    python scripts/check_layouts.py --shapes --all    # odd degrees and model shapes (tests/shape_fuzz.py)
    python scripts/check_layouts.py --shapes --rejected   # what the validator refused on the way, and why

Each case trains through the real Trainer on gloo ranks of this machine and is compared
with the single-process run of the same model, data and global batch: per-step loss and
grad norm within tests/layout_matrix.py:RTOL (1e-5 relative, fp32, dropout on); with --shapes a
case that misses RTOL is judged again, step by step, at max(RTOL, 10 x its own noise floor up to that
step) (tests/noise_floor.py: one more single-process run; the floors are printed and written). Exits 1 if any case fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import layout_matrix as lm  # noqa: E402
from tests import layout_run as lr  # noqa: E402
from tests import noise_floor as nf  # noqa: E402
from tests import shape_fuzz as sf  # noqa: E402


def _row(r: lr.CaseResult) -> str:
    p = r.case.parallel
    status = "ok" if r.ok else "FAIL"
    return (f"{r.case.case_id:>6} {r.case.world_size:>5} {p['tp']:>2} {p['pp']:>2} {p['dp']:>2} {p['zero_stage']:>4} "
            f"{r.worst.get('loss', float('nan')):>9.1e} {r.worst.get('grad_norm', float('nan')):>9.1e} "
            f"{r.worst.get('eval_loss', float('nan')):>9.1e} "
            f"{r.seconds:>6.1f} {status:>4}  {r.case.name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="the whole generated matrix")
    which.add_argument("--case", type=int, nargs="+", help="case ids to run")
    parser.add_argument("--list", action="store_true", help="list the cases, run nothing")
    parser.add_argument("--shapes", action="store_true",
                        help="the odd-shape fuzz (tests/shape_fuzz.py: degrees of 3 and 5, drawn model shapes)")
    parser.add_argument("--rejected", action="store_true",
                        help="with --shapes: list the draws the config validator refused (and its message)")
    parser.add_argument("--json", default="bench_results/layouts.json", help="where to write the results")
    parser.add_argument("--cache-dir", default=".cache/parallel3d", help="corpus cache (built once)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case (rank start-up excluded)")
    args = parser.parse_args()

    gen = sf if args.shapes else lm
    if args.rejected:
        refused = sf.rejections()
        for d in refused:
            print(f"{'CRASH' if d.crashed else 'refused':>7} {d.case.name}\n        {d.error}")
        print(f"{len(refused)} draws refused ({sum(d.crashed for d in refused)} crashed) on the way to "
              f"{sf.ALL_CASES} accepted cases")
        return 1 if any(d.crashed for d in refused) else 0
    if args.case:
        cases = [gen.case_by_id(i) for i in args.case]
    else:
        cases = gen.all_cases() if args.all else gen.ci_sample()
    if args.list:
        for c in cases:
            print(f"{c.case_id:>6} world={c.world_size}  {c.name}")
        return 0

    print(f"{len(cases)} cases; each trains {lm.STEPS} steps and must match 1 process within {lm.RTOL:.0e}",
          flush=True)
    print(f"{'id':>6} {'world':>5} {'tp':>2} {'pp':>2} {'dp':>2} {'zero':>4} {'loss rel':>9} {'gnorm rel':>9} {'eval rel':>9} "
          f"{'sec':>6} {'':>4}  layout", flush=True)
    references: dict = {}
    results = []
    floors: dict[int, dict[int, float]] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="p3d-layouts-") as work:
        for case in cases:
            result = lr.run_case(case, work, args.cache_dir, references, timeout=args.timeout, quiet=True)
            if args.shapes:  # a drawn shape's miss of RTOL: judged again at its own noise floor
                result, floors[case.case_id] = nf.judge(result, os.path.join(work, case.name), args.cache_dir)
            results.append(result)
            print(_row(result), flush=True)
            if floors.get(case.case_id):
                print("        missed RTOL; noise floor by step (judged at 10 x it): "
                      + " ".join(f"{s}:{f:.1e}" for s, f in floors[case.case_id].items()), flush=True)
            if not result.ok:
                print("        " + "; ".join(result.problems())[:2000], flush=True)
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed in {time.perf_counter() - start:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "rtol": lm.RTOL,
                       "steps": lm.STEPS,
                       "cases": [{"id": r.case.case_id, "name": r.case.name, "world_size": r.case.world_size,
                                  "parallel": r.case.parallel, "train": r.case.train, "model": r.case.model,
                                  "ok": r.ok, "worst_rel": r.worst, "seconds": r.seconds, "rtol_by_step": r.rtol_by_step,
                                  "noise_floor_by_step": floors.get(r.case.case_id) or None,
                                  "problems": r.problems()} for r in results]}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
