"""``scripts/bench_pipeline_timeline.py``: per-rank timelines of a benchmarked step beside its simulators.

A synthetic "measurement" recorded from a processor-sharing run (each computation's span split
between the executor's time and the computation in proportion to their work, as the ranks' clocks
would split it; CPU time the work), fed
back: every rank's runnable / blocked / tail time and the end of each computation must be the
simulation's, in ``sim C`` and ``replay C`` alike, and the measured bubble the bench's own
(``window_bubble``). Then one slow computation on one rank, which only the replay sees.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from bench_pipeline_bubble import round_feed, window_bubble  # noqa: E402
from bench_pipeline_timeline import bubble, drift, timelines  # noqa: E402

from parallel3d.pipeline.schedules import build_schedule  # noqa: E402
from parallel3d.pipeline.simulate_shared import simulate_shared  # noqa: E402

F, B, W, OVERHEAD = 1.0, 2.0, 0.8, 0.25


def _recorded(name: str, p: int, m: int, v: int, cores: int, starts: list[float], msg: float) -> tuple[list, object]:
    """Per stage ``(stage, {name: stats}, msg)`` as ``bench_pipeline_group`` gathers them (one step),
    recorded from ``simulate_shared``'s run, and that run's timeline."""
    schedule = build_schedule(name, p, m, v)
    split = any(a.kind == "W" for st in range(p) for a in schedule[st])
    work = {"F": F, "B": B if split else B + W, "W": W}
    run = simulate_shared(schedule, 0.0, 0.0, p2p_time=msg, cores=cores,
                          action_time=lambda st, a: work[a.kind] + OVERHEAD)
    stats = []
    for st in range(p):
        mine = [t for t in run.actions if t.stage == st and t.action.is_compute]
        spans, wall, cpu = [], {}, {}
        for t in mine:
            key = (t.action.kind, t.action.microbatch, t.action.chunk)
            begin = t.start + (t.end - t.start) * OVERHEAD / (work[key[0]] + OVERHEAD)  # the executor's share first
            spans.append((*key, begin, t.end))
            wall[key], cpu[key] = t.end - begin, work[key[0]]
        mean = {}
        for (kind, _, chunk), x in wall.items():
            mean.setdefault((kind, chunk), []).append(x)
        waited = sum(t.end - t.start for t in run.actions if t.stage == st and t.action.kind.startswith("RECV"))
        step = (starts[st], max(t.end for t in mine), waited, len(mine), sum(wall.values()), run.makespan + 1.0)
        stats.append((st, {name: {"schedule": name, "virtual_stages": v, "compute_cpu": {k: work[k[0]] for k in mean},
                                  "compute": {k: sum(x) / len(x) for k, x in mean.items()},
                                  "step_times": [step], "executor_cpu_per_compute": [OVERHEAD],
                                  "action_s": [wall], "action_spans": [spans], "action_cpu_s": [cpu]}}, msg))
    return stats, run


@pytest.mark.parametrize("name,p,m,v,cores", [("1f1b", 4, 8, 1, 2), ("zbv", 4, 8, 2, 2), ("interleaved_1f1b", 4, 8, 2, 2),
                                              ("zb_h1", 2, 6, 1, 1), ("1f1b", 2, 6, 1, 2)])
def test_a_recorded_shared_run_is_its_own_timeline(name: str, p: int, m: int, v: int, cores: int) -> None:
    starts = [7250.5] * p  # the ranks' step starts on the common clock: only their differences count
    stats, run = _recorded(name, p, m, v, cores, starts, msg=0.05)
    fed = round_feed(stats, name, p, m, msg_s=0.05)
    got = timelines(fed, 0, cores)
    meas = got["measured"]
    assert bubble(meas) == pytest.approx(window_bubble(fed["steps"][0]), abs=1e-12)  # the bench's measured bubble
    assert bubble(meas) == pytest.approx(run.bubble_fraction, rel=1e-9)
    for sim in ("sim C", "replay C"):
        for st in range(p):
            for k in ("run", "blk", "tail", "window"):
                assert meas[st][k] == pytest.approx(got[sim][st][k], rel=1e-9, abs=1e-9), (sim, st, k)
            assert drift(meas[st], got[sim][st]) == pytest.approx([0.0] * 4, abs=1e-9)
        assert bubble(got[sim]) == pytest.approx(bubble(meas), rel=1e-9)
    for st in range(p):  # the split of a rank's runnable time: computations (their CPU: the work) and executor
        assert meas[st]["comp"] + meas[st]["exec"] == pytest.approx(meas[st]["run"], rel=1e-12)
        assert meas[st]["exec_cpu"] == pytest.approx(OVERHEAD * len(meas[st]["ends"]), rel=1e-12)


def test_one_slow_computation_is_seen_by_the_replay_not_by_the_mean() -> None:
    """Stage 0's first forward took 3 more units of CPU: replay C moves every rank's later ends by
    it (the pipeline waits for it), sim C spreads a quarter of it over the mean and moves less."""
    stats, _ = _recorded("1f1b", 2, 4, 1, 2, [0.0, 0.0], msg=0.0)
    first = stats[0][1]["1f1b"]
    first["action_cpu_s"][0][("F", 0, 0)] += 3.0
    first["compute_cpu"][("F", 0)] += 3.0 / 4
    fed = round_feed(stats, "1f1b", 2, 4, msg_s=0.0)
    got = timelines(fed, 0, 2)
    last = [max(got[s][1]["ends"].values()) for s in ("sim C", "replay C", "measured")]
    assert last[1] == pytest.approx(last[2] + 3.0, rel=1e-9)  # the replay: 3 units later at the end
    assert last[2] < last[0] < last[1]


@pytest.mark.slow
def test_raw_dump_is_what_the_table_was_made_of(tmp_path: Path) -> None:
    """A tiny benchmark with ``--raw``: the dumped per-rank stats give the JSON's measured bubble again
    (median over the round's steps), the timeline tool's measured ranks are the bench's own window, and
    the new columns are their formulas over the JSON's own numbers."""
    import json
    import pickle
    import statistics
    import subprocess

    root = Path(__file__).resolve().parent.parent
    out, raw = tmp_path / "pipe.json", tmp_path / "pipe.pkl"
    cmd = [sys.executable, str(root / "scripts" / "bench_pipeline.py"), "--stages", "2", "--microbatches", "4",
           "--rounds", "1", "--steps", "2", "--warmup", "0", "--layers", "4", "--hidden", "16", "--seq", "8",
           "--vocab", "64", "--p2p-reps", "1", "--no-small-mb-case", "--peers", "--schedules", "zbv",
           "--out", str(out), "--raw", str(raw)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    with open(raw, "rb") as f:
        dumped = pickle.load(f)
    rank_stats = dumped["stats"][("main", 2)][0]
    for name in ("ours 1f1b", "ours zbv v2"):
        row = rows[name]
        fed = round_feed(rank_stats, name, 2, 4, msg_s=0.0)
        measured = [window_bubble(step) for step in fed["steps"]]
        assert statistics.median(measured) == pytest.approx(row["bubble_measured_time_shared"], rel=1e-12)
        for i, bub in enumerate(measured):
            assert bubble(timelines(fed, i, dumped["cores"])["measured"]) == pytest.approx(bub, rel=1e-12)
        assert row["bubble_rel_diff_replay"] == pytest.approx(
            abs(row["bubble_measured_time_shared"] - row["bubble_replayed"]) / row["bubble_replayed"], rel=1e-12)
        assert row["cores_busy_share"] == pytest.approx(statistics.median(
            c / (dumped["cores"] * t) for c, t in zip(row["cpu_steps_s"], row["steps_s"])), rel=1e-12)
