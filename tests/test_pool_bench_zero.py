"""``scripts/pool_bench_zero.py`` pools every round's ratio to DDP's round of the same file, over files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from pool_bench_zero import pooled_ratios  # noqa: E402


def _file(tmp_path: Path, name: str, ddp: list[float], zero: list[float]) -> str:
    rows = [{"dp": 2, "method": "ddp", "round_s": ddp, "round_cpu_s": ddp},
            {"dp": 2, "method": "zero0", "round_s": zero, "round_cpu_s": [2 * z for z in zero]}]
    path = tmp_path / name
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_rounds_pair_within_their_own_file(tmp_path):
    a = _file(tmp_path, "a.json", [1.0, 2.0], [1.5, 2.0])
    b = _file(tmp_path, "b.json", [4.0], [2.0])  # a round paired with another file's DDP would read 0.75 / 1.0
    pooled = pooled_ratios([a, b])[(2, "zero0")]
    assert sorted(pooled["wall"]) == sorted([1.5 / 1.0, 2.0 / 2.0, 2.0 / 4.0])
    assert sorted(pooled["cpu"]) == sorted([3.0 / 1.0, 4.0 / 2.0, 4.0 / 4.0])
