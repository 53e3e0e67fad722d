"""Progress lines of a long search (``planning.search_progress``) and their place in ``planner.plan``.

A 1T-parameter model on 16,384 GPUs took 5 CPU minutes to plan (25 wall minutes on a busy machine,
2026-12-06) with no output until the end; ``scripts/plan.py`` now prints a line every 10 s on stderr.
"""

from __future__ import annotations

from models import ModelConfig
from parallel3d.planning import planner
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.planner import plan
from parallel3d.planning.request import PlanRequest
from parallel3d.planning.search_progress import SearchProgress


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_lines_are_throttled_and_carry_counts_and_an_eta():
    clock, lines = FakeClock(), []
    ticker = SearchProgress(lines.append, interval_s=10.0, clock=clock)
    clock.t = 5.0
    ticker.layouts(10, 100, 4)
    assert lines == []  # before the interval: silent
    clock.t = 20.0
    ticker.layouts(40, 100, 30)
    assert len(lines) == 1 and "40 of 100 layouts, 30 fit" in lines[0]
    assert "~30.0s left" in lines[0] and "20.0s elapsed" in lines[0]  # 0.5 s a layout, 60 to go
    clock.t = 21.0
    ticker.bounded(100, 70)  # a search that spoke reports each pass end, due or not
    ticker.finished(12)
    assert "70 fitting settings" in lines[1] and "12 settings simulated" in lines[2]


def test_a_short_search_prints_nothing():
    clock, lines = FakeClock(), []
    ticker = SearchProgress(lines.append, interval_s=10.0, clock=clock)
    clock.t = 1.0
    ticker.layouts(5, 10, 5)
    ticker.bounded(10, 8)
    ticker.simulated(3, 8)
    ticker.finished(8)
    assert lines == []


def test_plan_reports_both_passes(monkeypatch):
    monkeypatch.setattr(planner, "SearchProgress", lambda report: SearchProgress(report, interval_s=0.0))
    config = ModelConfig(arch="llama", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                         ffn_hidden_size=1408, vocab_size=32000, max_seq_len=2048)
    lines: list[str] = []
    result = plan(config, ClusterSpec.build(16, 8, "h100_80gb"), PlanRequest(global_batch_size=64, seq_len=2048),
                  progress=lines.append)
    assert result.ranked
    layouts = [x for x in lines if "memory and bound:" in x]
    assert len(layouts) == result.considered - 1  # every layout after the first, at interval 0
    assert f"memory and bound done: {result.considered:,} layouts" in " ".join(lines)
    assert lines[-1].startswith(f"plan: done: {result.simulated:,} settings simulated")


def test_plan_without_progress_is_silent(capsys):
    config = ModelConfig(arch="gpt", num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, max_seq_len=128)
    plan(config, ClusterSpec.build(2, 8, "a100_80gb"), PlanRequest(global_batch_size=4, seq_len=128))
    assert capsys.readouterr() == ("", "")
