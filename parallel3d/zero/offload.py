"""Optimizer state in host memory (``offload=cpu``) or in files (``offload=disk``).

Both run the AdamW update on the host (``adamw.host_adamw_flat_``: torch's fused
CPU kernel) and move only what the update needs: this rank's gradient pieces
down (device -> host, in the gradient dtype) and the updated pieces back up
(host -> device, in the model dtype). The device keeps the parameters (their
shard with stage 3) and the gradient shard; the 12 bytes per parameter of fp32
master weights and moments live on the host or on disk.

Overlap (``Transfers``): on CUDA, copies run on a side stream from/to pinned
host buffers, two per kind, so while the host updates bucket k the copy engine
brings bucket k+1's gradient down and takes bucket k-1's parameters up; the
training stream waits for the side stream once, at the end of the update. With
``disk``, a worker thread also reads chunk k+1's state from the files and writes
chunk k-1's back while the host computes chunk k (positioned reads/writes
release the GIL, the torch update too). On a CPU-only machine host and device
are the same memory and the same code runs with immediate copies.

Disk layout: ``<offload_dir>/<tag>/group{g}_{master,exp_avg,exp_avg_sq}.f32``,
each the fp32 shard in shard coordinates (so chunk ``[lo, hi)`` of bucket ``b``'s
piece is at byte ``4 * (b.shard_offset + lo)``). Files are created empty (sparse
zeros: fresh moments) when the optimizer is built; they are scratch space, not a
checkpoint. Checkpoints (``checkpoint_io``) reach them through ``read_piece``:
views of a shared memory map of the same files (coherent with the positioned
reads/writes: one page cache), so a save streams the state from disk piece by
piece and a load writes into it, neither holding the whole state in anonymous
memory; that is how a disk-offloaded run saves, resumes and reshards.
The host holds at most ``buffer_bytes`` of state at a time for the update: two
chunk-sized sets of (master, exp_avg, exp_avg_sq, gradient, parameter staging)
buffers.
"""

from __future__ import annotations

import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from parallel3d.zero.buffers import Bucket, BufferLayout, shard_slice
from parallel3d.zero.memory import MemoryTracker, nbytes
from parallel3d.zero.options import OFFLOAD_MODES
from parallel3d.zero.states import DeviceStates, OptimizerStates, PieceOf, StateChunk, pieces

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
FP32 = 4


class Transfers:
    """Copies between the training device and host memory (module doc). Events are None on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # A meta training device (the dry run) keeps its "host" state on meta too: real host tensors
        # could not be filled from meta parameters, and the dry run counts bytes, not values.
        self.host = torch.device("meta") if device.type == "meta" else torch.device("cpu")
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer the copy engine can read/write asynchronously (pinned on CUDA)."""
        return torch.empty(numel, dtype=dtype, device=self.host, pin_memory=self.cuda)

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        """``dst.copy_(src)`` (converting dtype), asynchronous on CUDA: returns the event to wait for."""
        if not self.cuda:
            dst.copy_(src)
            return None
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # src was produced (and dst last read) on the training stream
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        for t in (dst, src):
            if t.is_cuda:  # used on the side stream: the allocator must not recycle it before the copy ran
                t.record_stream(self.stream)
        return event

    @staticmethod
    def wait(event) -> None:
        """Block the host until the copy behind ``event`` is done."""
        if event is not None:
            event.synchronize()

    def finish(self) -> None:
        """Order the training stream after every copy issued so far (parameters are read next)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def _max_piece(layouts: list[BufferLayout]) -> int:
    return max(b.piece_size for layout in layouts for b in layout.buckets)


class HostStates(OptimizerStates):
    """``offload=cpu``: masters and moments as flat host tensors (pinned on CUDA); update on the host."""

    offload = "cpu"
    on_host = True

    def __init__(self, layouts: list[BufferLayout], param_piece: PieceOf, *, device: torch.device,
                 grad_dtype: torch.dtype, memory: MemoryTracker) -> None:
        super().__init__(layouts, memory)
        self.x = Transfers(device)
        self.masters: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        for g, layout in enumerate(layouts):
            n = layout.shard_numel
            master = self.x.host_empty(n, torch.float32)
            for b in layout.buckets:
                shard_slice(master, b).copy_(param_piece(g, b))
            self.masters.append(master)
            self.exp_avgs.append(self.x.host_empty(n, torch.float32).zero_())
            self.exp_avg_sqs.append(self.x.host_empty(n, torch.float32).zero_())
        widest = _max_piece(layouts)
        self.grad_bufs = [self.x.host_empty(widest, grad_dtype) for _ in range(2)]
        dtypes = {layout.dtype for layout in layouts}
        param_dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
        # fp32 parameters go up straight from the master; half precision through a staging buffer.
        self.param_stage = [] if param_dtype == torch.float32 else [self.x.host_empty(widest, param_dtype)
                                                                   for _ in range(2)]
        self._stage_events: list = [None, None]
        self._outstanding: list = []
        self._host = sum(nbytes(t) for t in self.masters + self.exp_avgs + self.exp_avg_sqs
                         + self.grad_bufs + self.param_stage)
        memory.add("offload_host", self._host)

    def read_piece(self, group: int, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (shard_slice(self.masters[group], bucket), shard_slice(self.exp_avgs[group], bucket),
                shard_slice(self.exp_avg_sqs[group], bucket))

    def write_piece(self, group: int, bucket: Bucket, master: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor) -> None:
        for dst, src in zip(self.read_piece(group, bucket), (master, exp_avg, exp_avg_sq)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)

    def update_chunks(self, grad_piece: PieceOf, param_piece: PieceOf) -> Iterator[StateChunk]:
        for event in self._outstanding:  # last update's uploads read the masters we are about to change
            Transfers.wait(event)
        self._outstanding = []
        items = pieces(self.layouts)

        def fetch(k: int):
            g, b = items[k]
            buf = self.grad_bufs[k % 2][: b.piece_size]
            return buf, self.x.copy(buf, grad_piece(g, b))

        ahead = fetch(0) if items else None
        for k, (g, b) in enumerate(items):
            grad, event = ahead
            if k + 1 < len(items):  # its buffer was last read by chunk k-1's (finished) host update
                ahead = fetch(k + 1)
            Transfers.wait(event)
            master, m, v = self.read_piece(g, b)
            yield StateChunk(g, b, 0, b.piece_size, master, m, v, grad)
            self._upload(k, param_piece(g, b), master)
        self.x.finish()

    def _upload(self, k: int, dst: torch.Tensor, master: torch.Tensor) -> None:
        src = master
        if self.param_stage:
            Transfers.wait(self._stage_events[k % 2])  # the upload that last used this staging buffer
            src = self.param_stage[k % 2][: master.numel()]
            src.copy_(master)  # fp32 -> model dtype on the host
        event = self.x.copy(dst, src)
        self._stage_events[k % 2] = event
        self._outstanding.append(event)

    def host_bytes(self) -> int:
        return self._host


def _transfer_all(fd: int, buf: torch.Tensor, offset: int, write: bool) -> None:
    """Read (or write) all of ``buf``'s bytes at byte ``offset`` of file ``fd``."""
    view = memoryview(buf.numpy()).cast("B")
    done = 0
    while done < len(view):
        chunk = view[done:]
        n = os.pwritev(fd, [chunk], offset + done) if write else os.preadv(fd, [chunk], offset + done)
        if n <= 0:
            raise OSError(f"offload file: {'wrote' if write else 'read'} 0 bytes at {offset + done}")
        done += n


def _close(executor: ThreadPoolExecutor, fds: list[int]) -> None:
    executor.shutdown(wait=True)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class DiskStates(OptimizerStates):
    """``offload=disk``: state in files, streamed through ``buffer_bytes`` of host memory (module doc)."""

    offload = "disk"
    on_host = True

    def __init__(self, layouts: list[BufferLayout], param_piece: PieceOf, *, device: torch.device,
                 grad_dtype: torch.dtype, memory: MemoryTracker, directory: str, buffer_bytes: int, tag: str) -> None:
        super().__init__(layouts, memory)
        self.x = Transfers(device)
        dtypes = {layout.dtype for layout in layouts}
        param_dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
        per_element = 2 * (len(STATE_NAMES) * FP32 + grad_dtype.itemsize + param_dtype.itemsize)
        self.chunk = int(buffer_bytes) // per_element
        if self.chunk < 1:
            raise ValueError(f"parallel.offload_buffer_mb={buffer_bytes / 2**20:g}: too small to stream one "
                             f"element ({per_element} bytes of host buffers per element)")
        self.chunk = min(self.chunk, _max_piece(layouts))
        self.directory = os.path.join(directory, tag)
        os.makedirs(self.directory, exist_ok=True)
        self.fds: list[list[int]] = []
        self.paths: list[list[str]] = []
        for g, layout in enumerate(layouts):
            fds, paths = [], []
            for name in STATE_NAMES:
                path = os.path.join(self.directory, f"group{g}_{name}.f32")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, layout.shard_numel * FP32)  # reads as zeros: fresh moments
                fds.append(fd)
                paths.append(path)
            self.fds.append(fds)
            self.paths.append(paths)
        self._maps: list[list[torch.Tensor]] | None = None  # mapped on first read_piece (checkpoints)
        self.state_bufs = [[self.x.host_empty(self.chunk, torch.float32) for _ in STATE_NAMES] for _ in range(2)]
        self.grad_bufs = [self.x.host_empty(self.chunk, grad_dtype) for _ in range(2)]
        self.param_stage = [self.x.host_empty(self.chunk, param_dtype) for _ in range(2)]
        self._stage_events: list = [None, None]
        self._host = sum(nbytes(t) for t in [*self.state_bufs[0], *self.state_bufs[1], *self.grad_bufs,
                                            *self.param_stage])
        self._disk = sum(layout.shard_numel * FP32 * len(STATE_NAMES) for layout in layouts)
        memory.add("offload_host", self._host)
        memory.add("offload_disk", self._disk)
        self.chunks = [(g, b, lo, min(lo + self.chunk, b.piece_size))
                       for g, b in pieces(layouts) for lo in range(0, b.piece_size, self.chunk)]
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p3d-offload-io")
        self._finalizer = weakref.finalize(self, _close, self._io, [fd for fds in self.fds for fd in fds])
        for g, b, lo, hi in self.chunks:  # the masters start as the parameters
            master = self.state_bufs[0][0][: hi - lo]
            master.copy_(param_piece(g, b)[lo:hi])
            _transfer_all(self.fds[g][0], master, (b.shard_offset + lo) * FP32, write=True)

    # ---- chunk I/O (on the worker thread) ------------------------------------------------
    def _io_chunk(self, k: int, slot: int, write: bool) -> None:
        g, b, lo, hi = self.chunks[k]
        for fd, buf in zip(self.fds[g], self.state_bufs[slot]):
            _transfer_all(fd, buf[: hi - lo], (b.shard_offset + lo) * FP32, write)

    def update_chunks(self, grad_piece: PieceOf, param_piece: PieceOf) -> Iterator[StateChunk]:
        chunks, io = self.chunks, self._io
        reads: dict[int, Future] = {0: io.submit(self._io_chunk, 0, 0, False)} if chunks else {}
        writes: list[Future] = []

        def fetch(k: int):
            g, b, lo, hi = chunks[k]
            buf = self.grad_bufs[k % 2][: hi - lo]
            return buf, self.x.copy(buf, grad_piece(g, b)[lo:hi])

        ahead = fetch(0) if chunks else None
        try:
            for k, (g, b, lo, hi) in enumerate(chunks):
                slot = k % 2
                grad, event = ahead
                if k + 1 < len(chunks):
                    # FIFO worker: this read runs after the write of chunk k-1, which used the same slot.
                    reads[k + 1] = io.submit(self._io_chunk, k + 1, 1 - slot, False)
                    ahead = fetch(k + 1)
                reads.pop(k).result()
                Transfers.wait(event)
                master, m, v = (buf[: hi - lo] for buf in self.state_bufs[slot])
                yield StateChunk(g, b, lo, hi, master, m, v, grad)
                Transfers.wait(self._stage_events[slot])
                stage = self.param_stage[slot][: hi - lo]
                stage.copy_(master)
                self._stage_events[slot] = self.x.copy(param_piece(g, b)[lo:hi], stage)
                writes.append(io.submit(self._io_chunk, k, slot, True))
        finally:
            for f in [*reads.values(), *writes]:
                f.result()  # surfaces an I/O error here, and leaves the files consistent
            for event in self._stage_events:
                Transfers.wait(event)
            self.x.finish()

    # ---- checkpoints ---------------------------------------------------------------------
    def _mapped(self) -> list[list[torch.Tensor]]:
        """Shared memory maps of the state files (fp32, shard coordinates), created once."""
        if self._maps is None:
            self._maps = [[torch.from_file(path, shared=True, size=layout.shard_numel, dtype=torch.float32)
                           for path in paths] for paths, layout in zip(self.paths, self.layouts)]
        return self._maps

    def read_piece(self, group: int, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the mapped files: reading pages the state in, writing changes the files."""
        maps = self._mapped()[group]
        return shard_slice(maps[0], bucket), shard_slice(maps[1], bucket), shard_slice(maps[2], bucket)

    def write_piece(self, group: int, bucket: Bucket, master: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor) -> None:
        for dst, src in zip(self.read_piece(group, bucket), (master, exp_avg, exp_avg_sq)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)

    def host_bytes(self) -> int:
        return self._host

    def disk_bytes(self) -> int:
        return self._disk

    def close(self) -> None:
        self._maps = None
        self._finalizer()


def make_states(offload: str, layouts: list[BufferLayout], param_piece: PieceOf, *, device: torch.device,
                grad_dtype: torch.dtype, memory: MemoryTracker, offload_dir: str | None = None,
                buffer_bytes: int = 0, tag: str = "rank0") -> OptimizerStates:
    """The state store of ``offload`` (``none``, ``cpu``, ``disk``); ``tag`` names this rank's files."""
    if offload == "none":
        return DeviceStates(layouts, param_piece, device=device, memory=memory)
    if offload == "cpu":
        return HostStates(layouts, param_piece, device=device, grad_dtype=grad_dtype, memory=memory)
    if offload == "disk":
        if not offload_dir:
            raise ValueError("parallel.offload=disk needs parallel.offload_dir (a directory for optimizer state files)")
        return DiskStates(layouts, param_piece, device=device, grad_dtype=grad_dtype, memory=memory,
                          directory=offload_dir, buffer_bytes=buffer_bytes, tag=tag)
    raise ValueError(f"parallel.offload={offload!r} is not one of {', '.join(OFFLOAD_MODES)}")
