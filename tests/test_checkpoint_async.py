"""Async checkpoints: same bytes as a blocking save, never visible half-written, one in flight,
a failure on one rank (disk full while writing, no host memory while staging) fails the save
on all ranks without a hang, and training goes on."""

from __future__ import annotations

import os
import resource
import signal
import threading

import pytest
import torch

from parallel3d.checkpoint import complete_checkpoints, step_dir
from parallel3d.checkpoint_io import writer as writer_module
from parallel3d.checkpoint_io.compat import STATE_DIR
from parallel3d.checkpoint_io.pieces import TensorPiece, pieces_to_write
from parallel3d.checkpoint_io.state import read_metadata, read_tensors
from parallel3d.checkpoint_io.writer import CheckpointWriter
from parallel3d.config import job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.trainer import train
from parallel3d.zero import ZeroOptimizer
from tests.harness import run_on_ranks
from tests.test_train_e2e import job_values

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")


def _all_tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    state = os.path.join(checkpoint, STATE_DIR)
    keys = [k for k, v in read_metadata(state).state_dict_metadata.items() if hasattr(v, "size")]
    return read_tensors(state, keys)


def _train_on_rank(rank: int, world: int, values: dict) -> tuple[list, list]:
    rj = resolve(job_from_dict(values, model="gpt_tiny"), world)
    result = train(rj, ParallelState(rj.topology))
    return [(r["step"], r["loss"]) for r in result.records], result.checkpoints


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


@pytest.mark.slow
def test_async_and_blocking_saves_write_the_same_state(tmp_path, cache_dir):
    layout = {"dp": 2, "zero_stage": 2}
    runs = {}
    for mode in (True, False):
        out = str(tmp_path / f"async_{mode}")
        values = job_values(out, cache_dir, parallel=layout, train={"precision": "bf16", "save_every": 2,
                                                                     "keep_last": 3, "async_save": mode})
        per_rank = run_on_ranks(_train_on_rank, 2, values, timeout=240)
        assert all(saved == [2, 4] for _, saved in per_rank)  # every rank learns each save's outcome
        runs[mode] = (out, next(losses for losses, _ in per_rank if losses))
    assert runs[True][1] == runs[False][1]
    for step in (2, 4):
        a = _all_tensors(step_dir(os.path.join(runs[True][0], "checkpoints"), step))
        b = _all_tensors(step_dir(os.path.join(runs[False][0], "checkpoints"), step))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _toy_writer(root: str, pstate: ParallelState, async_save: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    opt = ZeroOptimizer([model], pstate, zero_stage=1, lr=1e-3)
    writer = CheckpointWriter(root, pstate, keep_last=3, async_save=async_save, timeout_s=60)
    return model, opt, writer


def test_an_inflight_save_is_never_resumed_and_only_one_runs_at_a_time(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    ps = ParallelState.single_process()
    model, opt, writer = _toy_writer(root, ps)
    writer.save(1, pieces_to_write(opt, ps), {}, {"format": "x"})
    assert writer.wait() == [(1, True)]
    release, entered = threading.Event(), threading.Event()
    real_write = writer_module.write_state

    def held_write(*args, **kwargs):  # the real write, started only when the test lets it
        entered.set()
        assert release.wait(30)
        real_write(*args, **kwargs)

    monkeypatch.setattr(writer_module, "write_state", held_write)
    before = [p.data.clone() for p in pieces_to_write(opt, ps)]
    writer.save(2, pieces_to_write(opt, ps), {}, {"format": "x"})
    assert entered.wait(30) and writer.in_flight == 2
    with torch.no_grad():  # training goes on and changes the weights: the save holds the staged values
        for p in model.parameters():
            p.add_(1.0)
    assert writer.completed() == []
    assert os.path.isdir(step_dir(root, 2) + ".tmp")
    assert writer.manager.latest() == step_dir(root, 1) and writer.manager.find("auto") == step_dir(root, 1)
    assert [s for s, _ in complete_checkpoints(root)] == [1]
    release.set()
    assert writer.wait() == [(2, True)]
    assert writer.manager.latest() == step_dir(root, 2)
    saved = _all_tensors(step_dir(root, 2))
    for piece, value in zip(pieces_to_write(opt, ps), before):
        region = tuple(slice(o, o + s) for o, s in zip(piece.box.offsets, piece.box.sizes))
        assert torch.equal(saved[piece.key][region], value)
    # Host staging holds exactly what this rank writes (fp32), nothing on the device.
    assert writer.staging.nbytes() == sum(p.box.numel * 4 for p in pieces_to_write(opt, ps))
    writer.close()


def _disk_full_on_rank_1(rank: int, world: int, root: str) -> list:
    pstate = ParallelState(Topology(tp=1, pp=1, dp=world))
    model, opt, writer = _toy_writer(root, pstate)
    outcomes = []
    writer.save(1, pieces_to_write(opt, pstate), {}, {"format": "x"})
    outcomes += writer.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if rank == 1:  # the background writer's files past 1 KiB now fail with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        writer.save(2, pieces_to_write(opt, pstate), {}, {"format": "x"})
        outcomes += writer.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    writer.save(3, pieces_to_write(opt, pstate), {}, {"format": "x"})
    if rank == 1:  # staging fails on one rank only (e.g. no host memory left)
        def no_host_memory(pieces):
            raise MemoryError("cannot allocate the staging buffer")

        writer.staging.stage = no_host_memory
    writer.save(4, pieces_to_write(opt, pstate), {}, {"format": "x"})
    outcomes += writer.close()
    return outcomes


@pytest.mark.slow
def test_a_failed_background_save_on_one_rank_fails_everywhere_and_training_goes_on(tmp_path):
    root = str(tmp_path / "ckpt")
    for outcomes in run_on_ranks(_disk_full_on_rank_1, 2, root, timeout=120):
        assert outcomes == [(1, True), (2, False), (3, True), (4, False)]
    assert [s for s, _ in complete_checkpoints(root)] == [1, 3]
    assert not os.path.exists(step_dir(root, 2)) and not os.path.exists(step_dir(root, 2) + ".tmp")


def test_staging_copies_into_one_reused_host_buffer():
    ps = ParallelState.single_process()
    model, opt, writer = _toy_writer("unused", ps, async_save=False)
    pieces = pieces_to_write(opt, ps)
    staged, event = writer.staging.stage(pieces)
    assert event is None  # CPU: the copies are done when stage returns
    buffers = {id(p.data.untyped_storage()) for p in staged}
    assert len(buffers) == 1 and all(not p.data.is_cuda for p in staged)
    again, _ = writer.staging.stage(pieces)
    assert {id(p.data.untyped_storage()) for p in again} == buffers
    assert all(torch.equal(a.data, p.data) for a, p in zip(again, pieces))
    assert isinstance(staged[0], TensorPiece)


def test_settle_after_a_failure_finishes_the_save_in_flight(tmp_path, monkeypatch):
    """Found by the fault fuzz: a rank failing in step k+1 exited while step k's background save was still
    being written, and the checkpoint was lost. ``settle`` (called by the trainer on a failure) finishes it."""
    import time

    real = writer_module.write_state

    def slow_write(*args, **kwargs):  # a slow disk: the save is still in flight when the failure comes
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "write_state", slow_write)
    root = str(tmp_path / "checkpoints")
    writer = CheckpointWriter(root, ParallelState.single_process(), keep_last=2, async_save=True, timeout_s=30)
    writer.save(1, [], {"trainer": {"step": 1}}, {})
    assert writer.in_flight == 1
    writer.settle(30.0)
    assert [s for s, _ in complete_checkpoints(root)] == [1]
