"""The step-time breakdown (compute, bubble, exposed tp / cp / ep / pp / dp, optimizer) and
``plan.explain`` (issue 26).

References: the columns must add up to the simulated step time; the tp column must equal the closed
form (two all-reduces of the [b, s, h] activation forward and backward per layer, on the ring model's
own ``CommModel``) times layers times microbatches; a column is zero exactly when its group has one
member (the ep column: the ep x etp expert grid). Cases are generated over tp, cp, ep, pp and schedules.
"""

from __future__ import annotations

import itertools
import json

import pytest

from models import ModelConfig
from models.moe_config import MoEConfig
from parallel3d.planning.cli import explain
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.comm_cost import CommModel
from parallel3d.planning.layout import Layout
from parallel3d.planning.params import stage_layer_counts
from parallel3d.planning.planner import evaluate
from tests.test_planning_cli import _job

MOE = ModelConfig(arch="llama", num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=8, ffn_hidden_size=2816,
                  vocab_size=32000, max_seq_len=8192, moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=1408))


def _cases():
    for tp, cp, ep, pp, sched in itertools.product((1, 2), (1, 2), (1, 4), (1, 2), ("1f1b", "zb_h1")):
        if pp == 1 and sched != "1f1b":
            continue
        yield pytest.param(tp, cp, ep, pp, sched, id=f"tp{tp}-cp{cp}-ep{ep}-pp{pp}-{sched}")


@pytest.mark.parametrize("tp, cp, ep, pp, schedule", list(_cases()))
def test_breakdown_adds_up_and_matches_closed_forms(tp, cp, ep, pp, schedule):
    cluster = ClusterSpec.build(32, 8, "h100_80gb")
    dp = 32 // (tp * cp * pp)
    # allgather: its cp exchange is never hidden (the p2p ring may be, wholly, behind attention).
    layout = Layout(tp=tp, cp=cp, cp_comm="allgather", ep=ep, pp=pp, dp=dp, sequence_parallel=tp > 1, schedule=schedule,
                    micro_batch_size=1, seq_len=4096, global_batch_size=8 * dp, zero_stage=1,
                    precision="bf16")
    step = evaluate(MOE, layout, cluster).step
    parts = dict(step.breakdown)
    assert set(parts) == {"compute", "tp", "cp", "ep", "pp", "bubble", "dp", "optimizer"}
    assert sum(parts.values()) == pytest.approx(step.step_time_s, rel=1e-9)
    assert all(v >= 0 for v in parts.values())
    # ep: the expert token exchange, over ep and over etp (= tp here: its gather / reduce-scatter of the rows)
    for key, size in (("tp", tp), ("cp", cp), ("ep", ep * tp), ("pp", pp)):
        assert (parts[key] > 0) == (size > 1), key
    # tp: 2 all-reduces of this rank's [b, s/cp, h] bf16 activation forward and 2 backward, per layer.
    comm = CommModel(cluster, layout.topology)
    per_layer = 2 * 2 * comm.all_reduce(2 * 4096 / cp * 1024, "tp")
    layers = max(stage_layer_counts(MOE, pp))  # every stage holds as many here
    assert parts["tp"] == pytest.approx(per_layer * layers * layout.num_microbatches, rel=1e-9)


def test_explain_names_the_differing_keys_and_terms():
    cluster = ClusterSpec.build(16, 8, "h100_80gb")
    a = evaluate(MOE, Layout(tp=2, pp=2, dp=4, sequence_parallel=True, micro_batch_size=1, seq_len=4096,
                             global_batch_size=32), cluster)
    b = evaluate(MOE, Layout(tp=1, pp=1, dp=16, micro_batch_size=1, seq_len=4096, global_batch_size=32), cluster)
    same = explain(a, a)
    assert "differs in: nothing" in same and "(+0.000)" in same and "(-" not in same
    text = explain(a, b)
    for key in ("tp 2 (best 1)", "pp 2 (best 1)", "dp 4 (best 16)"):
        assert key in text
    line = next(x for x in text.splitlines() if x.strip().startswith("tp:"))
    assert f"{dict(a.step.breakdown)['tp']:9.3f}" in line


def test_plan_json_keeps_the_breakdown_and_explain_runs_from_hydra_keys(tmp_path):
    out = tmp_path / "plan.json"
    job = _job("plan", ["model=llama3_8b", "cluster.gpus=16", "train.global_batch_size=64", "train.seq_len=4096",
                        "plan.top_k=2", f"plan.json={out}", "plan.explain=true", "parallel.tp=2", "parallel.pp=2",
                        "parallel.dp=4", "train.micro_batch_size=1"])
    from parallel3d.planning.cli import run_plan
    text = run_plan(job)
    ranked = json.loads(out.read_text())["layouts"]
    for r in ranked:
        assert sum(r["breakdown_s"].values()) == pytest.approx(r["step_time_s"], rel=1e-9)
    assert "explain: given tp=2 pp=2 dp=4" in text and "step s: compute" in text


def test_rank_reason_names_the_columns_the_published_layout_loses_in():
    """``validation.rank_reason`` (the ``--rank`` line under a miss): a 1F1B layout with few microbatches
    against the same GPUs without a pipeline loses most in bubble; the seconds it prints are the column
    differences of the two breakdowns."""
    from parallel3d.planning.validation import rank_reason

    cluster = ClusterSpec.build(8, 8, "h100_80gb")
    config = ModelConfig(arch="llama", num_layers=8, hidden_size=1024, num_heads=16, ffn_hidden_size=2816,
                         vocab_size=32000, max_seq_len=2048)
    base = Layout(tp=1, pp=1, dp=8, micro_batch_size=1, seq_len=2048, global_batch_size=16)
    piped = base.replace(pp=4, dp=2)
    worse, best = evaluate(config, piped, cluster).step, evaluate(config, base, cluster).step
    assert worse.step_time_s > best.step_time_s
    line = rank_reason(worse, best)
    a, b = dict(worse.breakdown), dict(best.breakdown)
    top = max(a, key=lambda k: a[k] - b[k])
    assert top == "bubble"
    assert line.startswith(f"best {base.short()}: published loses in {top} +{a[top] - b[top]:.2f} s")


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)])
def test_compute_column_does_not_depend_on_the_network(schedule, v):
    """The compute column is the stage's own work: a slower link can only move time into pp / bubble. (It
    once took the P2P time off the busy time, which holds no P2P: compute fell to 0 on a slow link and the
    columns overran the step where P2P outweighed a tiny stage's compute; found by test_planning_fuzz.)"""
    layout = Layout(tp=1, pp=4, dp=1, micro_batch_size=1, seq_len=4096, global_batch_size=8, schedule=schedule,
                    virtual_stages=v)
    steps = [evaluate(MOE.replace(moe=MoEConfig()), layout, ClusterSpec.build(4, 1, "h100_80gb", inter_node_gbps=g,
                                                                          intra_node_gbps=g)).step for g in (1, 1000)]
    slow, fast = (dict(s.breakdown) for s in steps)
    assert slow["compute"] == pytest.approx(fast["compute"], rel=1e-9) and fast["compute"] > 0
    assert slow["pp"] > fast["pp"]
    for s in steps:
        assert sum(dict(s.breakdown).values()) == pytest.approx(s.step_time_s, rel=1e-9)
