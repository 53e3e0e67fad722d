"""``bench_pipeline_report``'s split-backward ratio: (B + W) / 1f1b's B per stage, in CPU time.

Fed what the benchmark's ranks report (per round, per stage, per system: mean seconds per
(kind, chunk), in wall and in thread CPU time); the wall times here differ from the CPU
times as preemption makes them differ, so a ratio read off the wrong clock is caught.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from bench_pipeline_report import _forward_ratios, _split_backward_ratio, _split_backward_ratios  # noqa: E402


def _stage(stage: int, split: dict, base: dict, schedule: str = "zb_h1", stretch: float = 1.0) -> tuple:
    """One rank's report: ``split``/``base`` are CPU seconds per (kind, chunk); wall = CPU x ``stretch``
    for the split schedule only (its actions preempted, 1f1b's not)."""
    return (stage, {"ours zb_h1": {"schedule": schedule, "compute_cpu": split,
                                   "compute": {k: v * stretch for k, v in split.items()}},
                    "ours 1f1b": {"schedule": "1f1b", "compute_cpu": base, "compute": dict(base)}}, 0.0)


def test_per_stage_ratio_is_cpu_time_and_worst_stage_is_reported():
    rounds = [[_stage(0, {("B", 0): 0.0, ("W", 0): 1.00}, {("B", 0): 1.0}, stretch=1.3),
               _stage(1, {("B", 0): 0.6, ("W", 0): 0.44}, {("B", 0): 1.0}, stretch=1.3)],
              [_stage(0, {("B", 0): 0.0, ("W", 0): 1.02}, {("B", 0): 1.0}, stretch=1.1),
               _stage(1, {("B", 0): 0.6, ("W", 0): 0.46}, {("B", 0): 1.0}, stretch=1.1)],
              [_stage(0, {("B", 0): 0.0, ("W", 0): 1.01}, {("B", 0): 1.0}, stretch=1.2),
               _stage(1, {("B", 0): 0.6, ("W", 0): 0.50}, {("B", 0): 1.0}, stretch=1.2)]]
    per_stage = _split_backward_ratios(rounds, "ours zb_h1")
    assert per_stage == pytest.approx({0: 1.01, 1: 1.06})  # median over rounds, per stage
    assert _split_backward_ratio(rounds, "ours zb_h1") == pytest.approx(1.06)
    assert _split_backward_ratio(rounds, "ours zb_h1", key="compute") == pytest.approx(1.10 * 1.2)  # wall: another median


def test_zbv_is_a_whole_pipeline_ratio_and_1f1b_has_none():
    rounds = [[_stage(0, {("B", 0): 0.5, ("W", 0): 0.5, ("B", 1): 0.3, ("W", 1): 0.3}, {("B", 0): 1.0}, "zbv"),
               _stage(1, {("B", 0): 0.2, ("W", 0): 0.2, ("B", 1): 0.1, ("W", 1): 0.1}, {("B", 0): 1.0}, "zbv")]]
    assert _split_backward_ratios(rounds, "ours zb_h1") == pytest.approx({"all": 1.1})
    assert _split_backward_ratio(rounds, "ours 1f1b") is None


def test_forward_control_compares_the_schedules_forwards():
    rounds = [[_stage(0, {("F", 0): 1.03, ("B", 0): 0.0, ("W", 0): 1.0}, {("F", 0): 1.0, ("B", 0): 1.0}),
               _stage(1, {("F", 0): 1.10, ("B", 0): 0.6, ("W", 0): 0.5}, {("F", 0): 1.0, ("B", 0): 1.0})]]
    assert _forward_ratios(rounds, "ours zb_h1") == pytest.approx({0: 1.03, 1: 1.10})
    assert _split_backward_ratios(rounds, "ours zb_h1") == pytest.approx({0: 1.0, 1: 1.1})  # F not counted
