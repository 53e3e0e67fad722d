"""One rank's ``ParallelState`` on torch's fake process-group backend, in this process.

torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``) answers every
collective at once without sending anything, but its groups have the real sizes and
ranks: code that asks ``comm.group_size`` / ``group_rank`` (ZeRO sharding, the pipeline's
peers) sees the real job. Only one default group exists per process, so ranks are
visited one after another, each tearing its world down.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology


@contextmanager
def fake_rank_state(topology: Topology, rank: int) -> Iterator[ParallelState]:
    """``rank``'s state in ``topology``, every group created on the fake backend, device meta."""
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without torch.distributed initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=topology.world_size)
    try:
        yield ParallelState(topology, rank=rank, backend="fake", device="meta")
    finally:
        dist.destroy_process_group()
