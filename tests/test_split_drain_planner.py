"""The planner sees ``parallel.split_drain`` as the runtime runs it: ``Layout`` carries the job's value and
resolves it with the options' one rule, the memory estimate walks the engine's own action list, and the
sources that run plain 1F1B (Megatron, torchtitan) are priced plain in time and memory alike. The bytes
themselves are checked against the dry run's measured peak (``tests/test_dryrun_estimator.py``)."""

from __future__ import annotations

import pytest

from models.config import ModelConfig
from parallel3d.config import resolve
from parallel3d.option_checks import ConfigError
from parallel3d.pipeline.options import MULTI_CHUNK
from parallel3d.pipeline.schedules import build_schedule
from parallel3d.planning.cli import explain, layout_from_job
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.cost import estimate_step
from parallel3d.planning.cost_options import CostOptions
from parallel3d.planning.layout import Layout
from parallel3d.planning.planner import evaluate
from parallel3d.planning.split_memory import stage_computations
from parallel3d.planning.zb_lags import zb_h1_w_lags
from parallel3d.train import compose_job

BASE = ["model=llama_tiny", "parallel.pp=2", "train.micro_batch_size=1", "train.seq_len=128",
        "model.max_seq_len=128", "train.global_batch_size=4"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb_h1"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("value", ["auto", "true", "false"])
def test_layout_from_job_carries_the_option_and_refuses_what_the_job_refuses(schedule, recompute, value):
    overrides = [*BASE, f"parallel.schedule={schedule}", f"train.recompute={recompute}",
                 f"parallel.split_drain={value}"]
    job, _ = compose_job(overrides)
    try:
        rj = resolve(job, world_size=2)
    except ConfigError:  # an explicit true where it does not apply: the layout refuses it the same way
        assert value == "true"
        with pytest.raises(ConfigError, match="parallel.split_drain=true"):
            layout_from_job(job, ClusterSpec.build(2, 1))
        return
    _, layout, _ = layout_from_job(job, ClusterSpec.build(2, 1))
    assert layout.split_drain == rj.pipeline.split_drain
    assert layout.splits_drain == rj.pipeline.splits_drain(rj.train.recompute)  # what the trainer hands the engine


LAYOUTS = [("1f1b", 1, "auto"), ("1f1b", 1, False), ("gpipe", 1, "auto"), ("interleaved_1f1b", 2, "auto"),
           ("zb_h1", 1, "auto"), ("zbv", 2, "auto")]


@pytest.mark.parametrize("schedule,v,split_drain", LAYOUTS)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_memory_walks_the_action_list_the_engine_builds(schedule, v, split_drain, p, m):
    config = ModelConfig(num_layers=4 * p, hidden_size=64, num_heads=4, vocab_size=128, max_seq_len=64)
    layout = Layout(pp=p, schedule=schedule, virtual_stages=v, split_drain=split_drain, micro_batch_size=1,
                    global_batch_size=m, seq_len=64)
    lags = zb_h1_w_lags(config, layout) if schedule == "zb_h1" else None
    built = build_schedule(schedule, p, m, v, w_lags=lags, split_drain=layout.splits_drain)  # as the engine
    for stage in range(p):
        engine = [(a.kind, a.microbatch, a.chunk) for a in built[stage] if a.is_compute]
        planner = stage_computations(config, layout, stage)
        assert planner == (engine if any(a.kind == "W" for a in built[stage]) else None), stage
    if schedule == "1f1b":  # the split drain: every stage but the first splits, stage 0 stays plain
        assert [stage_computations(config, layout, s) is not None for s in range(p)] == \
            [s > 0 and split_drain == "auto" for s in range(p)]


def _pp2_job_layout() -> tuple[ModelConfig, Layout, ClusterSpec]:
    """llama_tiny at pp 2, tp 2, sequence parallel, bf16: its last stage's split B holds more than its forward
    saved (the dry run measures it: ``test_dryrun_estimator``), so the split drain shows in the bytes."""
    job, _ = compose_job(["model=llama_tiny", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                          "train.precision=bf16", "train.micro_batch_size=1", "train.seq_len=128",
                          "model.max_seq_len=128", "train.global_batch_size=8"])
    cluster = ClusterSpec.build(4, 8, "h100_80gb")
    config, layout, _ = layout_from_job(job, cluster)
    return config, layout, cluster


@pytest.mark.parametrize("options", [CostOptions.megatron_core(), CostOptions.megatron_sc21()],
                         ids=["megatron_core", "megatron_sc21"])
def test_sources_without_the_option_are_priced_plain_in_time_and_memory(options):
    config, layout, cluster = _pp2_job_layout()
    plain = layout.replace(split_drain=False)
    assert layout.splits_drain and not plain.splits_drain
    theirs, theirs_plain = evaluate(config, layout, cluster, options), evaluate(config, plain, cluster, options)
    assert theirs.step.step_time_s == theirs_plain.step.step_time_s
    assert [s.activations for s in theirs.memory.stages] == [s.activations for s in theirs_plain.memory.stages]
    # ... while our runtime's default prices the split: its own time and its last stage's bytes
    ours, ours_plain = evaluate(config, layout, cluster), evaluate(config, plain, cluster)
    assert ours.step.step_time_s < ours_plain.step.step_time_s
    assert ours.memory.stages[-1].activations > ours_plain.memory.stages[-1].activations
    assert ours.memory.stages[0].activations == ours_plain.memory.stages[0].activations  # stage 0 never splits


def test_explain_and_overrides_print_the_option():
    config, layout, cluster = _pp2_job_layout()
    given, best = evaluate(config, layout.replace(split_drain=False), cluster), evaluate(config, layout, cluster)
    text = explain(given, best)
    assert "split_drain False (best auto)" in text
    assert "drain split (parallel.split_drain): given False (False), best True (auto)" in text
    assert "parallel.split_drain=false" in layout.replace(split_drain=False).overrides()
    assert "split_drain" not in layout.overrides()  # the default: pasted as is, it resolves the same
    assert estimate_step(config, layout, cluster).step_time_s == best.step.step_time_s


def test_every_multi_chunk_schedule_is_covered():
    assert {s for s, v, _ in LAYOUTS if v > 1} == set(MULTI_CHUNK)
