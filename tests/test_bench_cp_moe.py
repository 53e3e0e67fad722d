"""``scripts/bench_cp.py`` and ``scripts/bench_moe.py`` in ``--quick`` mode, end to end.

Timings are not asserted (noisy on shared CPUs). What is: each script exits 0 only when every
implementation's whole output and gradients on the shared inputs match torch's float64
reference (the scripts' own check; a wrong attention or MoE, or a peer fed other inputs,
exits 1), and the JSON it writes is consistent: every variant / layout timed with positive
times, paired ratios equal to the per-round quotients, tokens/s from the step time, peak
memory read from outside the ranks, the ring's hidden share a fraction. DeepSpeed runs when its
own environment exists (``.cache/peers/deepspeed-venv``: the benchmarks create it on first
use, which needs the package index); otherwise the peer is left out and
``test_deepspeed_peer_environment`` says why it was skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PEER_PY = ROOT / ".cache/peers/deepspeed-venv/bin/python"
TOLERANCE = 1e-4

pytestmark = pytest.mark.slow


def _run(script: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{script}.json"
    peers = ["--no-install"] if PEER_PY.exists() else ["--peers"]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--quick", "--out", str(out), *peers],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _check_spread(spread: dict) -> None:
    rounds = spread["rounds"]
    assert rounds and all(t > 0 for t in rounds)
    assert spread["min"] == min(rounds) and spread["max"] == max(rounds)
    assert spread["min"] <= spread["median"] <= spread["max"]


def _check_row(row: dict, peer_row: dict | None) -> None:
    _check_spread(row["step_ms"])
    assert 0 <= row["mismatch"] <= TOLERANCE, row
    assert row["peak_rss_bytes"] > 50 * 2**20  # a process holding torch, as the kernel counts it
    assert 0 <= row["peak_over_base_bytes"] <= row["peak_rss_bytes"]
    if peer_row is not None and row is not peer_row:
        want = [a / b for a, b in zip(row["step_ms"]["rounds"], peer_row["step_ms"]["rounds"])]
        assert row["vs_deepspeed"]["rounds"] == pytest.approx(want)


def test_bench_cp_quick(tmp_path: Path) -> None:
    data = _run("bench_cp.py", tmp_path)
    assert data["mismatches"] == []
    (res,) = data["results"]
    assert res["cp"] == 2
    impls = [r["impl"] for r in res["rows"]]
    assert impls[:5] == ["ours p2p", "ours allgather", "ours a2a", "ours a2a+p2p/1", "ours a2a+p2p/2"]
    peer = next((r for r in res["rows"] if r["impl"] == "deepspeed Ulysses"), None)
    assert (peer is not None) == PEER_PY.exists()
    for row in res["rows"]:
        _check_row(row, peer)
        _check_spread(row["cpu_ms_per_rank"])
        if peer is not None and row is not peer:
            want = [a / b for a, b in zip(row["cpu_ms_per_rank"]["rounds"], peer["cpu_ms_per_rank"]["rounds"])]
            assert row["cpu_vs_deepspeed"]["rounds"] == pytest.approx(want)
    o = res["overlap"]
    for key in ("comm_ms", "compute_ms", "overlapped_ms"):
        _check_spread(o[key])
    assert 0.0 <= o["hidden"]["median"] <= 1.0
    assert o["compute_per_step_ms"] == pytest.approx(o["compute_ms"]["median"] / 2)
    assert data["targets"]["p2p_overlap_cp2"] in ("met", "NOT met", "n/a")
    if peer is not None:
        assert data["targets"]["a2a_vs_deepspeed_cp2"] in ("met", "NOT met")
        assert data["targets"]["a2a_cpu_vs_deepspeed_cp2"] in ("met", "NOT met")


def test_bench_moe_quick(tmp_path: Path) -> None:
    data = _run("bench_moe.py", tmp_path)
    assert data["mismatches"] == []
    (res,) = data["results"]
    cfg = data["config"]
    rows = {r["impl"]: r for r in res["rows"]}
    assert set(rows) == ({"ours", "deepspeed MoE"} if PEER_PY.exists() else {"ours"})
    peer = rows.get("deepspeed MoE")
    for row in rows.values():
        _check_row(row, peer)
        tokens = res["ep"] * cfg["batch"] * cfg["seq"]
        assert row["tokens_per_s"] == pytest.approx(tokens / (row["step_ms"]["median"] / 1e3))
        _check_spread(row["cpu_ms_per_rank"])
        if peer is not None and row is not peer:
            want = [a / b for a, b in zip(row["cpu_ms_per_rank"]["rounds"], peer["cpu_ms_per_rank"]["rounds"])]
            assert row["cpu_vs_deepspeed"]["rounds"] == pytest.approx(want)
    phases = res["phases_ms"]
    assert all(phases[p] > 0 for p in ("route", "dispatch", "experts", "combine", "forward_backward"))
    assert phases["dispatch_combine_over_experts"] == pytest.approx(
        (phases["dispatch"] + phases["combine"]) / phases["experts"])


@pytest.mark.extended  # a clean clone has no peer environment: `python scripts/bench_cp.py --quick` creates it
def test_deepspeed_peer_environment() -> None:
    """The benchmarks' DeepSpeed environment imports the two peers they time (Ulysses, DeepSpeed-MoE)."""
    if not PEER_PY.exists():
        pytest.skip(f"DeepSpeed's own environment {PEER_PY.parent.parent} is missing, so the quick benchmarks ran "
                    "without their peer; `python scripts/bench_cp.py --quick` creates it (needs the package index)")
    proc = subprocess.run([str(PEER_PY), "-c", "import deepspeed.sequence.layer, deepspeed.moe.layer"],
                          capture_output=True, text=True, timeout=120, env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_remove_peer_shm_only_that_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's leaked DeepSpeed all-reduce buffers go, another run's (another port) stay."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from peer_env import remove_peer_shm

    mine = [f"deepspeed_allreduce_buffer_0_127.0.0.1_41234_{r}" for r in range(2)]
    others = ["deepspeed_allreduce_buffer_0_127.0.0.1_412345_0", "deepspeed_allreduce_buffer_0_127.0.0.1_31234_0"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(remove_peer_shm(41234, str(tmp_path))) == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)
