"""Sharded ZeRO checkpoints: each rank writes the optimizer state it owns; any dp size can load it.

Format (``parallel3d-zero-v1``), a directory::

    <path>/metadata.json            written last; its presence marks the checkpoint complete
    <path>/tp{t}_pp{p}_dp{d}.pt     one per rank (torch.save of plain dicts and tensors)

A rank file holds ``params`` (this model-parallel rank's ``[name, shape]`` list,
in order), ``pieces`` (``name -> [(start, stop, master, exp_avg, exp_avg_sq)]``:
fp32 values of flattened elements ``[start, stop)`` of that parameter, exactly
the elements this DP rank owns) and ``scalars`` (Adam step, iteration, loss
scaler). Stage 0 replicates the state, so only dp rank 0 writes pieces.
Ranges are per parameter, not per flat buffer, so the file does not depend on
dp, ZeRO stage, offload mode, bucket size or padding: a job with another dp
size or stage (same tp and pp) reads every ``tp{t}_pp{p}_dp*.pt`` of its
model-parallel rank and keeps what it owns. The optimizer is read and written
only through its owned pieces (``read_state_piece`` / ``write_state_piece``:
the same shard coordinates in every stage and offload mode), so nothing here
depends on where the state lives. The master weights are the model's weights
(fp32) or their fp32 source (bf16/fp16), so loading also restores the
parameters.

Atomicity: ranks write into ``<path>.partial``, each file via a temporary name,
fsync and rename; once every rank has succeeded, rank 0 moves an older
checkpoint at ``<path>`` aside to ``<path>.old``, renames the partial directory
to ``<path>`` and only then writes metadata.json into it (temporary name, fsync,
rename). A crash at any point leaves directories without metadata.json, which
``load_sharded`` refuses, and the previous checkpoint complete (at ``<path>``,
or at ``<path>.old``, which ``load_sharded(<path>)`` then falls back to).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Protocol

import torch

from parallel3d import comm
from parallel3d.atomic_io import atomic_write_bytes, fsync_dir
from parallel3d.parallel_state import ParallelState
from parallel3d.zero.buffers import Bucket, BufferLayout
from parallel3d.zero.precision import LossScaler

log = logging.getLogger(__name__)

FORMAT = "parallel3d-zero-v1"
METADATA = "metadata.json"


class ShardedState(Protocol):
    """What a checkpoint reads and writes of ``ZeroOptimizer`` (no import of the optimizer: no cycle)."""

    pstate: ParallelState
    device: torch.device
    named_params: list[tuple[str, torch.nn.Parameter]]
    zero_stage: int
    precision: str
    adam_step: int
    iteration: int
    scaler: LossScaler

    @property
    def layouts(self) -> list[BufferLayout]: ...

    def read_state_piece(self, group: int, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def write_state_piece(self, group: int, bucket: Bucket, master: torch.Tensor, exp_avg: torch.Tensor,
                          exp_avg_sq: torch.Tensor) -> None: ...

    def gather_params(self) -> None: ...


def _rank_file(tp: int, pp: int, dp: int) -> str:
    return f"tp{tp}_pp{pp}_dp{dp}.pt"


def _agree_failed(opt: ShardedState, failed: bool) -> bool:
    """Barrier over the whole job that also tells every rank whether any rank failed."""
    flag = torch.tensor([1.0 if failed else 0.0], device=opt.device)  # NCCL needs device tensors
    comm.all_reduce(flag, opt.pstate, "dp")
    comm.all_reduce(flag, opt.pstate, "model")
    return bool(flag.item() > 0)


def _param_list(opt: ShardedState) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in opt.named_params]


def _my_pieces(opt: ShardedState) -> dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    pieces: dict[str, list] = {}
    for g, layout in enumerate(opt.layouts):
        for b in layout.buckets:
            master, m, v = opt.read_state_piece(g, b)
            for seg in b.segments:
                lo, hi = seg.shard_start - b.shard_offset, seg.shard_end - b.shard_offset
                pieces.setdefault(seg.slot.name, []).append(
                    (seg.param_start, seg.param_start + seg.length,
                     master[lo:hi].float().clone(), m[lo:hi].clone(), v[lo:hi].clone())
                )
    return pieces


def save_sharded(opt: ShardedState, path: str) -> None:
    """Write ``opt``'s state to directory ``path`` atomically; every rank of the job calls it."""
    ps = opt.pstate
    path = os.path.abspath(path)
    partial = path + ".partial"
    failure: BaseException | None = None
    if ps.rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)  # leftovers of a crashed save
            os.makedirs(partial)
        except OSError as exc:
            failure = exc
    if _agree_failed(opt, failure is not None):
        raise RuntimeError(f"rank {ps.rank}: could not create {partial}") from failure
    writes_pieces = opt.zero_stage > 0 or ps.dp_rank == 0
    payload = {
        "format": FORMAT,
        "coords": {"tp": ps.tp_rank, "pp": ps.pp_rank, "dp": ps.dp_rank},
        "params": _param_list(opt),
        "pieces": _my_pieces(opt) if writes_pieces else {},
        "scalars": {"adam_step": opt.adam_step, "iteration": opt.iteration, "loss_scaler": opt.scaler.state_dict()},
    }
    try:
        atomic_write_bytes(os.path.join(partial, _rank_file(ps.tp_rank, ps.pp_rank, ps.dp_rank)),
                      lambda f: torch.save(payload, f))
    except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement below
        failure = exc
    if _agree_failed(opt, failure is not None):
        raise RuntimeError(f"rank {ps.rank}: a rank failed to write its ZeRO shard into {partial}; "
                           f"no checkpoint was committed") from failure
    if ps.rank == 0:
        try:
            topo = ps.topology
            meta = {"format": FORMAT, "topology": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp},
                    "zero_stage": opt.zero_stage, "precision": opt.precision, "complete": True}
            fsync_dir(partial)
            old = path + ".old"
            if os.path.exists(path):
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(partial, path)
            fsync_dir(os.path.dirname(path))
            # The completion marker goes in last, into the final directory only.
            atomic_write_bytes(os.path.join(path, METADATA), lambda f: f.write(json.dumps(meta, indent=1).encode()))
            fsync_dir(path)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException as exc:  # noqa: BLE001
            failure = exc
    if _agree_failed(opt, failure is not None):
        raise RuntimeError(f"rank {ps.rank}: committing the ZeRO checkpoint {path} failed") from failure


def _read_metadata(path: str) -> dict:
    meta_path = os.path.join(path, METADATA)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(
            f"no complete ZeRO checkpoint at {path}: {METADATA} is missing (an interrupted save leaves "
            f"only {path}.partial, which is never loaded)"
        )
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def _check_params(ours: list[tuple[str, tuple[int, ...]]], saved: list, path: str) -> None:
    saved_shapes = {name: tuple(shape) for name, shape in saved}
    for name, shape in ours:
        if name not in saved_shapes:
            raise ValueError(f"checkpoint {path} is from an incompatible model: it has no tensor {name!r}")
        if saved_shapes[name] != shape:
            raise ValueError(f"checkpoint {path} is from an incompatible model: tensor {name!r} has shape "
                             f"{list(saved_shapes[name])} there but {list(shape)} in this model")
    our_names = {name for name, _ in ours}
    for name, _ in saved:
        if name not in our_names:
            raise ValueError(f"checkpoint {path} is from an incompatible model: its tensor {name!r} is not in "
                             f"this model")


@torch.no_grad()
def load_sharded(opt: ShardedState, path: str) -> None:
    """Restore ``opt`` (and the parameters) from ``path``; every rank calls it. dp may differ from the save."""
    ps = opt.pstate
    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, METADATA)) and os.path.isfile(os.path.join(path + ".old", METADATA)):
        log.warning("%s is incomplete (a save was interrupted while replacing it); loading %s.old", path, path)
        path = path + ".old"
    meta = _read_metadata(path)
    saved_topo = meta["topology"]
    if (saved_topo["tp"], saved_topo["pp"]) != (ps.tp_size, ps.pp_size):
        raise ValueError(f"checkpoint {path} was written with tp={saved_topo['tp']}, pp={saved_topo['pp']}; "
                         f"this job has tp={ps.tp_size}, pp={ps.pp_size} (only dp may change on load)")
    # Reassemble each parameter's fp32 state from every DP rank's pieces of this model-parallel rank.
    full: dict[str, list[torch.Tensor]] = {}
    covered: dict[str, int] = {}
    scalars = None
    numel = {s.name: s.numel for layout in opt.layouts for s in layout.slots}
    for d in range(saved_topo["dp"]):
        file = os.path.join(path, _rank_file(ps.tp_rank, ps.pp_rank, d))
        if not os.path.isfile(file):
            raise FileNotFoundError(f"checkpoint {path} lacks {os.path.basename(file)}")
        data = torch.load(file, map_location="cpu", weights_only=True)
        _check_params(_param_list(opt), data["params"], path)
        scalars = scalars or data["scalars"]
        for name, pieces in data["pieces"].items():
            bufs = full.setdefault(name, [torch.zeros(numel[name]) for _ in range(3)])
            for start, stop, *values in pieces:
                for buf, value in zip(bufs, values):
                    buf[start:stop] = value
                covered[name] = covered.get(name, 0) + stop - start
    for name, n in numel.items():
        if covered.get(name, 0) != n:
            raise ValueError(f"checkpoint {path}: tensor {name!r} has {covered.get(name, 0)} of {n} elements saved")
    for g, layout in enumerate(opt.layouts):
        for b in layout.buckets:
            targets = opt.read_state_piece(g, b)
            for seg in b.segments:
                lo = seg.shard_start - b.shard_offset
                src = slice(seg.param_start, seg.param_start + seg.length)
                for target, buf in zip(targets, full[seg.slot.name]):
                    target[lo : lo + seg.length].copy_(buf[src])  # copy_ moves CPU -> device
            opt.write_state_piece(g, b, *targets)  # persists (disk) and refreshes the parameter piece
    opt.gather_params()
    opt.adam_step = int(scalars["adam_step"])
    opt.iteration = int(scalars["iteration"])
    opt.scaler.load_state_dict(scalars["loss_scaler"])
