"""This process's view of the layout: its coordinates and its process groups.

``ParallelState`` is created once per process from a ``Topology`` and the rank,
and handed to every component that communicates (no module globals). It
creates every group of more than one rank of every kind (``topology.GROUP_KINDS``)
with ``new_group``, in the same order on all ranks as torch.distributed requires,
once per distinct rank list, and keeps the ones this rank is in. Sizes and
coordinates are asked by dimension name: ``size("tp")``, ``coord("dp")``.

A single-process state (world size 1, torch.distributed not initialised) is
valid: all groups are ``None`` and every size is 1, and the communication
helpers treat a size-1 group as a no-op. That is how the single-process
reference model runs through exactly the same code.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from parallel3d.comm_stats import CommStats
from parallel3d.p2p_emulation import EmulatedP2PStreams
from parallel3d.topology import DENSE_DIMS, GROUP_KINDS, Coords, LayoutError, Topology
from parallel3d.deferred_grads import WeightGradDeferral

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
# The default group's rendezvous waits for every rank to start, and ranks start minutes apart on a loaded
# node (each imports torch): a short train.timeout_s must not fail the start-up. Training collectives run on
# the groups ParallelState creates, with train.timeout_s; nothing runs on the default group.
START_TIMEOUT_S = 300.0


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[int, int]:
    """Initialise the default process group from torchrun's env vars (no-op if already done).

    Returns ``(rank, world_size)``. Without ``WORLD_SIZE`` in the environment (a
    plain ``python`` run) nothing is initialised and ``(0, 1)`` is returned.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise LayoutError(f"unsupported backend {backend!r}; use 'gloo' or 'nccl'")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
    start = max(timeout_s, START_TIMEOUT_S)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=start))
    return dist.get_rank(), dist.get_world_size()


class ParallelState:
    """Coordinates and process groups of one rank.

    Invariants: sizes, coordinates and group members come from ``topology`` alone
    (this class does no rank arithmetic of its own). Only groups with more than one
    member are created, and one process group serves every kind with the same rank
    list (e.g. ``etp`` and ``tp`` when etp = tp), so no communicator is duplicated;
    every rank calls ``new_group`` for the same lists in the same order.
    ``group(kind)`` is ``None`` for a one-member group: go through ``comm``, which
    treats it as a no-op (torch would read ``None`` as the whole world).
    ``emulate_nccl`` (tests on gloo) gives p2p batches NCCL's semantics
    (``comm.batch_isend_irecv``).
    ``weight_grads`` is where layers queue weight-gradient work while a zero-bubble ``B``
    is open (``parallel3d.deferred_grads``; idle otherwise).
    """

    def __init__(
        self,
        topology: Topology,
        rank: int | None = None,
        *,
        backend: str | None = None,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        distributed: bool | None = None,
        emulate_nccl: bool = False,
    ) -> None:
        self.topology = topology
        if distributed is None:
            distributed = dist.is_available() and dist.is_initialized()
        self.distributed = distributed
        world = dist.get_world_size() if distributed else 1
        if not distributed and rank is not None:
            world = topology.world_size  # a coordinates-only state (see without_groups)
        topology.check_world_size(world)
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        self.rank = rank
        self.world_size = world
        self.coords: Coords = topology.coords(rank)
        self.backend = backend or (dist.get_backend() if distributed else default_backend())
        if device is None:
            if self.backend == "nccl" and distributed:
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        self.device = torch.device(device)
        self.comm_stats = CommStats()
        # Where layers queue weight-gradient GEMMs while a zero-bubble B is open (the engine opens it).
        self.weight_grads = WeightGradDeferral()
        # Tests on gloo: p2p batches behave as on NCCL (one Work per batch, FIFO per group).
        self.emulate_nccl = bool(emulate_nccl)
        self.emulated_p2p_streams = EmulatedP2PStreams() if self.emulate_nccl else None
        self._ranks = {kind: topology.group_of(kind, rank) for kind in GROUP_KINDS}
        self._groups: dict[str, dist.ProcessGroup | None] = dict.fromkeys(GROUP_KINDS)
        self._created: list[dist.ProcessGroup] = []
        if distributed:
            self._create_groups(datetime.timedelta(seconds=timeout_s) if timeout_s else None, backend)
        if distributed and self.p2p_coalesces and len(self.ranks("pp")) > 1:
            # NCCL creates a group's communicator at its first call, and torch documents a
            # first batch_isend_irecv that not all members join as undefined; the pipeline's
            # first batches involve neighbours only. So connect the pp group here, all together.
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group("pp"))

    def _create_groups(self, timeout: datetime.timedelta | None, backend: str | None) -> None:
        by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for kind in GROUP_KINDS:
            for ranks in self.topology.groups(kind):
                if len(ranks) == 1:
                    continue
                key = tuple(ranks)
                if key not in by_ranks:
                    # Every rank must call new_group for every group, in the same order.
                    by_ranks[key] = dist.new_group(ranks=ranks, timeout=timeout, backend=backend)
                    self._created.append(by_ranks[key])
                if self.rank in ranks:
                    self._groups[kind] = by_ranks[key]

    @property
    def p2p_coalesces(self) -> bool:
        """A p2p batch completes as one unit, in FIFO order per group (NCCL, or its emulation).

        Then ``batch_isend_irecv`` returns one Work per batch, and receives must not be posted
        ahead of need (see ``pipeline.engine``)."""
        return self.backend == "nccl" or self.emulate_nccl

    # ---- groups ------------------------------------------------------------
    def group(self, kind: str) -> "dist.ProcessGroup | None":
        """This rank's process group of ``kind``: ``None`` when not distributed, not a member or alone in it."""
        self._check_kind(kind)
        return self._groups[kind]

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of ``kind`` ([] for a middle stage's embedding group)."""
        self._check_kind(kind)
        return list(self._ranks[kind])

    def _check_kind(self, kind: str) -> None:
        if kind not in self._ranks:
            raise LayoutError(f"unknown group kind {kind!r}; expected one of {tuple(GROUP_KINDS)}")

    # ---- sizes and coordinates -------------------------------------------------
    def size(self, dim: str) -> int:
        """The layout's size along ``dim`` (``tp cp dp pp ep etp edp``), distributed or not."""
        return self.topology.size(dim)

    def coord(self, dim: str) -> int:
        """This rank's coordinate along ``dim``: its index inside its ``dim`` group."""
        return self.topology.coord(dim, self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.topology.is_first_stage(self.rank)

    @property
    def is_last_stage(self) -> bool:
        return self.topology.is_last_stage(self.rank)

    @property
    def next_stage_rank(self) -> int | None:
        return self.topology.next_stage_rank(self.rank)

    @property
    def prev_stage_rank(self) -> int | None:
        return self.topology.prev_stage_rank(self.rank)

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self._ranks["embedding"]

    def is_logging_rank(self) -> bool:
        """The rank that owns the loss: last stage, coordinate 0 in every other dense dimension."""
        return self.is_last_stage and all(self.coord(d) == 0 for d in DENSE_DIMS if d != "pp")

    def destroy(self) -> None:
        """Destroy the groups this state created (all ranks must call it)."""
        for pg in self._created:
            dist.destroy_process_group(pg)
        self._created.clear()

    def __repr__(self) -> str:
        dims = ", ".join(f"{d}={self.coord(d)}/{self.size(d)}" for d in DENSE_DIMS + ("ep",) if self.size(d) > 1)
        return (
            f"ParallelState(rank={self.rank}{', ' if dims else ''}{dims}, backend={self.backend}"
            f"{', emulating nccl' if self.emulate_nccl else ''})"
        )

    @classmethod
    def single_process(cls, device: torch.device | str | None = None) -> "ParallelState":
        """The state of a plain, non-distributed run (every size is 1).

        Usable inside a distributed job too (e.g. a test's single-process
        reference model on every rank): it never touches the default group.
        """
        return cls(Topology(), rank=0, distributed=False, backend="gloo", device=device)

    @classmethod
    def without_groups(cls, topology: Topology, rank: int) -> "ParallelState":
        """Coordinates of ``rank`` in ``topology`` with no process groups (collectives are no-ops).

        For planners and meta-device builds of one rank's shard of a huge layout
        on a single machine; never for real training.
        """
        return cls(topology, rank=rank, distributed=False, backend="gloo", device="meta")
