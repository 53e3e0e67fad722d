"""One rank's ``ParallelState`` on torch's fake process-group backend, in this process.

torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``) answers every
collective at once without sending anything, but its groups have the real sizes and
ranks: code that asks ``comm.group_size`` / ``group_rank`` (ZeRO sharding, the pipeline's
peers) sees the real job. Only one default group exists per process, so ranks are
visited one after another, each tearing its world down. A step runs on it: every p2p receive
and collective completes at once and leaves its meta output as allocated (right shape and dtype).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology

# The fake backend for meta tensors too: a step's receives and collectives then run on the
# meta device, a receive leaving its (meta) buffer of the pipeline's message shape as it is.
FAKE_BACKEND = "cpu:fake,meta:fake"


def runs_on_nccl(device: str) -> bool:
    """Whether a job with ``train.device=device`` runs its ranks on NCCL (``rank_build``: cuda) rather than gloo
    (``cpu``). A dry run of a cluster job happens off its accelerator, so ``auto`` counts as cuda. The one
    reading of the device off it: ``meta_kernels.job_runs_fused_kernels`` asks here too."""
    return device != "cpu"


@contextmanager
def fake_rank_state(topology: Topology, rank: int, nccl: bool = True) -> Iterator[ParallelState]:
    """``rank``'s state in ``topology``, every group created on the fake backend, device meta; ``nccl``: p2p
    batches complete as one unit, as on NCCL (``ParallelState.p2p_coalesces``), else as on plain gloo."""
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without torch.distributed initialised")
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=topology.world_size)
    try:
        yield ParallelState(topology, rank=rank, backend=FAKE_BACKEND, device="meta", emulate_nccl=nccl)
    finally:
        dist.destroy_process_group()
