"""``scripts/profile_pipeline_switches.py``: each phase counted once per call, on every rank.

A tiny pp 2 run of 1f1b and zbv: per rank and step the counted F / B / W calls are that stage's
computations in the schedule the engine ran (``build_schedule``), receives taken are its receives,
and the phases add up to no more than the step (``rest`` >= 0 in wall and CPU time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from peer_env import free_port, spawn_results  # noqa: E402
from profile_pipeline_switches import _worker, per_step  # noqa: E402

from parallel3d.pipeline.options import PipelineOptions, drain_is_split  # noqa: E402
from parallel3d.pipeline.schedules import build_schedule  # noqa: E402

pytestmark = pytest.mark.slow


def test_phases_are_counted_per_call_and_fit_in_the_step() -> None:
    args = argparse.Namespace(stages=2, microbatches=4, schedules=["1f1b", "zbv"], steps=2, warmup=1, layers=4,
                              hidden=16, seq=8, mbs=1, vocab=64, virtual=2, prefetch=None)
    got = spawn_results(_worker, 2, free_port(), args)
    for schedule, v in (("1f1b", 1), ("zbv", 2)):
        # the engine's default drain (``parallel.split_drain``), resolved by the one rule the engine uses
        actions = build_schedule(schedule, 2, 4, v, split_drain=drain_is_split(schedule, PipelineOptions.split_drain))
        for rank in (0, 1):
            rows = per_step(got[rank][schedule])
            for kind in ("F", "B", "W"):
                want = sum(a.kind == kind for a in actions[rank])
                assert (rows[kind][4] if kind in rows else 0) == want, (schedule, rank, kind)
            assert rows["take"][4] == sum(a.kind.startswith("RECV") for a in actions[rank])
            assert rows["rest"][0] >= 0 and rows["rest"][1] >= -1e-3  # thread CPU clocks tick coarsely
