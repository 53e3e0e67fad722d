"""CheckpointManager: atomic directories, keep-last-K, resume=auto, failed saves (real EFBIG on 2 ranks)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import warnings
from collections.abc import Iterator

import pytest
import torch

from parallel3d.atomic_io import atomic_torch_save
from parallel3d.checkpoint import (
    CheckpointError,
    CheckpointManager,
    complete_checkpoints,
    is_loadable,
    step_dir,
)
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from tests.harness import run_on_ranks


def _writer(payload: dict, rank: int = 0):
    def write(directory: str) -> None:
        os.makedirs(os.path.join(directory, "sub"), exist_ok=True)
        name = "state.pt" if rank == 0 else f"state_{rank}.pt"
        atomic_torch_save(payload, os.path.join(directory, "sub", name))

    return write


def test_keep_last_and_latest(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root, ParallelState.single_process(), keep_last=2)
    for step in range(1, 5):
        assert mgr.save(step, _writer({"step": step}), {"layout": {"tp": 1}})
    assert [s for s, _ in complete_checkpoints(root)] == [3, 4]
    assert mgr.latest() == step_dir(root, 4)
    meta = json.load(open(os.path.join(step_dir(root, 4), "meta.json")))
    assert meta["step"] == 4 and meta["files"] == ["sub/state.pt"]
    assert torch.load(os.path.join(mgr.latest(), "sub", "state.pt")) == {"step": 4}
    assert not [n for n in os.listdir(root) if n.endswith((".tmp", ".old"))]


@pytest.mark.parametrize("later", ["damaged", "intact"])
def test_a_save_before_later_checkpoints_keeps_itself_and_sets_them_aside(tmp_path, later):
    """Session 43. keep_last counted checkpoints of later steps than the one just saved: after resume=auto fell
    back past a damaged step 4 to step 2, keep_last=1 deleted the new step 3 and step 2 and kept only the damaged
    step 4 (no intact checkpoint left); after train.resume=<step 2> with an intact step 4 there, resume=auto
    later picked step 4, the abandoned branch. Later steps are now set aside (renamed, still loadable)."""
    root = str(tmp_path / "ckpt")
    first = CheckpointManager(root, ParallelState.single_process(), keep_last=5)
    for step in (2, 4):
        assert first.save(step, _writer({"step": step}), {})
    if later == "damaged":
        with open(os.path.join(step_dir(root, 4), "sub", "state.pt"), "r+b") as fh:
            fh.write(b"\0" * 8)  # same size, another checksum
    mgr = CheckpointManager(root, ParallelState.single_process(), keep_last=1)
    if later == "damaged":
        with pytest.warns(UserWarning, match="step_00000004 is damaged"):
            resumed = mgr.find("auto")
    else:
        resumed = mgr.find(step_dir(root, 2))
    assert resumed == step_dir(root, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.save(3, _writer({"step": 3}), {})
    assert [s for s, _ in complete_checkpoints(root)] == [3]
    assert mgr.find("auto") == step_dir(root, 3)
    assert any("set aside as step_00000004.superseded" in str(w.message) for w in caught)
    assert torch.load(os.path.join(mgr.find("auto"), "sub", "state.pt")) == {"step": 3}
    aside = step_dir(root, 4) + ".superseded"
    assert is_loadable(aside) and mgr.find(aside) == aside if later == "intact" else os.path.isdir(aside)


def test_half_written_checkpoints_are_never_resumed(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root, ParallelState.single_process(), keep_last=5)
    mgr.save(2, _writer({"step": 2}), {})
    mgr.save(3, _writer({"step": 3}), {})
    # A save killed before the rename: only the .tmp directory exists.
    os.makedirs(step_dir(root, 9) + ".tmp")
    # A directory with the final name but no meta.json (not written by us).
    os.makedirs(step_dir(root, 8))
    # A complete-looking checkpoint that lost a listed file (e.g. killed mid-prune).
    os.remove(os.path.join(step_dir(root, 3), "sub", "state.pt"))
    assert mgr.latest() == step_dir(root, 2)
    assert mgr.find("auto") == step_dir(root, 2)
    assert mgr.find("none") is None
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        mgr.find(step_dir(root, 9) + ".tmp")
    # A new manager (a restarted job) clears leftover partial saves.
    CheckpointManager(root, ParallelState.single_process())
    assert not os.path.exists(step_dir(root, 9) + ".tmp")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root, ParallelState.single_process(), keep_last=1)
    assert mgr.save(1, _writer({"step": 1}), {})

    def permission_denied(directory: str) -> None:
        os.chmod(directory, 0o500)
        try:
            if os.getuid() == 0:  # root ignores permissions: fail the way the OS would
                raise PermissionError(13, "Permission denied", directory)
            _writer({"step": 2})(directory)
        finally:
            os.chmod(directory, 0o700)

    with pytest.warns(UserWarning) as caught:
        assert not mgr.save(2, permission_denied, {})
    messages = [str(w.message) for w in caught]
    assert any("checkpoint at step 2 failed: [Errno 13] Permission denied" in m for m in messages)
    assert any("keeping the previous ones ([1])" in m for m in messages)
    assert [s for s, _ in complete_checkpoints(root)] == [1]
    assert mgr.latest() == step_dir(root, 1)
    assert not os.path.exists(step_dir(root, 2) + ".tmp")


def _disk_full_on_rank_1(rank: int, world: int, root: str) -> tuple:
    pstate = ParallelState(Topology(tp=1, pp=1, dp=world))
    mgr = CheckpointManager(root, pstate, keep_last=2)
    big = {"w": torch.zeros(256 * 1024)}  # 1 MiB
    first = mgr.save(1, _writer(big, rank), {})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if rank == 1:  # writes past 64 KiB now fail with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        second = mgr.save(2, _writer(big, rank), {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    third = mgr.save(3, _writer(big, rank), {})
    return first, second, third, mgr.find("auto")


@pytest.mark.slow
def test_disk_full_on_one_rank_fails_the_save_everywhere_and_training_goes_on(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_on_ranks(_disk_full_on_rank_1, 2, root, timeout=120)
    for first, second, third, found in results:
        assert (first, second, third) == (True, False, True)
        assert found == step_dir(root, 3)
    assert [s for s, _ in complete_checkpoints(root)] == [1, 3]


class _Killed(BaseException):
    """The process killed here: not an ``Exception``, so no failure handling of the save runs after it."""


@contextlib.contextmanager
def killed_at_rename(kill_at: int | None) -> Iterator[list[tuple[str, str]]]:
    """Inside the block the process is "killed" (``_Killed``, which ends the block) at its ``kill_at``-th
    ``os.replace`` (None: never); yields the ``(src, dst)`` renames made before that."""
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def replace(src, dst):
        if len(renames) == kill_at:
            raise _Killed
        renames.append((src, dst))
        real_replace(src, dst)

    os.replace = replace
    try:
        yield renames
    except _Killed:
        pass
    finally:
        os.replace = real_replace


def _branch_off(root: str, kill_at: int | None) -> list[tuple[str, str]]:
    """A run resumed from step 2 of a run that saved 2, 4, 6 saves its own step 4 (keep_last=1), killed before
    the save's ``kill_at``-th ``os.replace`` (None: not killed). Returns the renames the save made."""
    first = CheckpointManager(root, ParallelState.single_process(), keep_last=5)
    for step in (2, 4, 6):
        assert first.save(step, _writer({"step": step, "branch": "old"}), {})
    mgr = CheckpointManager(root, ParallelState.single_process(), keep_last=1)
    assert mgr.find(step_dir(root, 2)) == step_dir(root, 2)
    with killed_at_rename(kill_at) as renames, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.save(4, _writer({"step": 4, "branch": "new"}), {})
    return renames


def _payloads(root: str) -> list[dict]:
    """Every loadable checkpoint's state under ``root``, set-aside ones included."""
    dirs = [os.path.join(root, n) for n in sorted(os.listdir(root))]
    return [torch.load(os.path.join(d, "sub", "state.pt")) for d in dirs if is_loadable(d)]


def test_a_kill_at_any_rename_of_a_branching_save_loses_nothing_and_auto_takes_the_new_branch(tmp_path):
    """Review44. A save that branches off (resumed from step 2; the old run's 4 and 6 there) renames several
    directories. Killed before any of them, the restarted job (a new manager, resume=auto) must still hold every
    old checkpoint (set aside or not) and, once the new step 4 was complete (its meta.json written), resume it,
    not the old branch. Before: a kill between the swap of the old step 4 and the rename of the new one lost both
    (the restart deleted the .old and the complete .tmp); a kill before the later step 6 was set aside resumed
    step 6; and the old branch's step 4 was deleted, not set aside, even without a kill."""
    renames = _branch_off(str(tmp_path / "count"), None)
    meta = next(i for i, (_, dst) in enumerate(renames) if os.path.basename(dst) == "meta.json")
    old = [{"step": s, "branch": "old"} for s in (4, 6)]  # the old branch (step 2, older, keep_last may prune)
    bad = []
    for kill_at in [*range(len(renames)), None]:
        root = str(tmp_path / f"kill{kill_at}")
        _branch_off(root, kill_at)
        mgr = CheckpointManager(root, ParallelState.single_process(), keep_last=1)  # the restart
        resumed = torch.load(os.path.join(mgr.find("auto"), "sub", "state.pt"))
        kept = _payloads(root)
        meta_written = kill_at is None or kill_at > meta
        expected = {"step": 4, "branch": "new"} if meta_written else old[1]
        lost = [p for p in [*old, *([expected] if meta_written else [])] if p not in kept]
        if lost or resumed != expected:
            bad.append(f"killed at rename {kill_at}: lost {lost}, resumed {resumed}")
    assert not bad, "\n".join(bad)


def test_a_kill_among_the_set_asides_of_a_resumed_run_is_finished_by_the_next_job(tmp_path):
    """Review45. A run resumed from an older step sets the later checkpoints aside as it starts training
    (``branch_from``), one rename each. Killed before any of them, the restarted job (resume=auto) must resume the
    branch point, or, killed before anything changed (before its branch_point record), the newest as before; and
    lose nothing. Before the record: killed between the set-asides, auto resumed the old branch's step 6."""
    bad = []
    for base in (2, 4):
        for kill_at in range(4):
            root = str(tmp_path / f"b{base}k{kill_at}")
            first = CheckpointManager(root, ParallelState.single_process(), keep_last=5)
            for step in (2, 4, 6):
                assert first.save(step, _writer({"step": step}), {})
            with killed_at_rename(kill_at) as renames, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                CheckpointManager(root, ParallelState.single_process()).branch_from(step_dir(root, base))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                resumed = torch.load(os.path.join(CheckpointManager(root, ParallelState.single_process()).find("auto"),
                                                  "sub", "state.pt"))["step"]
            expected = 6 if not renames else base  # the first rename puts the branch_point record in place
            if resumed != expected or sorted(p["step"] for p in _payloads(root)) != [2, 4, 6]:
                bad.append(f"from {base}, killed at rename {kill_at}: resumed {resumed}, kept {_payloads(root)}")
    assert not bad, "\n".join(bad)
