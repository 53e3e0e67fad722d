"""End to end: the trainer on 1 rank vs 8 ranks (tp=2, pp=2, dp=2) gives the same losses.

The reference is the same trainer on one process (``ParallelState.single_process``);
fp32, dropout off, so the only differences are summation orders (rel. error < 1e-4).
Also: checkpoint at step k + resume gives bit-identical losses afterwards.
"""

from __future__ import annotations

import json
import os

import pytest

from parallel3d.config import job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.trainer import train
from tests.harness import run_on_ranks

STEPS = 4
pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")  # CPU: no MFU, by design


def job_values(out_dir: str, cache_dir: str, **sections) -> dict:
    values = {
        "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "seed": 7,
                  "out_dir": out_dir, "save_every": 0, "device": "cpu"},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1},
        "data": {"cache_dir": cache_dir},
        "logging": {"log_every": 1},
    }
    for name, extra in sections.items():
        values[name] = {**values.get(name, {}), **extra}
    return values


def losses_of(out_dir: str) -> dict[int, float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return {r["step"]: r["loss"] for r in map(json.loads, fh)}


def train_on_rank(rank: int, world: int, model: str, values: dict) -> list:
    rj = resolve(job_from_dict(values, model=model), world)
    pstate = ParallelState(rj.topology)
    result = train(rj, pstate)
    return [(r["step"], r["loss"]) for r in result.records]


def train_single(model: str, values: dict) -> dict[int, float]:
    rj = resolve(job_from_dict(values, model=model), 1)
    result = train(rj, ParallelState.single_process())
    return {r["step"]: r["loss"] for r in result.records}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


GPT_LAYOUT = {"tp": 2, "pp": 2, "dp": 2, "zero_stage": 2}
# Llama with GQA, also through sequence parallelism, the interleaved schedule and another rank order.
LLAMA_LAYOUT = {"tp": 2, "pp": 2, "dp": 2, "zero_stage": 1, "sequence_parallel": True,
                "schedule": "interleaved_1f1b", "virtual_stages": 2, "order": "dp-pp-tp"}


def assert_close(got: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert abs(got[step] - ref[step]) / abs(ref[step]) < 1e-4, (step, got[step], ref[step])
    assert ref[STEPS] < ref[1]  # it learns


@pytest.fixture(scope="module")
def gpt_single(tmp_path_factory, cache_dir) -> dict[int, float]:
    """The one-process gpt_tiny run's losses, trained once for the module: the reference of the layouts and the
    uninterrupted run a one-process resume must equal."""
    return train_single("gpt_tiny", job_values(str(tmp_path_factory.mktemp("gpt1") / "run"), cache_dir))


@pytest.fixture(scope="module")
def gpt_8_ranks(tmp_path_factory, cache_dir) -> tuple[str, list]:
    out = str(tmp_path_factory.mktemp("gpt8") / "run")
    results = run_on_ranks(train_on_rank, 8, "gpt_tiny", job_values(out, cache_dir, parallel=GPT_LAYOUT), timeout=240)
    return out, results


@pytest.mark.slow
def test_gpt_8_ranks_match_1_rank(gpt_single, gpt_8_ranks):
    ref = gpt_single
    out, results = gpt_8_ranks
    assert_close(losses_of(out), ref)
    # Only the logging rank (last stage, tp=0, dp=0) recorded anything.
    logging_rank = Topology(tp=2, pp=2, dp=2).rank_of(tp=0, dp=0, pp=1)
    assert [bool(r) for r in results] == [rank == logging_rank for rank in range(8)]


@pytest.mark.slow
def test_llama_gqa_8_ranks_match_1_rank(tmp_path, cache_dir):
    ref = train_single("llama_tiny", job_values(str(tmp_path / "ref"), cache_dir))
    out = str(tmp_path / "par")
    run_on_ranks(train_on_rank, 8, "llama_tiny", job_values(out, cache_dir, parallel=LLAMA_LAYOUT), timeout=240)
    assert_close(losses_of(out), ref)


@pytest.mark.slow
def test_resume_on_8_ranks_is_bit_identical(tmp_path, cache_dir, gpt_8_ranks):
    out = str(tmp_path / "stopped")
    values = job_values(out, cache_dir, parallel=GPT_LAYOUT)
    run_on_ranks(train_on_rank, 8, "gpt_tiny", dict(values, train={**values["train"], "stop_after": 2}), timeout=240)
    assert sorted(losses_of(out)) == [1, 2]
    run_on_ranks(train_on_rank, 8, "gpt_tiny", values, timeout=240)
    assert losses_of(out) == losses_of(gpt_8_ranks[0])


def _zero3_disk(out_dir: str, cache_dir: str, **train) -> dict:
    layout = {"pp": 2, "dp": 2, "zero_stage": 3, "offload": "disk", "offload_dir": os.path.join(out_dir, "offload")}
    values = job_values(out_dir, cache_dir, parallel=layout)
    values["train"].update(train)
    return values


@pytest.mark.slow
def test_zero3_with_disk_offload_matches_1_rank_and_resumes_bit_identical(tmp_path, cache_dir, gpt_single):
    """Through the real Trainer: stage 3 (pp=2, so parameters whole per step) with the optimizer state
    in files matches one process, and a run stopped after step 2 resumes (state files restored from the
    checkpoint) to the same losses as the uninterrupted run."""
    ref = gpt_single
    full = str(tmp_path / "full")
    run_on_ranks(train_on_rank, 4, "gpt_tiny", _zero3_disk(full, cache_dir), timeout=240)
    assert_close(losses_of(full), ref)
    out = str(tmp_path / "stopped")
    run_on_ranks(train_on_rank, 4, "gpt_tiny", _zero3_disk(out, cache_dir, stop_after=2), timeout=240)
    assert sorted(losses_of(out)) == [1, 2]
    run_on_ranks(train_on_rank, 4, "gpt_tiny", _zero3_disk(out, cache_dir), timeout=240)
    assert losses_of(out) == losses_of(full)


def test_resume_is_bit_identical(tmp_path, cache_dir, gpt_single):
    full = gpt_single
    out = str(tmp_path / "stopped")
    stopped = train_single("gpt_tiny", job_values(out, cache_dir, train={"stop_after": 2}))
    assert sorted(stopped) == [1, 2]
    resumed = train_single("gpt_tiny", job_values(out, cache_dir))
    assert sorted(resumed) == [3, 4]
    assert {s: resumed[s] for s in (3, 4)} == {s: full[s] for s in (3, 4)}
    assert losses_of(out) == full  # metrics.jsonl of the resumed run reads like the uninterrupted one


def test_unreachable_wandb_server_falls_back_to_offline_and_training_goes_on(tmp_path, cache_dir, monkeypatch):
    import socket
    import threading

    from parallel3d.wandb_reader import find_offline_runs, read_run

    # A W&B "server" on loopback that accepts connections and never answers.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = str(tmp_path / "run")
    values = job_values(out, cache_dir, logging={"wandb": {"mode": "online", "init_timeout_s": 2}})
    try:
        with pytest.warns(UserWarning, match="logging offline to") as caught:
            losses = train_single("gpt_tiny", values)
    finally:
        server.close()
        for conn in held:
            conn.close()
    fallback = [str(w.message) for w in caught if "logging offline to" in str(w.message)]
    assert len(fallback) == 1 and "wandb sync " in fallback[0] and "init_timeout_s=2" in fallback[0]
    assert not any("W&B disabled" in str(w.message) for w in caught)
    assert sorted(losses) == sorted(losses_of(out)) == list(range(1, STEPS + 1))
    # The offline run holds what was logged, ready for `wandb sync`.
    runs = find_offline_runs(out)
    assert len(runs) == 1 and runs[0].split(os.sep)[-2] in fallback[0]
    run = read_run(runs[0], wait_s=60)
    assert [r["train/loss"] for r in run["history"] if "train/loss" in r] == pytest.approx(
        [losses[s] for s in sorted(losses)])
