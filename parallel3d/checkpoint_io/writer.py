"""Saving checkpoints while training goes on: host staging, one background save at a time.

``CheckpointWriter.save(step, pieces, objects, meta)`` (all ranks, at the same step):

1. waits for the previous save, if one is still in flight (at most one at a time);
2. stages: copies this rank's pieces into one reusable host buffer (pinned, with
   ``non_blocking`` copies and a CUDA event on GPU; the optimizer state is never copied
   on the device) and deep-copies the small trainer objects;
3. hands the staged pieces to a background thread, which writes them with DCP
   (``state.write_state``) and commits through ``CheckpointManager.save``: all ranks
   agree on success before rank 0 renames ``step_N.tmp`` to ``step_N``, so ``resume=auto``
   never sees a partial checkpoint; a failure on any rank warns and training goes on.

The background thread communicates only on the writer's own gloo group (never on the
training's groups, which the main thread keeps using). With ``async_save=False`` the
same steps run in the caller, without staging: DCP copies one piece at a time to host.
Host memory: one copy of what this rank writes (its optimizer shard, 12 bytes/param),
kept between saves.
"""

from __future__ import annotations

import copy
import datetime
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from parallel3d.checkpoint import CheckpointManager
from parallel3d.checkpoint_io.compat import STATE_DIR
from parallel3d.checkpoint_io.pieces import TensorPiece
from parallel3d.checkpoint_io.state import write_state

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def checkpoint_group(pstate: "ParallelState", timeout_s: float) -> "dist.ProcessGroup | None":
    """A gloo group of the whole job for checkpoint I/O (None in a single process); collective."""
    if not pstate.distributed:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class HostStaging:
    """One host buffer per dtype, reused while the pieces keep their boxes (pinned on CUDA)."""

    def __init__(self) -> None:
        self._signature: list | None = None
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def stage(self, pieces: list[TensorPiece]) -> tuple[list[TensorPiece], "torch.cuda.Event | None"]:
        """Host copies of ``pieces`` and the event after which they hold the values (None on CPU)."""
        signature = [(p.key, p.box, p.data.dtype, p.data.device) for p in pieces]
        if signature != self._signature:
            self._allocate(pieces)
            self._signature = signature
        cursor = {dtype: 0 for dtype in self._buffers}
        staged = []
        on_cuda = any(p.data.is_cuda for p in pieces)
        for p in pieces:
            buf, n = self._buffers[p.data.dtype], p.box.numel
            start = cursor[p.data.dtype]
            host = buf[start : start + n].view(p.box.sizes)
            host.copy_(p.data, non_blocking=on_cuda)
            cursor[p.data.dtype] = start + n
            staged.append(TensorPiece(p.key, p.global_shape, p.box, host))
        event = None
        if on_cuda:  # copies are ordered after the optimizer step on this stream; wait for them off-thread
            event = torch.cuda.Event()
            event.record()
        return staged, event

    def _allocate(self, pieces: list[TensorPiece]) -> None:
        totals: dict[torch.dtype, int] = {}
        for p in pieces:
            totals[p.data.dtype] = totals.get(p.data.dtype, 0) + p.box.numel
        pin = any(p.data.is_cuda for p in pieces)
        self._buffers = {dtype: torch.empty(n, dtype=dtype, pin_memory=pin) for dtype, n in totals.items()}

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class CheckpointWriter:
    """The checkpoints of one job under ``root`` (all ranks construct it, in the same order)."""

    def __init__(self, root: str, pstate: "ParallelState", *, keep_last: int, async_save: bool,
                 timeout_s: float, keep: str | None = None) -> None:
        self.pstate = pstate
        self.group = checkpoint_group(pstate, timeout_s)
        self.manager = CheckpointManager(root, pstate, keep_last=keep_last, group=self.group, keep=keep)
        self.async_save = async_save  # read at each save: may be switched between saves
        self.staging = HostStaging()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: tuple[int, Future] | None = None
        self._completed: list[tuple[int, bool]] = []

    def save(self, step: int, pieces: list[TensorPiece], objects: dict[str, Any], meta: dict[str, Any]) -> None:
        """Save ``step`` (collective); its outcome comes from ``completed``/``wait``."""
        self._finish_inflight()
        if not self.async_save:
            self._completed.append((step, self._write_and_commit(step, pieces, objects, meta, None)))
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p3d-ckpt")
        failure = None
        try:
            staged, ready = self.staging.stage(pieces)
            objects = copy.deepcopy(objects)
        except Exception as exc:  # noqa: BLE001 - e.g. no host memory: fail this save on all ranks, train on
            staged, ready, objects, failure = [], None, {}, exc
        future = self._executor.submit(self._write_and_commit, step, staged, objects, meta, ready, failure)
        self._inflight = (step, future)

    def _write_and_commit(self, step: int, pieces: list[TensorPiece], objects: dict[str, Any],
                          meta: dict[str, Any], ready: "torch.cuda.Event | None",
                          failure: BaseException | None = None) -> bool:
        if ready is not None:
            ready.synchronize()

        def write_rank(directory: str) -> None:
            write_state(os.path.join(directory, STATE_DIR), pieces, objects, self.group, failure)

        return self.manager.save(step, write_rank, meta)

    def _finish_inflight(self) -> None:
        if self._inflight is not None:
            step, future = self._inflight
            self._inflight = None
            # A crashed writer (not a failed save: that is False) re-raises here, in the training thread.
            self._completed.append((step, bool(future.result())))

    def completed(self) -> list[tuple[int, bool]]:
        """``(step, committed)`` of the saves that finished since the last call (never blocks)."""
        if self._inflight is not None and self._inflight[1].done():
            self._finish_inflight()
        done, self._completed = self._completed, []
        return done

    def wait(self) -> list[tuple[int, bool]]:
        """Block until no save is in flight; then as ``completed``."""
        self._finish_inflight()
        return self.completed()

    @property
    def in_flight(self) -> int | None:
        """The step being saved in the background, or None."""
        return None if self._inflight is None else self._inflight[0]

    def settle(self, timeout_s: float) -> None:
        """After a failure of this rank: give the save in flight up to ``timeout_s`` to finish, so that a
        crash in step k+1 does not lose step k's checkpoint (the peers' writer threads are still in its
        collectives). Its outcome is not reported: the process is about to exit."""
        if self._inflight is None:
            return
        _, future = self._inflight
        self._inflight = None
        try:
            future.result(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a failed or timed-out save changes nothing on the way out
            pass

    def close(self) -> list[tuple[int, bool]]:
        """Finish the save in flight and release the thread and the group (all ranks call it)."""
        done = self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        return done
