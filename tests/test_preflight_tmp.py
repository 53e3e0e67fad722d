"""Preflight under ``train.resume=auto`` judges the checkpoint the ranks will resume (session 46 review, item 1).

Rank 0's ``CheckpointManager`` first publishes every complete ``step_<N>.tmp`` (a kill came among a save's renames),
setting aside the checkpoints of step ``N`` and later, and finishes a ``branch_point`` set-aside; ``auto`` then takes
the newest. Preflight read only the complete ``step_<N>`` directories, so a newer ``.tmp`` of another model passed it
and failed on every rank (exit 1), and an older ``.tmp`` of this model was refused for the newer ``step_<N>`` the
ranks would have set aside. Reference: the real ``CheckpointManager`` (its ``_recover``, then ``latest``) on a copy
of the same directory, for generated directory states.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import shutil

import pytest

from models import get_config
from parallel3d.checkpoint import BRANCH_POINT, CheckpointManager, read_meta, step_dir
from parallel3d.checkpoint_io.compat import FORMAT
from parallel3d.checkpoint_io.options import CheckpointOptions
from parallel3d.option_checks import ConfigError
from parallel3d.parallel_state import ParallelState
from parallel3d.preflight import check_checkpoints

JOB = get_config("gpt_tiny")
MODELS = {"same": JOB, "other": dataclasses.replace(JOB, num_layers=JOB.num_layers + 1)}
KINDS = ("none", "complete-same", "complete-other", "tmp-same", "tmp-other")  # what each step's directory is


def _states() -> list[tuple[tuple[str, ...], int | None]]:
    """Every kind at steps 1 and 2 (with and without a branch point at step 1), and a seeded sample at 3 steps."""
    two = [(kinds, branch) for kinds in itertools.product(KINDS, repeat=2) for branch in (None, 1)]
    three = random.Random(46).sample([(kinds, branch) for kinds in itertools.product(KINDS, repeat=3)
                                      for branch in (None, 1, 2)], 24)
    return two + three


STATES = _states()


def _write(root: str, kinds: tuple[str, ...], branch: int | None, scratch: str) -> None:
    """Each step's checkpoint saved alone (a save sets aside later steps), then moved into ``root``."""
    os.makedirs(root)
    single = ParallelState.single_process()
    for step, kind in enumerate(kinds, start=1):
        if kind == "none":
            continue
        alone = os.path.join(scratch, f"alone{step}")
        model = MODELS[kind.split("-")[1]]
        CheckpointManager(alone, single).save(step, lambda d: None, {"format": FORMAT, "model": dataclasses.asdict(model)})
        os.replace(step_dir(alone, step), step_dir(root, step) + (".tmp" if kind.startswith("tmp") else ""))
    if branch is not None:
        with open(os.path.join(root, BRANCH_POINT), "w") as fh:
            fh.write(str(branch))


def _resumed_model(root: str) -> str | None:
    """Which model the ranks resume: the real manager's recovery and choice, on a copy."""
    copy = root + ".ranks"
    shutil.copytree(root, copy)
    path = CheckpointManager(copy, ParallelState.single_process()).latest()
    if path is None:
        return None
    return "same" if read_meta(path)["model"]["num_layers"] == JOB.num_layers else "other"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_preflight_refuses_exactly_when_the_ranks_would_resume_another_model(tmp_path):
    wrong = []
    for i, (kinds, branch) in enumerate(STATES):
        out = str(tmp_path / f"s{i}")
        root = os.path.join(out, "checkpoints")
        _write(root, kinds, branch, str(tmp_path / f"scratch{i}"))
        try:
            check_checkpoints(CheckpointOptions(resume="auto"), out, JOB)
            refused = None
        except ConfigError as exc:
            refused = str(exc)
        resumed = _resumed_model(root)
        if (refused is not None) != (resumed == "other"):
            wrong.append((kinds, branch, resumed, refused))
        elif refused is not None:  # one line naming the directory on disk that holds the other model
            assert refused.startswith(f"train.resume=auto: checkpoint {root}/step_") and "\n" not in refused, refused
            assert "holds another model" in refused, refused
    assert not wrong, f"{len(wrong)} of {len(STATES)} states judged unlike the ranks, e.g. {wrong[:3]}"
