"""Point-to-point transfers between neighbouring pipeline chunks.

Activations travel forward (model chunk k -> k + 1), their gradients backward.
Every message of a pipeline has the same shape, fixed by the config:
``[micro_batch_size, seq_len / tp if sequence_parallel else seq_len, hidden_size]``
and the model's dtype, so no shape handshake is needed. Each TP rank talks to
the TP rank with the same coordinate in the neighbouring stage (hidden states
are replicated over TP, or each rank holds its own sequence shard).

All sends and receives that the schedule lists back to back go out as one
``batch_isend_irecv`` (gloo and NCCL), together with the next few receives of
the schedule (prefetch: their transfer overlaps this rank's compute). Receives
are waited for before the caller uses them, sends at the end of the step
(``wait_sends``), so a send never blocks the sender's next computation. A send's
tensor stays referenced until the send is known to be done: ``release_sent``
drops the finished ones (without blocking) so their storage can be freed early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel3d.pipeline.schedules import Action, stage_and_chunk, virtual_stage

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
                f"data.seq_len={seq_len} is not divisible by parallel.tp={tp_size}, which sequence parallel needs"
            )
        local_seq = seq_len // tp_size if sequence_parallel else seq_len
        return cls((micro_batch_size, local_seq, hidden_size), dtype)


class PipelineP2P:
    """This rank's sends/receives for the actions of its schedule.

    Peers are global ranks asked from the ``Topology``: the chunk after
    (stage s, chunk c) is model chunk ``s + c*p + 1``, which may wrap to stage 0.
    """

    def __init__(self, pstate: "ParallelState", spec: MessageSpec, num_virtual_stages: int = 1) -> None:
        self.pstate = pstate
        self.spec = spec
        self.num_virtual_stages = num_virtual_stages
        self._pending_sends: list[tuple[Action, dist.Work]] = []  # in posting order
        self._posted: dict[Action, tuple] = {}  # receives posted ahead of need: (work, buffer)

    def peer(self, action: Action) -> int:
        """Global rank on the other end of a communication action."""
        p = self.pstate.pp_size
        vs = virtual_stage(self.pstate.pp_rank, action.chunk, p)
        other = vs + 1 if action.kind in ("SEND_ACT", "RECV_GRAD") else vs - 1
        if not (0 <= other < p * self.num_virtual_stages):
            raise ValueError(f"rank {self.pstate.rank}: {action} has no neighbour (model chunk {other})")
        stage, _ = stage_and_chunk(other, p)
        return self.pstate.topology.stage_rank(self.pstate.rank, stage)

    def exchange(
        self,
        sends: list[tuple[Action, torch.Tensor]],
        recvs: list[Action],
        prefetch: list[Action] = (),
    ) -> dict[Action, torch.Tensor]:
        """Post ``sends`` and the receives not yet posted as one batch; return ``recvs`` once arrived.

        Receives are posted in the order ``prefetch`` then ``recvs``, skipping those
        already posted; ``prefetch`` receives are waited for by a later call that names
        them in ``recvs``, so their data moves while this rank computes. The caller
        posts receives in schedule order, so each peer's messages match first in,
        first out.
        """
        ops: list[dist.P2POp] = []
        group = self.pstate.group("pp")
        for action, tensor in sends:
            if tuple(tensor.shape) != self.spec.shape or tensor.dtype != self.spec.dtype:
                raise ValueError(
                    f"rank {self.pstate.rank}: {action} sends shape {tuple(tensor.shape)} {tensor.dtype}, "
                    f"but the pipeline's messages are {self.spec.shape} {self.spec.dtype}"
                )
            tensor = tensor.detach().contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, self.peer(action), group=group))
            self.pstate.comm_stats.add("pp", "send", tensor.numel() * tensor.element_size())
        new_recvs = list(dict.fromkeys(a for a in [*prefetch, *recvs] if a not in self._posted))
        for action in new_recvs:
            buf = torch.empty(self.spec.shape, dtype=self.spec.dtype, device=self.pstate.device)
            ops.append(dist.P2POp(dist.irecv, buf, self.peer(action), group=group))
        received: dict[Action, torch.Tensor] = {}
        try:
            if ops:
                works = dist.batch_isend_irecv(ops)
                self._pending_sends.extend(zip((a for a, _ in sends), works[: len(sends)]))
                for action, work, op in zip(new_recvs, works[len(sends):], ops[len(sends):]):
                    self._posted[action] = (work, op.tensor)
            for action in recvs:
                work, buf = self._posted.pop(action)
                work.wait()
                received[action] = buf
        except RuntimeError as exc:
            what = [str(a) for a, _ in sends] + [str(a) for a in recvs]
            raise RuntimeError(
                f"rank {self.pstate.rank} (pipeline stage {self.pstate.pp_rank}): p2p {what} failed: {exc}"
            ) from exc
        return received

    def wait_sends(self) -> None:
        """Block until every send posted so far has left this rank (all prefetched receives must be used)."""
        if self._posted:
            raise RuntimeError(f"rank {self.pstate.rank}: receives posted but never used: {list(self._posted)}")
        for _, work in self._pending_sends:
            work.wait()
        self._pending_sends.clear()

    def release_sent(self, wait_for_activations: bool = False) -> list[Action]:
        """Forget the sends known to be complete; return their actions.

        A send counts as complete when the backend says so (asynchronous backends) or,
        with ``wait_for_activations``, after blocking on the activation sends. gloo's
        sends are rendezvous (done only once the peer has posted its receive) and report
        completion only from ``wait()``, so on gloo only the blocking form frees anything.
        Dropping a finished send's work releases this layer's reference to its tensor.
        """
        done, still_pending = [], []
        for action, work in self._pending_sends:
            if work.is_completed() or (wait_for_activations and action.kind == "SEND_ACT"):
                work.wait()  # surfaces a failed send now
                done.append(action)
            else:
                still_pending.append((action, work))
        self._pending_sends = still_pending
        return done
