"""Indexed data smaller than one global batch is a config error before any process group (session 46 review, item 6).

README's "Bad data" promises one ``config error:`` line and exit 2; it was ``[rank 0] failed: DataError: ... fewer
than one global batch`` and exit 1 (session 45's trial). Preflight now counts the samples of the datasets the ranks
will build (training, and the validation set: ``data.valid_paths`` or the held-out ``data.valid_fraction`` tail).
Reference: the sample count from the documents' token total (``(tokens - 1) // seq_len``, the dataset's stated
chunking) where nothing is held out, else the ranks' own ``GPTDataset`` split. The built-in corpus is tokenized on
the rank at first use and counted there by the same rule (``preflight.refuse_short``: exit 2), tested at the end.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from parallel3d import train as train_cli
from parallel3d.config import ConfigError, job_from_dict, resolve
from parallel3d.data import GPTDataset, write_indexed_dataset

SEQ, DOC = 16, 20  # seq_len; tokens per document


def _data(tmp_path, name: str, samples: int) -> str:
    """An indexed dataset of exactly ``samples`` samples of ``SEQ`` (whole documents plus a short last one)."""
    tokens = samples * SEQ + 1
    docs = [np.arange(DOC) % 250 for _ in range(tokens // DOC)] + ([np.arange(tokens % DOC)] if tokens % DOC else [])
    prefix = write_indexed_dataset(str(tmp_path / name), docs)
    assert (sum(len(d) for d in docs) - 1) // SEQ == samples
    return prefix


def _values(tmp_path, gbs: int, paths: list[str], **data_keys) -> dict:
    valid = bool(data_keys.get("valid_paths")) or data_keys.get("valid_fraction", 0.0) > 0
    return {"train": {"global_batch_size": gbs, "micro_batch_size": 1, "seq_len": SEQ, "eval_iters": int(valid),
                      "out_dir": str(tmp_path / "run"), "device": "cpu"},
            "data": {"source": "indexed", "paths": paths, "valid_fraction": 0.0, **data_keys}}


def _refusal(values: dict) -> str | None:
    try:
        resolve(job_from_dict(values, model="gpt_tiny"), 1)
    except ConfigError as exc:
        return str(exc)
    return None


def _cases() -> list[tuple[str, int, int, int | None, float]]:
    """(id, global batch, training samples, validation samples or None, held-out fraction)."""
    out = []
    for gbs in (4, 8):
        for delta in (-1, 0, 1):
            out.append((f"train-gbs{gbs}{delta:+d}", gbs, gbs + delta, None, 0.0))
            out.append((f"valid_paths-gbs{gbs}{delta:+d}", gbs, 4 * gbs, gbs + delta, 0.0))
    return out + [(f"held-out-{f}", 4, 40, None, f) for f in (0.05, 0.1, 0.2)]


CASES = _cases()


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_preflight_refuses_exactly_the_data_smaller_than_a_global_batch(tmp_path, case):
    _, gbs, train_samples, valid_samples, held_out = CASES[case]
    prefix = _data(tmp_path, "train", train_samples)
    keys: dict = {"valid_fraction": held_out}
    short = {"training": train_samples} if train_samples < gbs else {}
    if valid_samples is not None:
        keys["valid_paths"] = [_data(tmp_path, "valid", valid_samples)]
        short.update({"validation": valid_samples} if valid_samples < gbs else {})
    if held_out:
        split = {s: GPTDataset([prefix], seq_len=SEQ, split=s, valid_fraction=held_out).samples_per_epoch
                 for s in ("train", "valid")}
        short = {name: split[s] for name, s in (("training", "train"), ("validation", "valid")) if split[s] < gbs}
    refused = _refusal(_values(tmp_path, gbs, [prefix], **keys))
    if not short:
        assert refused is None, refused
        return
    name, samples = next(iter(short.items()))  # training is judged first
    assert refused is not None and "\n" not in refused
    assert refused.startswith(f"train.global_batch_size={gbs}: {name} data ") and \
        f"has {samples} samples of seq_len={SEQ}: fewer than one global batch" in refused, refused


def test_the_entry_point_says_it_in_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """The CLI's entry (``parallel3d.train.main``) with Hydra's app replaced by a failure: before the fix the job was
    accepted here and the rank failed (exit 1)."""
    prefix = _data(tmp_path, "train", 3)

    def started(*_a, **_k):
        raise AssertionError("a job whose data is smaller than one global batch was accepted")

    monkeypatch.setattr(train_cli, "hydra_app", started)
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(["data=indexed", f"data.paths=[{prefix}]", "data.valid_fraction=0", "train.eval_iters=0",
                        "train.global_batch_size=4", "train.micro_batch_size=1", f"train.seq_len={SEQ}",
                        "train.device=cpu", f"train.out_dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert err.splitlines() == [f"config error: train.global_batch_size=4: training data ['{prefix}'] has 3 samples of "
                                f"seq_len={SEQ}: fewer than one global batch; use a smaller train.global_batch_size "
                                f"or train.seq_len, or more data"]


def _corpus_values(tmp_path, cache: str) -> dict:
    return {"train": {"global_batch_size": 8192, "micro_batch_size": 64, "seq_len": 64, "eval_iters": 0,
                      "out_dir": str(tmp_path / "run"), "device": "cpu"},
            "data": {"cache_dir": cache, "tokenizer": "byte", "valid_fraction": 0.0}}


def test_the_built_in_corpus_is_the_same_rule_tokenized_or_not(tmp_path, monkeypatch, capsys):
    """gaps47: the built-in corpus smaller than one global batch was ``[rank 0] failed: DataError`` and exit 1. At
    its first use (tokenized on the rank, after preflight) the rank now applies preflight's ``refuse_short``: the
    CLI's one ``config error:`` line, exit 2; once cached, preflight counts it (``resolve`` refuses, nothing built)."""
    cache = str(tmp_path / "cache")
    args = ["train.global_batch_size=8192", "train.micro_batch_size=64", "train.seq_len=64", "train.eval_iters=0",
            "train.device=cpu", f"train.out_dir={tmp_path / 'run'}", f"data.cache_dir={cache}", "data.tokenizer=byte",
            "data.valid_fraction=0"]
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(args)
    err = capsys.readouterr().err.splitlines()
    line = [e for e in err if e.startswith("config error:")]
    assert exit_info.value.code == 2 and len(line) == 1, err
    assert re.fullmatch(r"config error: train\.global_batch_size=8192: training data \[.*\] has \d+ samples of "
                        r"seq_len=64: fewer than one global batch; use a smaller train\.global_batch_size or "
                        r"train\.seq_len, or more data", line[0]), line[0]
    assert _refusal(_corpus_values(tmp_path, cache)) == line[0].removeprefix("config error: ")  # cached: preflight
    assert _refusal(_corpus_values(tmp_path, str(tmp_path / "empty"))) is None  # not tokenized: the rank's to count
    assert not os.path.exists(tmp_path / "empty")
