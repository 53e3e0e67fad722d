"""A training job run in float64: a test-side cast of ``train.precision=fp32``'s dtype (restored after).

Invariant: with the cast, parameters, activations and gradients (their reduction included) are float64; the
optimizer's master weights and Adam moments stay float32 (``parallel3d.zero.states``). Two layouts whose fp32
runs part by amplified rounding (a top-k near tie, an Adam update of a gradient below ``eps``) agree far closer
in float64; a wrong term keeps them apart by as much as in fp32.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def float64_training() -> Iterator[None]:
    """``fp32`` means float64 inside (rank workers are reused: both settings are restored)."""
    from parallel3d.zero import precision

    fp32, default = precision.DTYPES["fp32"], torch.get_default_dtype()
    precision.DTYPES["fp32"] = torch.float64
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        precision.DTYPES["fp32"] = fp32
        torch.set_default_dtype(default)


def train_float64_on_rank(rank: int, world: int, values: dict) -> list:
    """``run_on_ranks`` target (world 1: in this process): the job's curve in float64 (the logging rank's)."""
    from parallel3d.config import job_from_dict, resolve
    from parallel3d.parallel_state import ParallelState
    from parallel3d.trainer import train
    from tests import layout_run as lr

    rj = resolve(job_from_dict(values), world)
    with float64_training(), lr.silenced(True):
        pstate = ParallelState.single_process() if world == 1 else ParallelState(rj.topology)
        return lr.curve_of(train(rj, pstate).records)
