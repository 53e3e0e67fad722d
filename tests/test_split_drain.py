"""1F1B with a split drain (``parallel.split_drain``): the schedule data, its simulated gain, and that the
engine runs it with the same numerics as plain 1F1B and posts each input gradient before its ``W``."""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from parallel3d.option_checks import ConfigError
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.actions import Action, ScheduleError, comm_plan, split_backwards
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.options import MULTI_CHUNK, SCHEDULES, PipelineOptions, drain_is_split
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.pipeline.placement import placement_for
from parallel3d.pipeline.schedules import build_schedule, peak_in_flight, simulate, validate_schedule
from parallel3d.topology import Topology
from parallel3d.train_options import RECOMPUTE_MODES
from tests import layout_matrix as lm
from tests import layout_run as lr
from tests.harness import run_on_ranks
from tests.pipeline_toy import HIDDEN, ToyModel, toy_batch

SHAPES = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]


def _computations(actions: list[Action]) -> list[Action]:
    return [a for a in actions if a.is_compute]


@pytest.mark.parametrize("p,m", SHAPES)
def test_split_drain_is_1f1b_order_with_w_right_after_the_drain_backwards(p, m):
    plain = build_schedule("1f1b", p, m)
    split = build_schedule("1f1b", p, m, split_drain=True)
    assert peak_in_flight(split) == peak_in_flight(plain)
    for s in range(p):
        acts = split[s]
        # F and B in 1F1B's order: the split only inserts Ws
        assert [a for a in acts if a.kind != "W"] == plain[s]
        last_f = max(i for i, a in enumerate(acts) if a.kind == "F")
        drain = [a for a in acts[last_f:] if a.kind == "B"]
        assert split_backwards(acts) == (frozenset() if s == 0 else {(a.microbatch, a.chunk) for a in drain})
        for a in acts:
            if a.kind == "W":  # right after its B and that B's input-gradient send: nothing else between
                i = acts.index(a)
                assert acts[i - 2: i] == [Action("B", a.microbatch), Action("SEND_GRAD", a.microbatch)]


@pytest.mark.parametrize("p,m", SHAPES)
def test_split_drain_saves_p_minus_1_weight_gradients_in_the_simulator(p, m):
    """F = 1, B = 2 split 1 + 1: the drain's B chain runs at B's cost, so the step ends (p - 1) W sooner,
    as zb_h1 with every backward split and each W right after its B (lag 0) does; and never later
    than plain 1F1B with a heavier last stage and a costlier split (B 1.1 + W 1.0)."""
    plain = simulate(build_schedule("1f1b", p, m), 1.0, 2.0).makespan
    split = simulate(build_schedule("1f1b", p, m, split_drain=True), 1.0, 2.0, wgrad_time=1.0).makespan
    all_split = simulate(build_schedule("zb_h1", p, m, w_lags=(0,) * p), 1.0, 2.0, wgrad_time=1.0).makespan
    assert split == pytest.approx(plain - (p - 1) * 1.0)
    assert split == pytest.approx(all_split)
    assert _heavy_last_stage_step(p, m, True) < _heavy_last_stage_step(p, m, False)


def _heavy_last_stage_step(p: int, m: int, split_drain: bool) -> float:
    """Simulated step: F 1, a full B 2, a split one B 1.1 + W 1.0 (the split's overhead); the last stage 1.3x."""
    schedule = build_schedule("1f1b", p, m, split_drain=split_drain)
    split = {s: split_backwards(acts) for s, acts in schedule.items()}

    def cost(s: int, a: Action) -> float:
        base = {"F": 1.0, "W": 1.0}.get(a.kind, 1.1 if (a.microbatch, a.chunk) in split[s] else 2.0)
        return base * (1.3 if s == p - 1 else 1.0)

    return simulate(schedule, 1.0, 2.0, action_time=cost).makespan


def test_validator_wants_every_backward_after_a_split_one_split():
    acts = build_schedule("1f1b", 3, 4, split_drain=True)
    one = acts[1]
    validate_schedule(acts)
    first_w = next(a for a in one if a.kind == "W")
    with pytest.raises(ScheduleError, match=f"no W for microbatches \\[{first_w.microbatch + 1}\\]"):
        validate_schedule({**acts, 1: [a for a in one if a != Action("W", first_w.microbatch + 1)]})
    # dropping the first split's W leaves a later suffix split: still a valid (shorter) split drain
    validate_schedule({**acts, 1: [a for a in one if a != first_w]})


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 3), (3, 6, 2), (4, 8, 2)])
def test_interleaved_coalesced_w_waits_for_nothing_and_every_read_is_waited_for(p, m, v):
    """Interleaved's coalesced iterations with the split drain: each W opens the next iteration, after the
    batch of its B's sends and that iteration's receives (one batch, so NCCL's FIFO batches match: the
    build's check), and waits for none of them; the F or B that reads a receive still waits for it."""
    for acts in build_schedule("interleaved_1f1b", p, m, v, coalesced_p2p=True, split_drain=True).values():
        waited: set[Action] = set()
        for step in comm_plan(acts):
            if step.compute is not None and step.compute.kind == "W":
                assert step.needs == ()
                continue
            waited |= set(step.needs)
            c = step.compute
            if c is not None:  # what c reads by message (a receive of its own microbatch and chunk)
                reads = [a for a in acts if a.kind == {"F": "RECV_ACT", "B": "RECV_GRAD"}[c.kind]
                         and (a.microbatch, a.chunk) == (c.microbatch, c.chunk)]
                assert set(reads) <= waited, c
        assert any(a.kind == "W" for a in acts)


def _explicit_true_runs(schedule: str, recompute: str) -> bool:
    try:
        return drain_is_split(schedule, True, recompute)
    except ConfigError:
        return False


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_the_default_splits_exactly_where_an_explicit_true_is_allowed_and_never_refuses(schedule, recompute):
    v = 2 if schedule in MULTI_CHUNK else 1
    default = PipelineOptions(schedule=schedule, virtual_stages=v)  # a default never makes a config invalid
    assert default.split_drain == "auto"
    assert default.splits_drain(recompute) == _explicit_true_runs(schedule, recompute)
    assert not PipelineOptions(schedule=schedule, virtual_stages=v, split_drain=False).splits_drain(recompute)


def test_option_resolves_once_and_refuses_where_it_does_nothing():
    assert PipelineOptions().splits_drain("none")  # on by default where it applies (options.drain_is_split)
    assert not PipelineOptions().splits_drain("full")  # the default: plain where it does not apply, no error
    assert PipelineOptions(split_drain=True).splits_drain("selective")
    assert not PipelineOptions(split_drain=False).splits_drain("full")
    assert drain_is_split("1f1b", True) and not drain_is_split("gpipe", False)
    with pytest.raises(ConfigError, match="recompute 'full'"):
        PipelineOptions(split_drain=True).splits_drain("full")
    with pytest.raises(ConfigError, match="parallel.split_drain=true"):
        PipelineOptions(schedule="zb_h1", split_drain=True)
    with pytest.raises(ConfigError, match="parallel.split_drain='yes': must be true, false or auto"):
        PipelineOptions(split_drain="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split_drain=True"):
        build_schedule("gpipe", 2, 4, split_drain=True)


# ---- the engine: same gradients as plain 1F1B, input gradient posted before W ------------------------
def _toy_step(rank, world, pp, m, split_drain, schedule="1f1b", v=1, emulate_nccl=False):
    pstate = ParallelState(Topology(tp=1, pp=pp, dp=world // pp), emulate_nccl=emulate_nccl)
    layers = 2 * pp * v
    cfg = ModelConfig(num_layers=layers, hidden_size=HIDDEN, num_heads=1, vocab_size=32)
    ranges = partition_layers(cfg, pp, v, None)
    chunks = [ToyModel(layers, r, pre_process=r[0] == 0, post_process=r[1] == layers, deferral=pstate.weight_grads)
              for r in stage_layer_ranges(ranges, pp, pstate.coord("pp"), placement_for(schedule, pp, v))]
    out = {}
    for on in (False, True):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        engine = PipelineEngine(chunks, pstate, schedule=schedule, num_microbatches=m, micro_batch_size=2, seq_len=4,
                                hidden_size=HIDDEN, split_drain=on and split_drain)
        result = engine.run_step(toy_batch(m, 2, 4), account_activations=True)
        out[on] = {
            "grads": {n: q.grad.clone() for c in chunks for n, q in c.named_parameters()},
            "loss": result.loss,
            "order": [a for a, _, _ in result.timeline],  # posts and computations, in the order the executor ran them
            "peak": result.peak_live_activations,
        }
    return pstate.coord("pp"), out


@pytest.mark.parametrize("pp,m", [(2, 5), (3, 4)])
def test_engine_split_drain_is_bitwise_plain_1f1b_and_sends_before_w(pp, m):
    for stage, out in run_on_ranks(_toy_step, pp, pp, m, True, timeout=120):
        off, on = out[False], out[True]
        assert off["loss"] == on["loss"] and off["peak"] == on["peak"]
        assert off["grads"].keys() == on["grads"].keys()
        for name, g in off["grads"].items():
            assert torch.equal(g, on["grads"][name]), (stage, name)
        ws = [a for a in on["order"] if a.kind == "W"]
        assert bool(ws) == (stage > 0) and not any(a.kind == "W" for a in off["order"])
        for w in ws:  # the executor posted the input gradient's send before running the W
            assert on["order"].index(Action("SEND_GRAD", w.microbatch)) < on["order"].index(w)


@pytest.mark.parametrize("pp,m,v,nccl", [(2, 4, 2, False), (2, 4, 2, True), (3, 6, 2, True), (2, 2, 3, True)])
def test_engine_interleaved_split_drain_is_bitwise_plain_and_sends_before_w(pp, m, v, nccl):
    """Interleaved 1F1B with its drain split, on gloo and under emulated NCCL (one Work per batch, FIFO
    batches: the coalesced iterations, whose W opens the next one): same numbers as plain, no deadlock."""
    for stage, out in run_on_ranks(_toy_step, pp, pp, m, True, "interleaved_1f1b", v, nccl, timeout=120):
        off, on = out[False], out[True]
        assert off["loss"] == on["loss"] and off["peak"] == on["peak"]
        for name, g in off["grads"].items():
            assert torch.equal(g, on["grads"][name]), (stage, name)
        ws = [a for a in on["order"] if a.kind == "W"]
        assert ws and not any(a.kind == "W" for a in off["order"])
        assert not any(w.chunk == 0 for w in ws) or stage > 0  # the model's first chunk keeps its backward whole
        for w in ws:
            assert on["order"].index(Action("SEND_GRAD", w.microbatch, w.chunk)) < on["order"].index(w)


# ---- the real Trainer: per-step loss and grad norm equal, option on and off ---------------------------
TRAIN = {"global_batch_size": 8, "micro_batch_size": 1, "steps": 3, "eval_every": 0}
CASES = [  # parallel values: dp or tp beside pp
    pytest.param(dict(tp=1, pp=2, dp=2, zero_stage=1), id="pp2dp2"),
    pytest.param(dict(tp=2, pp=3, dp=1, zero_stage=0), id="pp3tp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("parallel", CASES)
def test_trainer_split_drain_curve_equals_plain_1f1b_exactly(parallel, tmp_path):
    cache = str(tmp_path / "cache")
    world = parallel["tp"] * parallel["pp"] * parallel["dp"]
    curves = {}
    for on in (True, False):
        values = lm.job_values("gpt", {**parallel, "schedule": "1f1b", "split_drain": on}, TRAIN,
                               str(tmp_path / f"run-{on}"), cache)
        curves[on] = next(c for c in run_on_ranks(lr.train_case_on_rank, world, values, True, timeout=300) if c)
    assert len(curves[True]) == TRAIN["steps"]
    assert curves[True] == curves[False]
