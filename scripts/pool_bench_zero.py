"""Pool ``bench_zero.py`` JSON outputs: every round's paired ratio to DDP (wall and CPU), over all files.

    python scripts/pool_bench_zero.py bench_results/zero40/after_*.json

A run under a shared machine's load swings round by round; pooling the rounds of several runs of the same
code (each round paired with DDP's round in the same launch) narrows the median. Prints, per dp and
method, the number of rounds and the median [quartiles] [min-max] of both ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def pooled_ratios(paths: list[str]) -> dict[tuple[int, str], dict[str, list[float]]]:
    """(dp, method) -> {"wall": [...], "cpu": [...]}: per-round ratios to DDP's same round, every file."""
    out: dict[tuple[int, str], dict[str, list[float]]] = defaultdict(lambda: {"wall": [], "cpu": []})
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["rows"]
        ddp = {r["dp"]: r for r in rows if r["method"] == "ddp"}
        for r in rows:
            base = ddp[r["dp"]]
            out[(r["dp"], r["method"])]["wall"] += [a / b for a, b in zip(r["round_s"], base["round_s"])]
            if r["round_cpu_s"] and base["round_cpu_s"]:
                out[(r["dp"], r["method"])]["cpu"] += [a / b for a, b in zip(r["round_cpu_s"], base["round_cpu_s"])]
    return out


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    q1, med, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return f"{med:.3f} [{q1:.3f}-{q3:.3f}] [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args()
    pooled = pooled_ratios(args.paths)
    print(f"{len(args.paths)} files; per-round ratio to DDP: median [quartiles] [min-max]")
    print(f"{'dp':>3} {'method':<10} {'rounds':>6} {'wall x DDP':>36} {'CPU x DDP':>36}")
    for (dp, method), r in sorted(pooled.items()):
        print(f"{dp:>3} {method:<10} {len(r['wall']):>6} {_summary(r['wall']):>36} {_summary(r['cpu']):>36}")


if __name__ == "__main__":
    main()
