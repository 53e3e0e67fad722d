"""``scripts/profile_pipeline_actions.py``'s bookkeeping: the plain 1F1B (the benchmark's base) is kept apart from
the split-drain 1F1B under the benchmark's own names, and the breakdown's parts add up to B + W - full B."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from profile_pipeline_actions import _PARTS, _breakdown, _layout  # noqa: E402


@pytest.mark.parametrize("schedule,split_drain", [("1f1b", False), ("1f1b", True), ("zb_h1", False), ("zbv", False)])
def test_layout_names_follow_the_benchmark(schedule, split_drain):
    engine = SimpleNamespace(schedule_name=schedule, split_drain=split_drain)
    # bench_pipeline_group's system name less "ours " (and a v > 1 suffix): the rows its ratio reads
    want = schedule + (" plain" if schedule == "1f1b" and not split_drain else "")
    assert _layout(engine) == want


def test_breakdown_adds_up_to_the_excess():
    gen = random.Random(0)
    for _ in range(100):
        full, b, w = ([gen.uniform(0, 1e-2) for _ in _PARTS] for _ in range(3))
        parts = _breakdown(full, b, w)
        assert sum(parts.values()) == pytest.approx(b[0] + w[0] - full[0], abs=1e-12)
