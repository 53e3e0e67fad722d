"""An evaluation-only run computes no MFU, so it does not warn that the device's peak TFLOP/s is unknown (session 46
review, item 7). Control: a one-step training run in the same setting (same device, no ``train.peak_tflops``) does
warn, so the check is not vacuous; both through the real ``Trainer``."""

from __future__ import annotations

import warnings

import pytest

from parallel3d.config import job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.trainer import train

PEAK_WARNING = "no peak TFLOP/s known"


def _peak_warnings(tmp_path, **train_keys) -> tuple[list[str], list[dict]]:
    values = {"train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 2, "seq_len": 16, "device": "cpu",
                        "eval_iters": 1, "async_save": False, "out_dir": str(tmp_path / "run"), **train_keys},
              "optimizer": {"warmup_steps": 1},
              "data": {"cache_dir": str(tmp_path / "cache"), "tokenizer": "byte", "valid_fraction": 0.05}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(resolve(job_from_dict(values, model="gpt_tiny"), 1), ParallelState.single_process())
    return [str(w.message) for w in caught if PEAK_WARNING in str(w.message)], result.records


@pytest.mark.parametrize("eval_only", [True, False], ids=["eval-only", "training-control"])
def test_only_a_run_that_computes_mfu_warns_of_an_unknown_peak(tmp_path, eval_only):
    said, records = _peak_warnings(tmp_path, eval_only=eval_only)
    assert len(records) == 1 and ("mfu" in records[0]) != eval_only, records  # what each run computes
    assert len(said) == (0 if eval_only else 1), said
