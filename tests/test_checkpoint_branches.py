"""Explicit resumes of checkpoints that recovery sets aside, and resumes of set-aside ones (gaps47, items 1-2).

1. ``train.resume=<dir>`` naming a checkpoint that the next job's recovery (``CheckpointManager._recover``) then set
   aside (a step after an unfinished ``branch_point``, or one a complete ``.tmp`` of an earlier step would displace)
   failed on the rank: ``[rank 0] failed: CheckpointError: ... not a complete checkpoint directory``, exit 1. As in
   Megatron (``--load`` with ``--ckpt-step``) the named checkpoint is resumed: the explicit choice wins over the
   interrupted run's, and nothing is lost (a displaced ``.tmp`` is set aside, loadable).
2. A run resumed from ``step_<N>.superseded`` and killed before its first save left ``auto`` on the other branch
   (or on nothing, starting over at step 0). Its checkpoint is now put back as ``step_<N>``, the checkpoints of step
   ``N`` on and those written after it (not its history) set aside, so ``auto`` continues it; a kill at any rename
   loses nothing. Reference: the real manager and trainer; payloads say which run wrote each checkpoint.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from parallel3d.checkpoint import BRANCH_POINT, CheckpointManager, complete_checkpoints, step_dir
from parallel3d.config import ConfigError
from parallel3d.parallel_state import ParallelState
from parallel3d.preflight import _auto_candidates, check_checkpoints
from parallel3d.checkpoint_io.options import CheckpointOptions
from tests.test_resume_cli import _args, _train_in_process
from tests.test_train_checkpoint import _payloads, _writer, killed_at_rename

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]
ONE = ParallelState.single_process


def _old_run(root: str) -> None:
    """A run that saved steps 2, 4, 6 (payload branch "old")."""
    first = CheckpointManager(root, ONE(), keep_last=5)
    for step in (2, 4, 6):
        assert first.save(step, _writer({"step": step, "branch": "old"}), {})


def _payload(directory: str | None) -> dict | None:
    return None if directory is None else torch.load(os.path.join(directory, "sub", "state.pt"))


def test_the_cli_resumes_a_checkpoint_an_unfinished_set_aside_would_move(tmp_path):
    """The user's case: a run resumed from step 2 was killed among its set-asides (``branch_point`` left); the user
    then names step 4 explicitly. Before: ``CheckpointError: ... not a complete checkpoint directory`` on the rank."""
    out, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    _train_in_process(_args(out, cache, "train.steps=4", "train.save_every=2", "train.keep_last=5"))
    root = os.path.join(out, "checkpoints")
    with open(os.path.join(root, BRANCH_POINT), "w") as fh:
        fh.write("2")
    records, _ = _train_in_process(_args(out, cache, "train.steps=5", "train.save_every=2", "train.keep_last=5",
                                         f"train.resume={step_dir(root, 4)}"))
    assert [r["step"] for r in records] == [5]  # resumed at step 4
    assert [s for s, _ in complete_checkpoints(root)] == [2, 4, 5] and not os.path.exists(
        os.path.join(root, BRANCH_POINT))


@pytest.mark.parametrize("case", ["branch_point", "tmp", "restore"])
def test_recovery_never_moves_the_checkpoint_named_and_loses_nothing(tmp_path, case):
    root = str(tmp_path / "ckpt")
    _old_run(root)
    named = step_dir(root, 6)
    if case == "branch_point":  # a run resumed from step 2, killed before its set-asides
        with open(os.path.join(root, BRANCH_POINT), "w") as fh:
            fh.write("2")
    elif case == "tmp":  # a kill among the renames of a save of step 4 (its meta.json written): publishing it
        os.replace(step_dir(root, 4), step_dir(root, 4) + ".tmp")  # would set aside step 6
    else:  # a run resumed from the set-aside step 6, killed right after its branch_point record
        CheckpointManager(root, ONE()).branch_from(step_dir(root, 2))
        named = step_dir(root, 6) + ".superseded"
        with open(os.path.join(root, BRANCH_POINT), "w") as fh:
            fh.write(f"6 {os.path.basename(named)}")
    before = sorted(p["step"] for p in _payloads(root))
    mgr = CheckpointManager(root, ONE(), keep=named)
    assert _payload(mgr.find(named)) == {"step": 6, "branch": "old"}
    assert sorted(p["step"] for p in _payloads(root)) == before  # nothing lost (a displaced .tmp set aside)


def _resume_set_aside(root: str, kill_at: int | None) -> list[str]:
    """Old run 2, 4, 6; a run resumed from 2 saved its own 4 ("new"); then a run resumes the set-aside old 6 and is
    killed before its ``kill_at``-th rename (None: not killed), before its first save. Returns the renames."""
    _old_run(root)
    mgr = CheckpointManager(root, ONE(), keep_last=5)
    mgr.branch_from(step_dir(root, 2))
    assert mgr.save(4, _writer({"step": 4, "branch": "new"}), {})
    with killed_at_rename(kill_at) as renames:
        CheckpointManager(root, ONE()).branch_from(step_dir(root, 6) + ".superseded")
    return [dst for _, dst in renames]


def test_a_run_resumed_from_a_set_aside_checkpoint_and_killed_before_saving_is_continued_by_auto(tmp_path):
    renames = _resume_set_aside(str(tmp_path / "count"), None)
    bad = []
    for kill_at in [*range(len(renames)), None]:
        root = str(tmp_path / f"kill{kill_at}")
        _resume_set_aside(root, kill_at)
        kept = sorted((p["step"], p["branch"]) for p in _payloads(root))
        preflight_sees = _payload(_auto_candidates(root)[-1])
        mgr = CheckpointManager(root, ONE(), keep_last=5)  # the next job, train.resume=auto
        resumed = _payload(mgr.find("auto"))
        lineage = sorted(_payload(p)["branch"] for _, p in complete_checkpoints(root))
        # Before the branch_point record (the first rename) nothing changed: auto takes the newest, the new step 4.
        expected = {"step": 6, "branch": "old"} if kill_at != 0 else {"step": 4, "branch": "new"}
        if (resumed != expected or preflight_sees != expected or kept != [(2, "old"), (4, "new"), (4, "old"),
                                                                          (6, "old")]
                or (kill_at != 0 and lineage != ["old", "old"])):  # the new step 4 (not step 6's history) aside
            bad.append(f"killed at rename {kill_at}: resumed {resumed}, preflight {preflight_sees}, kept {kept}, "
                       f"auto's branch {lineage}")
    assert not bad, "\n".join(bad)


def test_naming_a_set_aside_checkpoint_that_a_run_restored_is_one_line(tmp_path):
    """Relaunching the same command after the restore: the directory is gone, so preflight names where it is."""
    out = str(tmp_path / "run")
    root = os.path.join(out, "checkpoints")
    _resume_set_aside(root, None)
    named = step_dir(root, 6) + ".superseded"
    with pytest.raises(ConfigError) as exc:
        check_checkpoints(CheckpointOptions(resume=named), out, None)  # type: ignore[arg-type]
    assert "\n" not in str(exc.value) and f"restored as {step_dir(root, 6)}" in str(exc.value), exc.value
