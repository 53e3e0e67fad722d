"""``python -m parallel3d.dryrun <training keys> dryrun.world_size=N [dryrun.ranks=first,last] [dryrun.json=FILE]``.

Builds the chosen ranks of the real layout on one CPU (fake process groups, meta device) and
prints each one's memory and step; the training keys are ``python -m parallel3d.train``'s
(conf/README.md), the method is in docs/dryrun.md. ``-h`` / ``--help`` prints this text.

Exit status: 0 every chosen rank built; 1 some rank failed (its line names it); 2 the config
(or a ``dryrun.*`` key) is invalid, found before any rank is built. On a terminal, stderr says which
rank is being built and how long each took (a large rank takes seconds to minutes, and the table
comes only once every rank is done); off a terminal stderr carries only the failures.
"""

from __future__ import annotations

import json
import sys
import time

from parallel3d.config import ConfigError, ResolvedJob, resolve
from parallel3d.dryrun.options import DryRunOptions, check_dry_runnable, parse_ranks, split_args
from parallel3d.dryrun.rank_report import RankReport, dry_run_rank
from parallel3d.dryrun.table import format_reports, reports_json
from parallel3d.preflight import check_writable_file
from parallel3d.progress import format_duration, stderr_is_terminal
from parallel3d.topology import LayoutError
from parallel3d.train import compose_job
from parallel3d.user_warnings import one_line_warnings

EXIT_CONFIG, EXIT_FAILED = 2, 1


def prepare(args: list[str]) -> tuple[ResolvedJob, list[int], DryRunOptions]:
    """Everything checked before a rank is built: the job at the real size, the ranks, the JSON path
    (raises ConfigError, LayoutError or ValueError); ``tests/test_readme_commands.py`` calls it too."""
    options, overrides = split_args(args)
    job, _ = compose_job(overrides)
    rj = resolve(job, world_size=options.world_size)  # training's own validation, at the real size
    check_dry_runnable(rj.zero.offload)
    ranks = parse_ranks(options.ranks, options.world_size)
    if options.json:  # written after every rank is built: a bad path must not cost that work
        check_writable_file("dryrun.json", options.json)
    return rj, ranks, options


def _reports(rj: ResolvedJob, ranks: list[int]) -> list[RankReport]:
    """Each rank's report, in order, with a progress line per rank on a terminal (module doc)."""
    show = stderr_is_terminal()
    reports = []
    for i, rank in enumerate(ranks, 1):
        if show:
            print(f"dry run: rank {rank} ({i} of {len(ranks)}): building and stepping", file=sys.stderr, flush=True)
        start = time.perf_counter()
        reports.append(dry_run_rank(rj, rank))
        if show:
            status = "failed" if reports[-1].error else "done"
            print(f"dry run: rank {rank} ({i} of {len(ranks)}): {status} in "
                  f"{format_duration(time.perf_counter() - start)}", file=sys.stderr, flush=True)
    return reports


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(args):  # not a training override: asking for usage is not a config error
        print(__doc__.strip())
        return 0
    try:
        rj, ranks, options = prepare(args)
    except (ConfigError, LayoutError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    with one_line_warnings():
        reports = _reports(rj, ranks)
    print(format_reports(rj, reports))
    if options.json:
        with open(options.json, "w") as fh:
            json.dump(reports_json(rj, reports), fh, indent=2)
    failed = [r.error for r in reports if r.error]
    for line in failed:
        print(f"dry run failed: {line}", file=sys.stderr)
    return EXIT_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
