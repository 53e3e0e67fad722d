"""Damaged or unusable data, on disk for real: one line naming the file before training starts,
without reading the whole token stream."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from parallel3d.config import job_from_dict, resolve
from parallel3d.data import DataError, GPTDataset, write_indexed_dataset
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


def _negative_ids_int16(tmp_path) -> tuple[str, str]:
    """What another tool leaves when it writes int16 for a vocabulary above 32,767: ids >= 32,768 wrap
    to negative numbers (here among ids a 512-token model accepts). megatron-core's builder writes it."""
    import megatron.core.datasets.indexed_dataset as megatron_indexed  # a dev dependency (costly import: only here)
    import torch

    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, 2000)
    ids[::97] = 40_000 + np.arange(len(ids[::97]))  # ids of the big vocabulary
    prefix = str(tmp_path / "wrapped")
    builder = megatron_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int16)
    for doc in np.split(ids.astype(np.int16), 40):  # astype wraps, as a too-narrow writer does
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix, "< 0 (int16 tokens): ids above 32767 wrap to negative numbers"


def _empty(tmp_path) -> tuple[str, str]:
    return write_indexed_dataset(str(tmp_path / "empty"), []), "has 0 tokens"


CASES = {"truncated-bin": _truncated_bin, "idx-of-another-bin": _foreign_idx,
         "ids-over-vocab": _ids_over_vocab_sidecar, "ids-over-vocab-no-sidecar": _ids_over_vocab_no_sidecar,
         "negative-ids-int16": _negative_ids_int16, "empty": _empty}
# Indexed data smaller than one global batch is preflight's config error since session 46: tests/test_preflight_data_batch.py


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


def test_a_negative_id_the_start_up_check_cannot_see_fails_when_its_sample_is_read(tmp_path):
    """The sidecar (written with the data) is trusted at start-up; a .bin changed in place since then
    (same size) still fails with one line naming the file when the sample holding the bad id is read."""
    prefix = write_indexed_dataset(str(tmp_path / "d"), [np.arange(100) % VOCAB] * 4, dtype=np.int16)
    tokens = np.memmap(prefix + ".bin", dtype=np.int16, mode="r+")
    tokens[250] = -7
    tokens.flush()
    del tokens
    dataset = GPTDataset([prefix], seq_len=32, seed=0, model_vocab_size=VOCAB)  # start-up passes
    with pytest.raises(DataError) as err:
        dataset.get_samples(range(dataset.samples_per_epoch))
    assert f"{prefix}.bin" in str(err.value) and "token id -7 < 0" in str(err.value)


@pytest.mark.slow
def test_the_cli_says_it_in_one_line_before_training(tmp_path):
    """int16 data of a vocabulary above 32,767 (negative ids) fails at start-up, not mid-step with a bare
    IndexError; any user warning before it is one line too (no file, line number or source line)."""
    prefix, expect = _negative_ids_int16(tmp_path)
    proc = run_to_end([*TINY, "data=indexed", f"data.paths=[{prefix}]", "data.valid_fraction=0",
                       f"train.out_dir={tmp_path / 'run'}"], timeout=180)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith("[rank 0] failed: DataError: ")]
    assert len(failed) == 1 and f"{prefix}.bin" in failed[0] and expect in failed[0], proc.stderr[-2000:]
    assert all(line in failed or line.startswith("warning: ") for line in lines), proc.stderr[-2000:]
    assert "step " not in proc.stdout and "Traceback" not in proc.stderr


def test_a_validation_set_that_is_training_data_warns(tmp_path):
    """Session 43: data.valid_paths naming a training prefix (the same file, also through another spelling of its
    path) measured the eval loss on training data without a word. It warns; other prefixes do not."""
    import warnings

    from parallel3d.user_warnings import RunWarning

    train, other = _good(tmp_path), _good(tmp_path, "other")
    aliases = str(tmp_path / "." / "good")
    for valid, expect in (([aliases], True), ([other], False)):
        job = job_from_dict({"data": {"source": "indexed", "paths": [train], "valid_paths": valid, "valid_fraction": 0.0},
                             "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32,
                                       "out_dir": str(tmp_path / "run")}}, model="gpt_tiny")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build_datasets(resolve(job, 1), ParallelState.single_process())
        said = [str(w.message) for w in caught if issubclass(w.category, RunWarning) and "training data" in str(w.message)]
        assert bool(said) == expect, (valid, said)
