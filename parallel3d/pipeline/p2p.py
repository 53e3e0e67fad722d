"""Point-to-point transfers between neighbouring pipeline chunks.

Activations travel forward (model chunk k -> k + 1), their gradients backward.
Every message of a pipeline has the same shape, fixed by the config:
``[micro_batch_size, seq_len / tp if sequence_parallel else seq_len, hidden_size]``
and the model's dtype, so no shape handshake is needed. Each TP rank talks to
the TP rank with the same coordinate in the neighbouring stage (hidden states
are replicated over TP, or each rank holds its own sequence shard).

What goes out together is decided by ``actions.comm_plan``: the sends and
receives the schedule lists between two computations go out as one
``comm.batch_isend_irecv``; receives posted ahead of need (prefetch, so their
transfer overlaps this rank's compute) go out as batches of their own.

On plain gloo (no NCCL emulation) a batch's ops are posted one by one on the
group's gloo backend (``send``/``recv`` with the peer's group rank, tag 0): that is
all ``dist.batch_isend_irecv`` does there (gloo does not coalesce), at a third of its
CPU cost (no ``P2POp`` objects, op-list checks or rank translation per op). The
batch is still one ``P2PBatch`` with one Work per op, so what is waited for, and
when, is exactly the batched path's, which ``check_coalesced_progress`` proves
deadlock-free. NCCL (and its emulation) keeps ``comm.batch_isend_irecv``: its
batches must be coalesced, or the ops of one batch could deadlock each other.

A batch is one unit (``P2PBatch``), because NCCL returns one Work for a whole
batch while gloo returns one per op: a received tensor is handed out only after
every Work of its batch has completed, and a batch's sent tensors stay
referenced until the batch is complete. Sends are waited for at the end of the
step (``wait_sends``), so a send never blocks the sender's next computation;
``release_sent`` forgets the batches already complete (without blocking) so
sent storage can be freed early.

Receive buffers are preallocated on first need and reused (``receive_buffers``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from parallel3d import comm
from parallel3d.pipeline.actions import Action
from parallel3d.pipeline.placement import ChunkPlacement
from parallel3d.pipeline.receive_buffers import ReceiveBuffers, _storage_users  # noqa: F401 (tests use both)

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


@dataclass(frozen=True)
class MessageSpec:
    """Shape and dtype of every activation (and gradient) message of this pipeline."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def from_config(
        cls,
        *,
        micro_batch_size: int,
        seq_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        tp_size: int = 1,
        sequence_parallel: bool = False,
    ) -> "MessageSpec":
        if sequence_parallel and seq_len % tp_size:
            raise ValueError(
                f"train.seq_len={seq_len} is not divisible by parallel.tp={tp_size}, which sequence parallel needs"
            )
        local_seq = seq_len // tp_size if sequence_parallel else seq_len
        return cls((micro_batch_size, local_seq, hidden_size), dtype)


@dataclass(slots=True)
class P2PBatch:
    """One posted batch: the backend's Works for it and the tensors they read and write.

    Invariants: ``sends`` stay referenced until ``complete`` (the backend reads them until
    then); a buffer of ``recvs`` is handed out only once ``complete``, i.e. every Work
    of the batch has finished (one Work per op on gloo, one for all on NCCL).
    """

    works: list[Any]
    sends: list[tuple[Action, torch.Tensor]]
    recvs: dict[Action, torch.Tensor] = field(default_factory=dict)
    complete: bool = False
    sends_activation: bool = False  # one of ``sends`` is a SEND_ACT (``release_sent`` may block on it)

    def wait(self) -> None:
        if not self.complete:
            for work in self.works:
                work.wait()
            self.complete = True

    def poll(self) -> bool:
        """Whether the batch is complete, without blocking."""
        if not self.complete and all(work.is_completed() for work in self.works):
            self.wait()  # returns at once; surfaces a failed op now
        return self.complete


def _gloo_backend(pstate: "ParallelState", group: Any) -> Any:
    """gloo's backend of the pp ``group`` where batches may go out op by op: plain gloo, not
    emulating NCCL; None otherwise (NCCL, the emulation, a fake backend, no group)."""
    if group is None or pstate.backend != "gloo" or pstate.p2p_coalesces or not isinstance(group, dist.ProcessGroup):
        return None
    try:  # the backend itself: skips the ProcessGroup's dispatch (private API: the group does the same)
        return group._get_backend(pstate.device)
    except (AttributeError, RuntimeError):
        return group


class PipelineP2P:
    """This rank's sends/receives for the actions of its schedule, one ``P2PBatch`` at a time.

    Peers are global ranks asked from the ``Topology``: the chunk after (stage s, local
    chunk c) is model chunk ``placement.model_chunk(s, c) + 1`` (default placement: the
    loop, where that wraps from the last stage to stage 0). The executor's path is
    ``post`` (one batch) and ``take`` (a received tensor, once its batch is complete);
    ``exchange`` is both in one call.
    """

    def __init__(self, pstate: "ParallelState", spec: MessageSpec, num_virtual_stages: int = 1,
                 placement: ChunkPlacement | None = None, *, direct_gloo: bool = True) -> None:
        self.pstate = pstate
        self.spec = spec
        self.num_virtual_stages = num_virtual_stages
        self.placement = placement or ChunkPlacement(pstate.size("pp"), num_virtual_stages)
        self._sending: list[P2PBatch] = []  # batches with sends not known complete, in posting order
        self._posted: dict[Action, P2PBatch] = {}  # receives posted and not yet handed out
        self.buffers = ReceiveBuffers(spec, pstate.device)
        # Bytes of one message: every send is checked to have the spec's shape and dtype.
        self._message_bytes = torch.Size(spec.shape).numel() * torch.empty((), dtype=spec.dtype).element_size()
        self._peers: dict[tuple[str, int], int] = {}  # (kind, chunk) -> global rank, asked once
        self._group = pstate.group("pp")
        self.wait_time = 0.0  # seconds blocked in waits (take, blocking release_sent, wait_sends)
        # Plain gloo: the backend that posts ops one by one (None: comm.batch_isend_irecv).
        self._direct = _gloo_backend(pstate, self._group) if direct_gloo else None
        self._group_ranks: dict[int, int] = {}  # global rank -> rank in the pp group, asked once
        # Diagnostics (None: off, nothing stamped): per op posted, (kind, action, peer, post began,
        # post returned, batch number); per receive taken, ("wait", action, -1, wait entered, wait
        # returned, its batch's number), on the system-wide ``time.perf_counter`` clock, so ranks'
        # stamps share one axis.
        self.trace: list[tuple[str, Action, int, float, float, int]] | None = None
        self._traced_batches = 0
        self._traced_batch_of: dict[Action, int] = {}  # traced receives not yet taken -> their batch's number

    @property
    def posts_directly(self) -> bool:
        """Whether batches go out op by op on gloo's backend (else as ``comm.batch_isend_irecv``)."""
        return self._direct is not None

    def peer(self, action: Action) -> int:
        """Global rank on the other end of a communication action."""
        key = (action.kind, action.chunk)
        if key not in self._peers:
            self._peers[key] = self._peer(action)
        return self._peers[key]

    def _peer(self, action: Action) -> int:
        place = self.placement
        vs = place.model_chunk(self.pstate.coord("pp"), action.chunk)
        other = vs + 1 if action.kind in ("SEND_ACT", "RECV_GRAD") else vs - 1
        if not (0 <= other < place.total):
            raise ValueError(f"rank {self.pstate.rank}: {action} has no neighbour (model chunk {other})")
        stage = place.stage_of(other)
        if stage == self.pstate.coord("pp"):
            raise ValueError(f"rank {self.pstate.rank}: {action}'s neighbour (model chunk {other}) is on this stage")
        return self.pstate.topology.stage_rank(self.pstate.rank, stage)

    def post(self, sends: Sequence[tuple[Action, torch.Tensor, int]], recvs: Sequence[tuple[Action, int]]) -> None:
        """Post ``sends`` (action, tensor, peer rank) and ``recvs`` (action, peer rank) as one batch."""
        spec_shape, spec_dtype = self.spec.shape, self.spec.dtype
        kept: list[tuple[Action, torch.Tensor]] = []
        nbytes, activation = 0, False
        for action, tensor, _ in sends:
            if tensor.shape != spec_shape or tensor.dtype != spec_dtype:
                raise ValueError(
                    f"rank {self.pstate.rank}: {action} sends shape {tuple(tensor.shape)} {tensor.dtype}, "
                    f"but the pipeline's messages are {spec_shape} {spec_dtype}"
                )
            # An alias: the engine may swap the output's data for a placeholder once posted.
            kept.append((action, tensor.detach().contiguous()))
            nbytes += self._message_bytes
            activation = activation or action.kind == "SEND_ACT"
        acquire = self.buffers.acquire
        buffers = {action: acquire() for action, _ in recvs}
        if not kept and not buffers:
            return
        if kept:
            self.pstate.comm_stats.add("pp", "send", nbytes)
        try:
            if self.trace is not None:
                works = self._post_traced(sends, kept, recvs, buffers)
            elif self._direct is not None:
                works = self._post_direct(sends, kept, recvs, buffers)
            else:
                works = self._post_batched(sends, kept, recvs, buffers)
        except RuntimeError as exc:
            raise self._failed([a for a, _ in kept] + list(buffers), exc) from exc
        batch = P2PBatch(works, kept, buffers, sends_activation=activation)
        if kept:
            self._sending.append(batch)
        posted = self._posted
        for action in buffers:
            posted[action] = batch

    def post_recv(self, action: Action, peer: int) -> None:
        """Post the one receive ``action`` from global rank ``peer`` as a batch of its own (a receive
        posted ahead of need): ``post((), ((action, peer),))``, without the general path's work for
        sends and op lists where a lone untraced receive goes out directly (gloo). Traced, it takes
        ``post``, which stamps it."""
        if self._direct is None or self.trace is not None:
            self.post((), ((action, peer),))
            return
        buf = self.buffers.acquire()
        try:
            work = self._direct.recv([buf], self._rank_in_group(peer), 0)
        except RuntimeError as exc:
            raise self._failed([action], exc) from exc
        self._posted[action] = P2PBatch([work], [], {action: buf})

    def _post_batched(self, sends: Sequence[tuple[Action, torch.Tensor, int]], kept: list[tuple[Action, torch.Tensor]],
                      recvs: Sequence[tuple[Action, int]], buffers: dict[Action, torch.Tensor]) -> list[Any]:
        group = self._group
        ops = [dist.P2POp(dist.isend, tensor, peer, group=group) for (_, tensor), (_, _, peer) in zip(kept, sends)]
        ops += [dist.P2POp(dist.irecv, buffers[action], peer, group=group) for action, peer in recvs]
        return comm.batch_isend_irecv(ops, self.pstate, "pp")

    def _post_direct(self, sends: Sequence[tuple[Action, torch.Tensor, int]], kept: list[tuple[Action, torch.Tensor]],
                     recvs: Sequence[tuple[Action, int]], buffers: dict[Action, torch.Tensor]) -> list[Any]:
        """The batch's ops in the batched path's order (sends, then receives), one gloo Work each."""
        backend = self._direct
        works = []
        for (_, tensor), (_, _, peer) in zip(kept, sends):
            works.append(backend.send([tensor], self._rank_in_group(peer), 0))
        for action, peer in recvs:
            works.append(backend.recv([buffers[action]], self._rank_in_group(peer), 0))
        return works

    def _post_traced(self, sends: Sequence[tuple[Action, torch.Tensor, int]],
                     kept: list[tuple[Action, torch.Tensor]], recvs: Sequence[tuple[Action, int]],
                     buffers: dict[Action, torch.Tensor]) -> list[Any]:
        """The untraced path, stamping each op's post (one op at a time where that path posts op by op)."""
        trace, clock = self.trace, time.perf_counter
        self._traced_batches += 1
        n = self._traced_batches
        if self._direct is None:
            began = clock()
            works = self._post_batched(sends, kept, recvs, buffers)
            end = clock()
            trace += [(a.kind, a, peer, began, end, n) for a, _, peer in sends]
            trace += [(a.kind, a, peer, began, end, n) for a, peer in recvs]
            self._traced_batch_of.update((a, n) for a, _ in recvs)
            return works
        works = []
        for one, (action, _, peer) in zip(kept, sends):
            began = clock()
            works += self._post_direct([(action, one[1], peer)], [one], (), {})
            trace.append((action.kind, action, peer, began, clock(), n))
        for action, peer in recvs:
            began = clock()
            works += self._post_direct((), [], [(action, peer)], buffers)
            trace.append((action.kind, action, peer, began, clock(), n))
        self._traced_batch_of.update((action, n) for action, _ in recvs)
        return works

    def _rank_in_group(self, peer: int) -> int:
        """Global rank ``peer``'s rank in the pp group (asked of torch once per peer)."""
        rank = self._group_ranks.get(peer)
        if rank is None:
            rank = self._group_ranks[peer] = dist.get_group_rank(self._group, peer)
        return rank

    def take(self, action: Action) -> torch.Tensor:
        """The tensor received for ``action`` (posted earlier), once its whole batch is complete."""
        batch = self._posted.pop(action)
        start = end = time.perf_counter()
        if not batch.complete:
            try:
                batch.wait()
            except RuntimeError as exc:
                raise self._failed([action], exc) from exc
            end = time.perf_counter()
            self.wait_time += end - start
        if self.trace is not None and action in self._traced_batch_of:
            self.trace.append(("wait", action, -1, start, end, self._traced_batch_of.pop(action)))
        return self.buffers.hand_out(batch.recvs.pop(action))

    def posted(self, action: Action) -> bool:
        return action in self._posted

    def _failed(self, actions: Sequence[Action], exc: BaseException) -> RuntimeError:
        return RuntimeError(
            f"rank {self.pstate.rank} (pipeline stage {self.pstate.coord('pp')}): p2p {[str(a) for a in actions]} "
            f"failed: {exc}")

    def exchange(
        self,
        sends: list[tuple[Action, torch.Tensor]],
        recvs: Sequence[Action],
        ahead: Sequence[Action] = (),
    ) -> dict[Action, torch.Tensor]:
        """Post ``sends`` and the ``recvs`` not yet posted as one batch; return ``recvs`` once arrived.

        Then each receive of ``ahead`` not yet posted goes out as a batch of its own, to be
        handed out by a later call that names it in ``recvs``. Each receive comes back once
        its whole batch is complete. The caller posts receives in schedule order, so each
        peer's messages match first in, first out.
        """
        self.post([(a, t, self.peer(a)) for a, t in sends],
                  [(a, self.peer(a)) for a in dict.fromkeys(recvs) if a not in self._posted])
        for action in dict.fromkeys(ahead):
            if action not in self._posted and action not in recvs:
                self.post_recv(action, self.peer(action))
        return {action: self.take(action) for action in recvs}

    def wait_sends(self) -> None:
        """Block until every batch posted so far is complete (all posted receives must have been used)."""
        if self._posted:
            raise RuntimeError(f"rank {self.pstate.rank}: receives posted but never used: {list(self._posted)}")
        start = time.perf_counter()
        for batch in self._sending:
            batch.wait()
        self._sending.clear()
        self.wait_time += time.perf_counter() - start

    def release_sent(self, wait_for_activations: bool = False) -> list[Action]:
        """Forget the batches known to be complete; return the actions of their sends.

        A batch counts as complete when the backend says so or, with
        ``wait_for_activations``, after blocking on every batch holding an activation send.
        gloo's sends are rendezvous (done only once the peer has posted its receive) and
        report completion only from ``wait()``, so on gloo only the blocking form frees
        anything; NCCL's Works report completion on their own. Dropping a batch releases
        this layer's references to its sent tensors.
        """
        if not self._sending:
            return []
        done: list[Action] = []
        still: list[P2PBatch] = []
        start = time.perf_counter() if wait_for_activations else 0.0
        # gloo's send and recv Works (the direct path's own) say they are done only from wait(): polling
        # them would only cost a call per op per batch still sending, after every forward (the batches a
        # last stage's gradient sends pile up in, e.g.); a batch waited for (take, or just above) is complete.
        polls = self._direct is None
        for batch in self._sending:
            if wait_for_activations and batch.sends_activation and not batch.complete:
                batch.wait()
            if batch.complete or (polls and batch.poll()):
                done += [a for a, _ in batch.sends]
            else:
                still.append(batch)
        self._sending = still
        if wait_for_activations:
            self.wait_time += time.perf_counter() - start
        return done
