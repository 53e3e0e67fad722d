"""What cannot resume is refused in one line: another model's shape, the old per-rank format."""

from __future__ import annotations

import json
import os

import pytest

from parallel3d.checkpoint import CheckpointError, step_dir
from parallel3d.config import ConfigError
from tests.test_train_e2e import job_values, train_single

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


def test_another_model_shape_is_refused_in_one_line(tmp_path, cache_dir):
    out = str(tmp_path / "run")
    train_single("gpt_tiny", job_values(out, cache_dir, train={"stop_after": 1}))
    with pytest.raises(ConfigError) as caught:  # resume=auto: preflight's line (session 45), before any rank
        train_single("gpt_tiny", job_values(out, cache_dir, model={"hidden_size": 128}))
    message = str(caught.value)
    assert "\n" not in message
    assert "holds another model (hidden_size=64 there, 128 here; ffn_size=256 there, 512 here)" in message
    # Settings that do not change a parameter's shape may change on resume.
    assert sorted(train_single("gpt_tiny", job_values(out, cache_dir, model={"dropout": 0.1}))) == [2, 3, 4]


def test_old_per_rank_checkpoints_are_refused_in_one_line(tmp_path, cache_dir):
    out = str(tmp_path / "run")
    old = step_dir(os.path.join(out, "checkpoints"), 3)
    os.makedirs(os.path.join(old, "zero"))
    with open(os.path.join(old, "zero", "tp0_pp0_dp0.pt"), "wb") as fh:
        fh.write(b"old")
    with open(os.path.join(old, "meta.json"), "w") as fh:
        json.dump({"step": 3, "layout": {"tp": 1, "pp": 1}, "files": ["zero/tp0_pp0_dp0.pt"]}, fh)
    with pytest.raises(CheckpointError, match=r"uses the old per-rank format .*which this version does not read"):
        train_single("gpt_tiny", job_values(out, cache_dir))
