"""Published layout against the layouts the rank check finds faster, step time by column (issue 26).

    python scripts/rank_breakdown.py narayanan21_gpt_39.1b nemotron4_340b_dp32

For each published run id: the layout as both checks price it (``validation.priced_candidate``: unstated
fields completed) and every layout of the rank search (``validation.run_rank_request``: the source's
recompute, ZeRO stage, sequence parallelism, schedules, held degrees, even splits, interleaving depth) that
is predicted faster, each with its step time, its breakdown columns and its peak memory. Reads only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallel3d.planning.planner import Candidate, plan  # noqa: E402
from parallel3d.planning.published import load_published_runs  # noqa: E402
from parallel3d.planning.published_schema import PublishedRun  # noqa: E402
from parallel3d.planning.source_frameworks import run_options  # noqa: E402
from parallel3d.planning.validation import priced_candidate, run_cluster, run_config, run_rank_request  # noqa: E402

GIB = 2**30


def _row(tag: str, cand: Candidate, columns: list[str]) -> str:
    parts = dict(cand.step.breakdown)
    return (f"{tag:4s} {cand.layout.short():62s} {cand.step.step_time_s:8.3f} "
            + " ".join(f"{parts[k]:8.3f}" for k in columns) + f" {cand.peak_bytes / GIB:6.1f}")


def breakdown(run: PublishedRun) -> str:
    run_id = run.id
    config, cluster, options = run_config(run), run_cluster(run), run_options(run)
    published = priced_candidate(run, options, cluster)
    result = plan(config, cluster, run_rank_request(run, config), options)
    columns = [k for k, _ in published.step.breakdown]
    lines = [f"== {run_id}: {result.considered} layouts, {result.fitting} fit, {result.simulated} simulated",
             f"{'':4s} {'layout':62s} {'step s':>8s} " + " ".join(f"{k[:8]:>8s}" for k in columns) + "    GiB",
             _row("pub", published, columns)]
    faster = [c for c in result.ranked if c.step.step_time_s < published.step.step_time_s]
    lines += [_row(str(i), c, columns) for i, c in enumerate(faster, 1)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_ids", nargs="+", metavar="RUN_ID", help="ids from parallel3d/planning/published_runs.yaml")
    args = parser.parse_args(argv)
    runs = {r.id: r for r in load_published_runs()}
    unknown = [i for i in args.run_ids if i not in runs]
    if unknown:
        parser.error(f"unknown run id(s) {', '.join(unknown)}; `python -m parallel3d.planning.published` lists them")
    for run_id in args.run_ids:
        print(breakdown(runs[run_id]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
