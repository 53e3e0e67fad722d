"""scripts/plan.py as a new user drives it (session 43): a bad request fails before the search, the job's own
layout is compared as training would build it, keys the search does not read are named, and every value the
training options allow is searched or excluded by name.

References are independent of the code under test: stage layer counts written out by hand from
``parallel.pp_layers``, the runtime's own allowed-value tuples, the training validator's own error.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from models.config import ModelConfig
from models.transformer import RECOMPUTE_MODES
from parallel3d.config import ConfigError
from parallel3d.context_parallel.attention import CP_COMM_VARIANTS
from parallel3d.pipeline.options import SCHEDULES
from parallel3d.planning import cli
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.memory import estimate_memory
from parallel3d.planning.planner import enumerate_layouts, plan
from parallel3d.planning.request import (PlanRequest, SEARCHED_OFFLOAD, SEARCHED_SCHEDULES, UNSEARCHED_OFFLOAD,
                                         UNSEARCHED_SCHEDULES)
from parallel3d.planning.unread_keys import unread_keys_note
from parallel3d.zero.options import OFFLOAD_MODES, ZERO_STAGES
from tests.test_planning_cli import CONF


def _job(overrides: list[str]):
    cli.register_planning_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return OmegaConf.to_object(compose(config_name="plan", overrides=overrides))


TINY = ["model=llama_tiny", "train.seq_len=64", "train.global_batch_size=16", "plan.top_k=2"]


class _Searched(Exception):
    pass


def _no_search(*_args, **_kwargs):
    raise _Searched("the search ran before the job's own layout was checked")


@pytest.mark.parametrize("overrides, message", [
    (["cluster.gpus=8", "train.seq_len=62", "parallel.cp=2"], r"train\.seq_len=62"),  # not 2 * cp chunks
    (["cluster.gpus=6", "cluster.gpus_per_node=2", "model=mixtral_tiny", "parallel.ep=3"],
     r"parallel\.ep=3"),  # 8 experts do not split over 3 ranks
    (["cluster.gpus=8", "parallel.pp=2", "parallel.pp_layers=[1,1]"], r"parallel\.pp_layers"),
])
def test_explain_rejects_the_jobs_layout_before_searching(monkeypatch, overrides, message):
    """plan.explain=true on a layout training refuses: the training validator's error, before a search that
    can take minutes (it used to come after the whole search: 2m06s for Llama 3 70B on 96 GPUs)."""
    monkeypatch.setattr(cli, "plan", _no_search)
    with pytest.raises(ConfigError, match=message):
        cli.run_plan(_job([*TINY, "plan.explain=true", *overrides]))


def test_explain_prices_the_jobs_own_pp_layers():
    """The compared layout holds the layers ``parallel.pp_layers`` gives each stage (1 and 3 of 4), not the
    default balanced split (2 and 2)."""
    job = _job([*TINY, "cluster.gpus=8", "plan.explain=true", "parallel.pp=2", "parallel.pp_layers=[1,3]", "parallel.dp=4",
                "train.micro_batch_size=2"])
    model, layout, _ = cli.layout_from_job(job, cli.cluster_from(job.cluster))
    given = cli.job_candidate(job, cli.cluster_from(job.cluster))
    by_hand = estimate_memory(model, given.layout, stage_layers=[1, 3])
    default = estimate_memory(model, given.layout, stage_layers=[2, 2])
    assert [s.params for s in given.memory.stages] == [s.params for s in by_hand.stages]
    assert [s.params for s in by_hand.stages] != [s.params for s in default.stages]  # the case tests something


def test_keys_the_search_does_not_read_are_named():
    """A training command pasted into plan.py: the layout keys are not constraints of the search, and the
    optimizer's are read by nothing; the note names both kinds, and nothing the planner reads."""
    keys = ["model=llama3_70b", "cluster.gpus=64", "train.seq_len=4096", "parallel.tp=8", "train.micro_batch_size=2",
            "optimizer.lr=1e-4", "train.steps=10", "plan.top_k=3", "+train.global_batch_size=64"]
    note = unread_keys_note(keys, explain=False)
    for key in ("parallel.tp", "train.micro_batch_size", "optimizer.lr", "train.steps"):
        assert key in note
    for key in ("model", "cluster.gpus", "train.seq_len", "plan.top_k", "train.global_batch_size"):
        assert f" {key}," not in note and f" {key} " not in note and not note.endswith(f" {key}")
    with_explain = unread_keys_note(keys, explain=True)
    assert "parallel.tp" not in with_explain and "optimizer.lr" in with_explain
    assert unread_keys_note(["model=gpt3_175b", "cluster.gpus=8"], explain=False) is None


def _ranked(**options) -> list:
    """The ranked layouts of a small dense model on 2 GPUs, the search held to ``options``."""
    model = ModelConfig(arch="llama", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=512, vocab_size=512, max_seq_len=512)
    request = PlanRequest(global_batch_size=8, seq_len=64, micro_batch_sizes=(1,), max_virtual_stages=2, **options)
    return [c.layout for c in plan(model, ClusterSpec.build(2, 2, "h100_80gb"), request).ranked]


def test_every_allowed_option_value_is_searched_or_excluded_by_name():
    """One source of truth: the values the search tries are the training options' own tuples. A value added
    there (a schedule, a recompute mode, a ZeRO stage, an offload mode, a cp_comm) must be accepted by a
    request and reached by the search, unless the planner names it as not searched (and refuses it)."""
    for allowed, searched, unsearched in ((SCHEDULES, SEARCHED_SCHEDULES, UNSEARCHED_SCHEDULES),
                                          (OFFLOAD_MODES, SEARCHED_OFFLOAD, UNSEARCHED_OFFLOAD)):
        assert set(searched) | set(unsearched) == set(allowed) and not set(searched) & set(unsearched)
    for key, values, chosen in (("schedules", SEARCHED_SCHEDULES, "schedule"),
                                ("offload_modes", SEARCHED_OFFLOAD, "offload"),
                                ("zero_stages", ZERO_STAGES, "zero_stage"),
                                ("recompute_modes", RECOMPUTE_MODES, "recompute")):
        for value in values:
            held = dict(zero_stages=(1,)) if key == "offload_modes" else {}  # offload needs a sharded state
            ranked = _ranked(**{key: (value,), **held})
            assert ranked and {getattr(lay, chosen) for lay in ranked} == {value}, (key, value)
    for key, value in (("schedules", UNSEARCHED_SCHEDULES), ("offload_modes", UNSEARCHED_OFFLOAD)):
        with pytest.raises(ValueError, match="plan."):
            PlanRequest(global_batch_size=8, seq_len=64, **{key: value})
    assert PlanRequest(1, 1).recompute_modes == RECOMPUTE_MODES
    req = PlanRequest(global_batch_size=64, seq_len=8192, max_cp=4, micro_batch_sizes=(1,))
    model = ModelConfig(arch="llama", num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=8,
                        ffn_hidden_size=2816, vocab_size=32000, max_seq_len=8192)
    assert {lay.cp_comm for lay in enumerate_layouts(model, ClusterSpec.build(32, 8, "h100_80gb"), req)
            if lay.cp > 1} == set(CP_COMM_VARIANTS)


def test_plan_yaml_defaults_are_the_requests():
    """conf/plan.yaml restates the search's defaults for the command line; they must be PlanRequest's."""
    o = _job([]).plan
    d = PlanRequest(1, 1)
    assert (o.micro_batch_sizes, o.max_virtual_stages, o.zero_stages, o.offload, o.memory_fraction, o.simulate_top,
            o.uneven_stages, o.max_cp, o.schedules, o.top_k) == \
        (list(d.micro_batch_sizes), d.max_virtual_stages, list(d.zero_stages), list(d.offload_modes),
         d.memory_fraction, d.simulate_top, d.uneven_stages, d.max_cp, list(d.schedules), d.top_k)
    assert cli.PlanOptions().schedules == list(d.schedules) and cli.PlanOptions().offload == list(d.offload_modes)


# Known gaps found in session 43 in planning/memory.py (another session's file: reported, not fixed here). Pinned,
# not skipped (a skip or xfail fails the suite: conftest's NoSilentSkips): on these the test requires the gap to
# still be there, so the fix fails it with a message saying which entry to remove; with no entry it is the invariant.
KNOWN_GAPS: dict[str, str] = {}  # "moe_zero3_gather" and "zbv_head" were fixed by mem43 (2026-12-07)


def _expect(bad: list[str], gap: str) -> None:
    if gap in KNOWN_GAPS:
        assert bad, f"the known gap {gap!r} ({KNOWN_GAPS[gap]}) is gone: remove its entry from KNOWN_GAPS"
    else:
        assert not bad, "\n".join(bad)


@pytest.mark.parametrize("pp", [1, 2])
def test_zero3_never_gathers_more_than_the_rank_holds_unsharded(pp):
    from models import get_config
    from parallel3d.planning.layout import Layout
    from parallel3d.planning.params import rank_params, stage_expert_params, stage_layer_counts

    config = get_config("mixtral_tiny")
    layout = Layout(tp=1, pp=pp, dp=8 // pp, ep=4, zero_stage=3, micro_batch_size=1, seq_len=64,
                    global_batch_size=16, precision="bf16")
    estimate = estimate_memory(config, layout)
    bad = []
    for stage, layers in enumerate(stage_layer_counts(config, pp, 1, layout.seq_len)):
        whole, held = stage_expert_params(config, pp, stage, layers, layout.ep, 1)
        unsharded = 2 * (rank_params(config, 1, pp, stage, layers).total - whole + held)  # bf16 bytes
        if estimate.stages[stage].gathered_weights > unsharded:
            bad.append(f"stage {stage}: gathers {estimate.stages[stage].gathered_weights:.0f} B, holds {unsharded} B")
    _expect(bad, "moe_zero3_gather")


@pytest.mark.parametrize("expert_zero", [3, 1])
def test_zero3_step_window_is_the_built_ranks_gathered_parameters(expert_zero):
    """In ``step`` mode (pp > 1) ZeRO-3 holds every parameter its stage-3 layouts shard whole during the step: the
    rank's built chunks (dense tp shards, its ep-local experts only), less the experts when they are not at stage 3."""
    from parallel3d.config import resolve
    from parallel3d.dryrun.fake_world import fake_rank_state
    from parallel3d.param_meta import is_expert_param
    from parallel3d.rank_build import build_chunks
    from parallel3d.train import compose_job

    overrides = ["model=mixtral_tiny", "train.seq_len=64", "parallel.pp=2", "parallel.dp=4", "parallel.ep=4",
                 "parallel.zero_stage=3", f"parallel.expert_zero_stage={expert_zero}", "train.precision=bf16",
                 "train.micro_batch_size=1", "train.global_batch_size=16"]
    rj = resolve(compose_job(overrides)[0], world_size=8)
    model, layout, stage_layers = cli.layout_from_job(rj.job, ClusterSpec.build(8, 8))
    assert layout.zero3_mode == "step" and layout.expert_zero == expert_zero
    estimate = estimate_memory(model, layout, stage_layers=stage_layers)
    for rank in (0, 7):
        with fake_rank_state(rj.topology, rank) as pstate:
            params = [p for chunk in build_chunks(rj, pstate) for p in chunk.parameters()]
            stage = pstate.coord("pp")
        gathered = sum(2 * p.numel() for p in params if expert_zero == 3 or not is_expert_param(p))  # bf16
        assert estimate.stages[stage].gathered_weights == gathered, f"rank {rank} (stage {stage})"


@pytest.mark.parametrize("tied", ["false", "true"])
def test_zbv_state_bytes_equal_the_dry_run_optimizers(tied):
    from tests.test_planning_states import _disagreements

    overrides = ["model=llama_tiny", "model.num_layers=6", "train.seq_len=32", "parallel.pp=2", "parallel.dp=1",
                 "parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.zero_stage=1",
                 "train.precision=bf16", "train.micro_batch_size=1", "train.global_batch_size=4",
                 f"model.tie_embeddings={tied}"]  # tied: stage 0's head chunk holds its own copy of the word table
    _expect(_disagreements(2, overrides), "zbv_head")


def test_explain_says_when_the_given_layout_does_not_fit():
    """OLMo-7B on 256 H100 at dp 256, micro-batch 8 (plan.explain) needs 105.3 GiB a rank; explain printed
    that beside the best's 40.5 GiB and compared step times as if it ran. It must say it does not fit."""
    cluster = ClusterSpec.build(2, 2, "h100_80gb")
    model = ModelConfig(arch="llama", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=512, vocab_size=512, max_seq_len=512)
    from parallel3d.planning.layout import Layout
    from parallel3d.planning.planner import evaluate

    given = evaluate(model, Layout(dp=2, micro_batch_size=4, seq_len=512, global_batch_size=8), cluster)
    best = evaluate(model, Layout(dp=2, micro_batch_size=1, seq_len=512, global_batch_size=8), cluster)
    over = cli.explain(given, best, budget=given.peak_bytes * 0.99)
    assert "DOES NOT FIT" in over and f"{given.peak_bytes * 0.99 / 2**30:.1f} GiB" in over
    assert "DOES NOT FIT" not in cli.explain(given, best, budget=given.peak_bytes)
