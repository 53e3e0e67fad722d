"""Run the train-options fuzz (tests/train_fuzz.py): drawn layouts with drawn precision and optimizer options.

    python scripts/check_train_fuzz.py              # the whole fuzz (ids 0 .. ALL_CASES - 1)
    python scripts/check_train_fuzz.py --case 3 17  # single cases, by id
    python scripts/check_train_fuzz.py --list       # print the cases without running them
    python scripts/check_train_fuzz.py --max-world 8 --case 600   # layouts of up to 8 ranks (default 4)

Each case trains through the real Trainer on gloo ranks and is compared with one process with the same
options and precision (fp32: within RTOL; bf16 / fp16: within 10 x the half-precision single process's own
distance from the fp32 one, per step), with the fp32 single process, and (fp16) on its skipped steps. An MoE
case in half precision that misses passes only as a top-k near tie (tests/train_fuzz_ties.py), printed as such.
Prints one line per case (JSON to --json). Exits 1 if any case fails.
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

from tests import train_fuzz as tf  # noqa: E402
from tests import train_fuzz_ties as ties  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", type=int, nargs="+", help="case ids to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases, run nothing")
    parser.add_argument("--json", default="bench_results/train_fuzz.json", help="where to write the results")
    parser.add_argument("--cache-dir", default=".cache/parallel3d", help="corpus cache (built once)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--max-world", type=int, default=tf.MAX_WORLD,
                        help="the layouts' world budget (another budget draws other cases for the same ids)")
    args = parser.parse_args()
    cases = [tf.generate(i, args.max_world) for i in args.case] if args.case else tf.all_cases()
    if args.list:
        for c in cases:
            print(f"{c.case_id:>4} world={c.world_size}  {c.name}")
        return 0
    references: dict = {}
    rows, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="p3d-trainfuzz-") as work:
        for case in cases:
            r = ties.run(case, work, args.cache_dir, references, timeout=args.timeout)
            worst = r.same.worst
            print(f"{case.case_id:>4} {'ok' if r.ok else 'FAIL':>4} loss {worst.get('loss', float('nan')):.1e} "
                  f"gnorm {worst.get('grad_norm', float('nan')):.1e} floor {max(r.floors.values(), default=0):.1e} "
                  f"skipped {r.skipped}/{r.reference_skipped} {r.same.seconds:.0f}s  {case.name}", flush=True)
            if r.near_tie:
                print("       " + r.near_tie + " (misses: " + "; ".join(r.problems())[:1000] + ")", flush=True)
            if not r.ok:
                print("       " + "; ".join(r.problems())[:2000], flush=True)
            rows.append({"id": case.case_id, "name": case.name, "ok": r.ok, "worst_rel": worst, "floors": r.floors,
                         "near_tie": r.near_tie, "skipped": r.skipped, "reference_skipped": r.reference_skipped, "problems": r.problems(),
                         "seconds": r.same.seconds})
    failed = sum(not row["ok"] for row in rows)
    print(f"{len(rows) - failed} passed, {failed} failed in {time.perf_counter() - start:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "cases": rows}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
