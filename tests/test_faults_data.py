"""Damaged or unusable data, on disk for real: one line naming the file before training starts,
without reading the whole token stream."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from parallel3d.config import job_from_dict, resolve
from parallel3d.data import DataError, write_indexed_dataset
from parallel3d.data.indexed import stats_path
from parallel3d.datasets import build_datasets
from parallel3d.parallel_state import ParallelState
from tests.fault_runs import REPO, TINY, run_to_end

VOCAB = 512  # gpt_tiny


def _good(tmp_path, name: str = "good", docs: int = 40, vocab: int = VOCAB) -> str:
    rng = np.random.default_rng(0)
    return write_indexed_dataset(str(tmp_path / name), [rng.integers(0, vocab, 50) for _ in range(docs)])


def _truncated_bin(tmp_path) -> tuple[str, str]:
    p = _good(tmp_path)
    os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 10)
    return p, p + ".bin"


def _foreign_idx(tmp_path) -> tuple[str, str]:
    p = _good(tmp_path)
    other = _good(tmp_path, "other", docs=10)
    shutil.copy(other + ".idx", p + ".idx")  # an .idx of another dataset, shorter than this .bin
    return p, p + ".bin"


def _ids_over_vocab_sidecar(tmp_path) -> tuple[str, str]:
    return _good(tmp_path, vocab=VOCAB + 100), "token id"


def _ids_over_vocab_no_sidecar(tmp_path) -> tuple[str, str]:
    p = _good(tmp_path, vocab=VOCAB + 100)
    os.remove(stats_path(p))  # written by another tool: no max_token_id recorded
    return p, "token id"


def _empty(tmp_path) -> tuple[str, str]:
    return write_indexed_dataset(str(tmp_path / "empty"), []), "has 0 tokens"


def _smaller_than_a_batch(tmp_path) -> tuple[str, str]:
    return _good(tmp_path, "small", docs=2), "fewer than one global batch"


CASES = {"truncated-bin": _truncated_bin, "idx-of-another-bin": _foreign_idx,
         "ids-over-vocab": _ids_over_vocab_sidecar, "ids-over-vocab-no-sidecar": _ids_over_vocab_no_sidecar,
         "empty": _empty, "smaller-than-one-global-batch": _smaller_than_a_batch}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_is_one_line_naming_the_file(case, tmp_path):
    prefix, expect = CASES[case](tmp_path)
    job = job_from_dict({"data": {"source": "indexed", "paths": [prefix], "valid_fraction": 0.0},
                         "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "eval_iters": 0,
                                   "out_dir": str(tmp_path / "run")}}, model="gpt_tiny")
    with pytest.raises(DataError) as err:
        build_datasets(resolve(job, 1), ParallelState.single_process())
    message = str(err.value)
    assert "\n" not in message and prefix in message and expect in message, message


@pytest.mark.slow
def test_the_cli_says_it_in_one_line_before_training(tmp_path):
    prefix, _ = _truncated_bin(tmp_path)
    proc = run_to_end([*TINY, "data=indexed", f"data.paths=[{prefix}]", "data.valid_fraction=0",
                       f"train.out_dir={tmp_path / 'run'}"], timeout=180)
    assert proc.returncode == 1
    failed = [line for line in proc.stderr.splitlines() if "failed:" in line]
    assert failed == [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line
                      and not line.startswith("  ")], proc.stderr[-2000:]
    assert len(failed) == 1 and f"{prefix}.bin" in failed[0] and "truncated" in failed[0]
    assert "step " not in proc.stdout and "Traceback" not in proc.stderr
    assert os.path.isdir(REPO)
