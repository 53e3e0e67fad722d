"""The planner's pre-ranking is a lower bound of its full price, so one rule (the full price) decides its top.

Independent references: the schedule simulator (``simulate_pipeline``) for the pipeline bound, the full
step price (``estimate_step``, simulated schedule, zb_h1's W lags, each chunk's own DP overlap) for the
step bound, and a brute force that prices every fitting setting in full for the ranked top.
"""

from __future__ import annotations

import random
from functools import cache

import pytest

from models import ModelConfig
from models.moe_config import MoEConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.pipeline.options import SPLIT_DRAIN_SCHEDULES
from parallel3d.planning.cost import CostOptions, chunk_layer_counts, estimate_step
from parallel3d.planning.memory import estimate_memory
from parallel3d.planning.params import stage_layer_counts
from parallel3d.planning.pipeline_price import _simulate_once, pipeline_lower_bound, simulate_pipeline
from parallel3d.planning.planner import enumerate_layouts, expert_zero_choices, memory_layout, plan
from parallel3d.planning.request import RECOMPUTE_ORDER, PlanRequest
from parallel3d.planning.schedule_cache import ScheduleCache

REL = 1e-9  # float rounding only


def _dense(layers: int = 12) -> ModelConfig:
    return ModelConfig(arch="llama", num_layers=layers, hidden_size=1024, num_heads=16, num_kv_heads=8,
                       ffn_hidden_size=2816, vocab_size=32000, max_seq_len=8192)


def _moe() -> ModelConfig:
    return ModelConfig(arch="llama", num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=8,
                       ffn_hidden_size=2816, vocab_size=32000, max_seq_len=4096,
                       moe=MoEConfig(num_experts=8, top_k=2))


CASES = [  # (schedule, p, m, v): every searched schedule, uneven v, more microbatches than the 3p extension
    ("1f1b", 1, 5, 1), ("1f1b", 4, 3, 1), ("1f1b", 4, 20, 1), ("zb_h1", 4, 6, 1), ("zb_h1", 3, 17, 1),
    ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 3, 21, 5), ("interleaved_1f1b", 2, 4, 7),
    ("zbv", 4, 9, 2),
]


@pytest.mark.parametrize("name, p, m, v", CASES)
@pytest.mark.parametrize("seed", range(4))
def test_pipeline_bound_never_exceeds_the_simulation(name, p, m, v, seed):
    rng = random.Random(seed)
    f = [[rng.uniform(0.2, 2.0) for _ in range(v)] for _ in range(p)]  # unequal chunks (ends, uneven splits)
    b = [[x * rng.uniform(1.5, 3.0) for x in row] for row in f]
    lat = rng.choice([0.0, 0.05, 0.5])

    def fwd(s, c):
        return f[s][c]

    def bwd(s, c):
        return b[s][c]

    # the split drain too, where it applies (parallel.split_drain, the runtime's default)
    for drain in (False, True) if name in SPLIT_DRAIN_SCHEDULES else (False,):
        sim = simulate_pipeline(name, p, m, v, fwd, bwd, lat, split_drain=drain)
        low = pipeline_lower_bound(name, p, m, v, fwd, bwd, lat, split_drain=drain)
        assert low.busy == pytest.approx(sim.busy, rel=REL)
        for s in range(p):
            assert low.stage_end[s] <= sim.stage_end[s] * (1 + REL), (drain, s, low.stage_end, sim.stage_end)
        assert low.makespan <= sim.makespan * (1 + REL)


def test_extrapolation_waits_for_the_steady_state():
    # Interleaved 1F1B at p = 2 with a light second stage (the split of a 16-layer model with its head):
    # the steps 4 -> 6 -> 8 microbatches add the same time, yet less than the first stage's added work, and
    # a line through them ended that stage below its own busy time. Reference: the full simulation.
    f, b = [[0.7309, 0.8808], [0.7047, 0.7920]], [[1.2577, 1.5721], [1.2577, 1.4966]]
    args = ("interleaved_1f1b", 2, 32, 2, lambda s, c: f[s][c], lambda s, c: b[s][c], 0.0724)
    fast, full = simulate_pipeline(*args), _simulate_once(*args)
    assert fast.stage_end == pytest.approx(full.stage_end, rel=REL)
    assert all(e >= x for e, x in zip(fast.stage_end, fast.busy))


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved_1f1b", 3)])
def test_pipeline_bound_is_the_closed_form_for_uniform_chunks(name, v):
    # Uniform chunks (f, b per chunk): the textbook (v m + p - 1) chunk slots plus the warm-up and cool-down hops; without
    # P2P time the simulator agrees exactly (the bound leaves out only the hops a steady state exposes).
    p, m, f, b = 4, 8, 0.3, 0.6
    for lat in (0.0, 0.01):
        low = pipeline_lower_bound(name, p, m, v, lambda s, c: f, lambda s, c: b, lat)
        assert low.makespan == pytest.approx((v * m + p - 1) * (f + b) + 2 * (p - 1) * lat, rel=REL)
    sim = simulate_pipeline(name, p, m, v, lambda s, c: f, lambda s, c: b, 0.0)
    assert sim.makespan == pytest.approx((v * m + p - 1) * (f + b), rel=REL)


def test_priced_pipeline_memo_keys_on_every_input():
    # A search's cache returns a simulation only for the same inputs: each variant differs from the first in
    # one key field (schedule, m, per-chunk forward / backward time, P2P time, split drain, zb_h1's W lags) and
    # must give its own uncached simulation, not the first one's. Reference: a fresh cache per call.
    f, b = [[0.5], [0.7], [0.6], [0.9]], [[1.1], [1.5], [1.3], [1.8]]
    base = dict(name="1f1b", p=4, m=12, v=1, fwd=lambda s, c: f[s][c], bwd=lambda s, c: b[s][c], p2p=0.05)
    variants = [{}, dict(name="zb_h1"), dict(m=16), dict(fwd=lambda s, c: f[s][c] + (s == 3) * 0.25),
                dict(bwd=lambda s, c: b[s][c] * (1.5 if s == 0 else 1.0)), dict(p2p=0.3), dict(split_drain=True),
                dict(name="zb_h1", w_lags=(0, 1, 1, 1))]
    shared = ScheduleCache()
    seen = []
    for change in variants:
        args = {**base, **change}
        got = simulate_pipeline(**args, schedules=shared)
        assert got == simulate_pipeline(**args), change
        assert all(got != other for other in seen), change  # each key field changes this result
        seen.append(got)
    assert simulate_pipeline(**base, schedules=shared) is seen[0] and shared.hits > 0  # a repeat is a hit


@cache
def _settings(config, cluster, request):
    """Every fitting setting the planner considers, with its base layout's index (the planner's own rule:
    cheapest recompute that fits, every ZeRO / offload / expert ZeRO stage). Computed once per search: the
    cost options do not enter it, and ``PAIRS`` prices searches 0 and 1 under several."""
    budget = cluster.device.memory_bytes * request.memory_fraction
    out = []
    for index, base in enumerate(enumerate_layouts(config, cluster, request)):
        splits = stage_layer_counts(config, base.pp, base.virtual_stages, base.seq_len)  # the engine splits at seq_len
        for recompute in (r for r in RECOMPUTE_ORDER if r in request.recompute_modes):
            fits = False
            for zero in request.zero_stages:
                for ezero in expert_zero_choices(config, zero, request):
                    layout = base.replace(recompute=recompute, zero_stage=zero, expert_zero_stage=ezero)
                    if estimate_memory(config, memory_layout(layout), stage_layers=splits,
                                       step_microbatches=layout.num_microbatches).peak_bytes <= budget:
                        fits = True
                        out.append((index, layout, splits))
            if fits:
                break
    return tuple(out)  # shared by the tests: read only


SEARCHES = [  # (model, GPUs, device, request): dense and MoE, every searched schedule, tight memory
    (_dense(12), 16, "h100_80gb", PlanRequest(global_batch_size=64, seq_len=4096, simulate_top=8)),
    (_dense(16), 32, "a100_40gb", PlanRequest(global_batch_size=128, seq_len=2048, simulate_top=6,
                                              micro_batch_sizes=(1, 2), zero_stages=(1, 3))),
    (_moe(), 16, "h100_80gb", PlanRequest(global_batch_size=32, seq_len=4096, simulate_top=6,
                                          micro_batch_sizes=(1, 2))),
    # DP traffic longer than one chunk's backward, hidden over several chunks (parallel3d's per-chunk sync)
    (_dense(16), 64, "a100_80gb", PlanRequest(global_batch_size=64, seq_len=1024, simulate_top=6,
                                              micro_batch_sizes=(1,), zero_stages=(2,))),
]
OPTIONS = {"parallel3d": CostOptions(), "megatron_core": CostOptions.megatron_core(),
           "megatron_sc21": CostOptions.megatron_sc21()}
PAIRS = [(0, "parallel3d"), (0, "megatron_core"), (0, "megatron_sc21"), (1, "parallel3d"), (1, "megatron_sc21"),
         (2, "megatron_core"), (3, "parallel3d")]


@pytest.mark.parametrize("search, options", PAIRS)
def test_step_bound_never_exceeds_the_full_price_and_the_top_is_the_full_prices(search, options):
    config, gpus, device, request = SEARCHES[search]
    cluster = ClusterSpec.build(gpus, 8, device)
    best: dict[int, float] = {}
    settings = _settings(config, cluster, request)
    # One search's cache, as ``plan`` keeps: settings with the same pipeline inputs share one simulation
    # (exact: test_priced_pipeline_memo_keys_on_every_input); search 2 prices 2,172 settings on 362 pipelines.
    schedules = ScheduleCache()
    for index, layout, splits in settings:
        chunks = chunk_layer_counts(config, layout, splits)
        full = estimate_step(config, layout, cluster, OPTIONS[options], splits, chunk_layers=chunks,
                             schedules=schedules).step_time_s
        low = estimate_step(config, layout, cluster, OPTIONS[options], splits, pipeline=pipeline_lower_bound,
                            chunk_layers=chunks).step_time_s
        assert low <= full * (1 + REL), (layout.short(), low, full)
        best[index] = min(full, best.get(index, float("inf")))
    brute = sorted(best.values())[: request.simulate_top]
    result = plan(config, cluster, request, OPTIONS[options])
    assert [c.step.step_time_s for c in result.ranked] == pytest.approx(brute, rel=REL)
    assert result.simulated < len(settings)  # the bound did prune
