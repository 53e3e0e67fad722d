"""NCCL's semantics of batched point-to-point ops, emulated on gloo for CPU tests.

NCCL returns one Work per ``batch_isend_irecv`` batch (``CoalescedWork`` here) and runs a
group's batches in FIFO order on one stream (``EmulatedP2PStreams``); gloo returns one
Work per op and runs them independently. ``comm.batch_isend_irecv`` uses these under
``ParallelState(emulate_nccl=True)`` so code that only works with gloo's semantics fails on CPU.
"""

from __future__ import annotations

from typing import Any, Sequence


class CoalescedWork:
    """One Work for every op of a batch, as NCCL's coalescing manager returns.

    ``wait`` waits for all of the batch's ops, each Work once (a second ``wait`` on a
    gloo p2p Work blocks until the group's timeout); ``is_completed`` is true once all
    are (gloo's op Works report completion only from ``wait``).
    """

    def __init__(self, works: Sequence[Any]) -> None:
        self._works = list(works)
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            for work in self._works:
                work.wait() if timeout is None else work.wait(timeout)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)


class EmulatedP2PStreams:
    """NCCL's FIFO order of batched p2p on one group, emulated on the host.

    torch's ProcessGroupNCCL runs a batch (``ncclGroupStart``/``End`` around the ops) on the
    group's communicator and its one NCCL stream, the same key as the group's collectives
    (``getKeyFromDevice``: "for batch P2P, we need to treat it like a collective when
    selecting communicator"), and the coalesced Work records one end event on that stream.
    Kernels on one stream run in order, so a rank's batch starts only after its earlier
    batches on that group completed. The emulation waits for the previous batch before
    posting the next (the host blocks where NCCL's stream would; nothing a peer needs can
    be sent in between, since later sends queue behind that batch on NCCL too).
    """

    def __init__(self) -> None:
        self._last: dict[str, CoalescedWork] = {}

    def before_post(self, kind: str) -> None:
        """Wait for this rank's previous batch on the ``kind`` group (and so for all earlier ones)."""
        last = self._last.pop(kind, None)
        if last is not None:
            last.wait()

    def posted(self, kind: str, work: CoalescedWork) -> None:
        self._last[kind] = work
