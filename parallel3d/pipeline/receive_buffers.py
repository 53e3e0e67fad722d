"""Receive buffers of a pipeline's one message shape and dtype, reused across receives and steps.

Buffers are preallocated on first need and reused: a buffer takes a new receive only once
nothing outside the pool shares its storage any more (the received activation, saved by
autograd for the backward, or the received gradient, consumed by it), so reuse never
overwrites data the stage still needs, whatever the model keeps. On NCCL the receive that
refills a buffer is enqueued after the compute that last read it (ProcessGroupNCCL orders
its stream after the current one), so the reuse is stream-safe too.
"""

from __future__ import annotations

from typing import Protocol

import torch


class MessageShape(Protocol):
    """What a pool needs of ``p2p.MessageSpec`` (named structurally: ``p2p`` imports this module)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``t``'s storage right now."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class ReceiveBuffers:
    """Receive buffers of one message shape and dtype, reused across receives and steps.

    Invariant: ``acquire`` returns a buffer that is either new or shares its storage with no
    tensor outside this pool; receivers get a ``detach()``ed alias (``hand_out``), so their
    tensor (its ``requires_grad``, ``.grad``, saved-for-backward references) keeps the storage
    busy exactly as long as anything uses it. Holds at most the peak number of receives alive
    at once (what allocating per receive holds at its peak too).
    """

    def __init__(self, spec: MessageShape, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self._buffers: list[torch.Tensor] = []
        self._posted: set[int] = set()  # ids of buffers a receive is posted into, not yet handed out
        self._alone: int | None = None  # _storage_users of a buffer nobody else uses
        self._next = 0  # where the next search starts
        self.allocated = 0

    def acquire(self) -> torch.Tensor:
        # Round robin from the one after the last taken: pipelines free receives in about the
        # order they arrived, so the first buffer looked at is usually free (one use-count check).
        buffers, posted, alone = self._buffers, self._posted, self._alone
        n = len(buffers) if alone is not None and alone >= 0 else 0
        for k in range(self._next, self._next + n):
            buf = buffers[k % n]
            if id(buf) not in posted and _storage_users(buf) == alone:
                posted.add(id(buf))
                self._next = k % n + 1
                return buf
        buf = torch.empty(self.spec.shape, dtype=self.spec.dtype, device=self.device)
        if self._alone is None:
            try:
                self._alone = _storage_users(buf)
            except (AttributeError, RuntimeError):  # no use count in this torch: never reuse
                self._alone = -1
        self.allocated += 1
        self._buffers.append(buf)
        self._posted.add(id(buf))
        return buf

    def hand_out(self, buf: torch.Tensor) -> torch.Tensor:
        """The received tensor for the caller (an alias: the pool can tell when it is dropped)."""
        self._posted.discard(id(buf))
        return buf.detach()
