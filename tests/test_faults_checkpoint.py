"""Checkpoint faults, injected for real: one rank's save failing (its step directory cannot be
created, its write raises), the whole job's checkpoint disk read-only, and damaged files on disk
(a corrupted byte, a truncated file, a missing file). Training never hangs and goes on, the
previous checkpoints stay intact, ``resume=auto`` falls back past a damaged checkpoint naming
the file, and the continued losses are bit-identical."""

from __future__ import annotations

import os
import warnings

import pytest

from parallel3d.checkpoint import CheckpointError, CheckpointManager, complete_checkpoints, step_dir
from parallel3d.config import job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.trainer import train
from tests.fault_runs import losses_of
from tests.harness import run_on_ranks
from tests.test_train_e2e import job_values

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


def _train_with_fault(rank: int, world: int, values: dict, fault: str) -> tuple:
    """Train on this rank with ``$P3D_FAULT`` set (``parallel3d.faults``); the warnings it gave."""
    os.environ["P3D_FAULT"] = fault
    try:
        rj = resolve(job_from_dict(values, model="gpt_tiny"), world)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = train(rj, ParallelState(rj.topology))
    finally:
        os.environ.pop("P3D_FAULT", None)
    return result.start_step, result.last_step, result.checkpoints, [str(w.message) for w in caught]


@pytest.mark.slow
def test_a_save_failing_on_one_rank_or_a_read_only_disk_never_hangs_and_training_goes_on(tmp_path, cache_dir):
    layout = {"dp": 2, "zero_stage": 1}
    ref_dir = str(tmp_path / "ref")
    run_on_ranks(_train_with_fault, 2, job_values(ref_dir, cache_dir, parallel=layout, train={"steps": 6}), "",
                 timeout=300)
    reference = losses_of(ref_dir)
    out = str(tmp_path / "run")
    root = os.path.join(out, "checkpoints")

    def values(**train_keys) -> dict:
        return job_values(out, cache_dir, parallel=layout, train={"steps": 6, "save_every": 2, **train_keys})

    first = run_on_ranks(_train_with_fault, 2, values(stop_after=2), "", timeout=300)
    assert [r[2] for r in first] == [[2], [2]]
    intact = os.path.join(step_dir(root, 2), "state")
    before = {n: open(os.path.join(intact, n), "rb").read() for n in os.listdir(intact)}
    # One rank cannot create the step directory / one rank's write raises / the whole disk is read-only.
    for fault, cause, stop_after in (("checkpoint.mkdir@1", "[rank 1] checkpoint at step 4 failed: [Errno 28]", 4),
                                     ("checkpoint.write@1", "rank 1: OSError: [Errno 28] No space left", 4),
                                     ("checkpoint.write@*=erofs", "[Errno 30] Read-only file system", None)):
        results = run_on_ranks(_train_with_fault, 2, values(stop_after=stop_after), fault, timeout=300)
        for rank, (start, last, saved, messages) in enumerate(results):
            assert (start, last, saved) == (2, stop_after or 6, []), (fault, rank)
            if rank == 0:  # the logging rank says the save was abandoned and the old ones are kept
                assert any("keeping the previous ones ([2])" in m for m in messages), (fault, messages)
        assert any(cause in m for r in results for m in r[3]), (fault, [r[3] for r in results])
        assert [s for s, _ in complete_checkpoints(root)] == [2], fault
        assert not [n for n in os.listdir(root) if n.endswith(".tmp")], fault
        assert {n: open(os.path.join(intact, n), "rb").read() for n in os.listdir(intact)} == before, fault
        assert losses_of(out) == {s: reference[s] for s in range(1, (stop_after or 6) + 1)}, fault
    # The disk is back: the run resumes from the intact checkpoint and ends as if nothing happened.
    last = run_on_ranks(_train_with_fault, 2, values(), "", timeout=300)
    assert [r[:3] for r in last] == [(2, 6, [4, 6])] * 2
    assert losses_of(out) == reference


def _damage(path: str, how: str) -> None:
    if how == "corrupt":  # flip one byte in the middle, same size
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        os.remove(path)


def _single(values: dict):
    rj = resolve(job_from_dict(values, model="gpt_tiny"), 1)
    return train(rj, ParallelState.single_process())


def test_damaged_checkpoints_are_named_and_skipped_and_the_run_continues_bit_identically(tmp_path, cache_dir):
    ref = _single(job_values(str(tmp_path / "ref"), cache_dir))
    reference = {r["step"]: r["loss"] for r in ref.records}
    out = str(tmp_path / "run")
    root = os.path.join(out, "checkpoints")
    values = job_values(out, cache_dir, train={"save_every": 1, "keep_last": 3})
    _single(dict(values, train={**values["train"], "stop_after": 3}))
    assert [s for s, _ in complete_checkpoints(root)] == [1, 2, 3]
    shard3 = os.path.join(step_dir(root, 3), "state", "__0_0.distcp")
    meta2 = os.path.join(step_dir(root, 2), "state", ".metadata")
    _damage(shard3, "corrupt")
    _damage(meta2, "truncate")
    with pytest.warns(UserWarning) as caught:
        resumed = _single(values)
    messages = [str(w.message) for w in caught]
    assert any(f"{shard3}: corrupted (CRC-32" in m and "falling back" in m for m in messages), messages
    assert any(f"{meta2}: truncated to" in m for m in messages), messages
    assert resumed.start_step == 1
    assert losses_of(out) == reference  # bit-identical from the intact checkpoint on

    # An explicit train.resume naming a damaged checkpoint: one line naming the file.
    mgr = CheckpointManager(root, ParallelState.single_process(), keep_last=3)
    newest = step_dir(root, 4)
    shard4 = os.path.join(newest, "state", "__0_0.distcp")
    _damage(shard4, "missing")
    with pytest.raises(CheckpointError, match=f"damaged checkpoint: {shard4}: missing") as err:
        mgr.find(newest)
    assert "\n" not in str(err.value)
    with pytest.warns(UserWarning, match=f"{shard4}: missing"):
        assert mgr.find("auto") == step_dir(root, 3)
    # Nothing intact: fail in one line rather than silently start over.
    for step, path in complete_checkpoints(root):
        if step != 4:
            _damage(os.path.join(path, "state", "__0_0.distcp"), "corrupt")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="no intact checkpoint under"):
        mgr.find("auto")


class _PlanFailure(MemoryError):
    pass


def _save_with_a_plan_failing_on_rank_1(rank: int, world: int, directory: str) -> tuple[str, str, float] | None:
    """``write_state`` on every rank; on rank 1 its preparation (the save planner) raises before DCP starts."""
    import datetime
    import time

    import torch.distributed as dist

    from parallel3d.checkpoint_io import state

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    real = state.PieceSavePlanner

    class FailingPlanner(real):  # a test-side wrapper of the framework's own planner, on rank 1 only
        def __init__(self, pieces, objects, failure=None):
            if failure is None:
                raise _PlanFailure("injected: no memory for the save plan")
            super().__init__(pieces, objects, failure)

    if rank == 1:
        state.PieceSavePlanner = FailingPlanner
    t0 = time.monotonic()
    try:
        state.write_state(directory, [], {"who": rank}, group)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - t0
    finally:
        state.PieceSavePlanner = real
        dist.destroy_process_group(group)
    return None


@pytest.mark.slow
def test_a_save_failing_before_dcp_starts_on_one_rank_fails_on_every_rank_at_once(tmp_path):
    """Found by the fault fuzz: a rank whose write raised before DCP's collectives left its peers waiting in
    them while it went on to the save's agreement (a mismatched collective on the checkpoint group): the job
    died after timeouts instead of warning and training on. The rank now takes part and DCP reports it."""
    results = run_on_ranks(_save_with_a_plan_failing_on_rank_1, 2, str(tmp_path / "state"), timeout=120)
    for rank, result in enumerate(results):
        assert result is not None, rank
        kind, message, seconds = result
        assert kind == "StateIOError" and message.startswith("rank 1: _PlanFailure: injected"), (rank, result)
        assert seconds < 30, (rank, seconds)  # not the group's 60 s timeout


class _Killed(BaseException):
    """The process killed here: nothing after it runs (not an ``Exception``, so no failure handling either)."""


def _train_killed_at_first_save(rank: int, world: int, values: dict) -> int:
    """Train on this rank as a job killed just as its first save begins (nothing of the save runs); the step."""
    from parallel3d.checkpoint_io.writer import CheckpointWriter
    from parallel3d.trainer import Trainer

    def killed(*_args: object) -> None:
        raise _Killed

    save, CheckpointWriter.save = CheckpointWriter.save, killed  # restored: rank workers are reused
    try:
        rj = resolve(job_from_dict(values, model="gpt_tiny"), world)
        trainer = Trainer(rj, ParallelState(rj.topology))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    except _Killed:
        return trainer.step
    finally:
        CheckpointWriter.save = save
    raise AssertionError("the run ended without a save")


@pytest.mark.slow
def test_a_run_resumed_from_an_older_step_and_killed_before_its_first_save_leaves_auto_at_that_step(tmp_path,
                                                                                                   cache_dir):
    """Review45. A run that saved steps 2 and 4 is resumed from step 2 (train.resume=<its step_2>), then killed before
    it saves anything; the next job's resume=auto must continue from step 2, where the last run left it, not from
    the step 4 it abandoned (which stays loadable, set aside). Before: auto resumed step 4."""
    out = str(tmp_path / "run")
    root = os.path.join(out, "checkpoints")

    def values(**train_keys) -> dict:
        return job_values(out, cache_dir, parallel={"dp": 2, "zero_stage": 1},
                          train={"steps": 4, "save_every": 2, **train_keys})

    first = run_on_ranks(_train_with_fault, 2, values(), "", timeout=300)
    assert [r[2] for r in first] == [[2, 4]] * 2
    killed = run_on_ranks(_train_killed_at_first_save, 2, values(resume=step_dir(root, 2)), timeout=300)
    assert killed == [4, 4]
    after = run_on_ranks(_train_with_fault, 2, values(stop_after=3), "", timeout=300)
    assert [r[:3] for r in after] == [(2, 3, [3])] * 2, "resume=auto took the abandoned branch"
    assert CheckpointManager(root, ParallelState.single_process()).find(step_dir(root, 4) + ".superseded")
