"""A one-process sweep runs every job, as Hydra's own sweeps do, and then exits 1 if any job failed.

Invariant: in a ``-m`` sweep of one-process jobs, a job that fails prints its ``[rank 0] failed:`` line
and ``train.hydra_app`` returns ``EXIT_FAILED`` instead of ending the process, so the next job still
runs; this Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``) counts those jobs and, once the
sweep is over, prints one line naming them and exits 1. A multi-rank job still ends its process on a
failure (its peers may wait in a collective), and with it the sweep.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback

EXIT_FAILED = 1  # the status of a failed job (``parallel3d.train``'s, which imports it from here)


class SweepStatus(Callback):
    """Counts a sweep's jobs and the ones that returned ``EXIT_FAILED``."""

    def __init__(self) -> None:
        self.jobs = 0
        self.failed: list[str] = []

    def on_job_end(self, config: Any, job_return: JobReturn, **kwargs: Any) -> None:
        self.jobs += 1
        if job_return.status == JobStatus.COMPLETED and job_return.return_value == EXIT_FAILED:
            job = job_return.hydra_cfg.hydra.job if job_return.hydra_cfg is not None else None
            self.failed.append(f"{job.num} ({job.override_dirname})" if job is not None else "?")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self.failed:
            print(f"multirun: {len(self.failed)} of {self.jobs} jobs failed: job {', '.join(self.failed)}; its "
                  f"[rank 0] failed: line is above, the other jobs ran", file=sys.stderr, flush=True)
            sys.exit(EXIT_FAILED)


SWEEP_STATUS_TARGET = f"{SweepStatus.__module__}.{SweepStatus.__qualname__}"  # as ``hydra.callbacks`` names it
