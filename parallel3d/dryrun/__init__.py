"""A dry run of the real job on one CPU: ``python -m parallel3d.dryrun <training keys> dryrun.world_size=N
dryrun.ranks=0,7,last [dryrun.json=FILE]``.

For each chosen rank of the real layout, in this one process: the config is validated as
training validates it (``config.resolve`` at ``dryrun.world_size``), the rank's process groups
are created on torch's fake backend (``fake_world``: nothing communicates), its model chunks
are built on the meta device by the trainer's own ``build_chunks``, its ``ZeroOptimizer`` over
them (the real buffer layout and memory tracker), and its pipeline schedule by
``build_schedule``; ``rank_report`` turns these into bytes and messages per step.
"""

from parallel3d.dryrun.options import DryRunOptions, parse_ranks
from parallel3d.dryrun.rank_report import RankReport, dry_run_rank

__all__ = ["DryRunOptions", "RankReport", "dry_run_rank", "parse_ranks"]
