"""Cost model pieces against closed forms and full simulation; planner search and errors."""

from __future__ import annotations

import pytest

from models import ModelConfig, get_config
from parallel3d.planning.cluster import ClusterSpec, parse_bytes
from parallel3d.planning.cost import CommModel, estimate_step, step_flops
from parallel3d.planning.pipeline_price import _simulate_once, simulate_pipeline
from parallel3d.planning.layout import Layout
from parallel3d.planning.planner import enumerate_layouts, evaluate, plan
from parallel3d.planning.request import PlanRequest
from parallel3d.topology import Topology


@pytest.mark.parametrize("name, p, m, v", [
    ("1f1b", 8, 100, 1), ("1f1b", 5, 37, 1), ("gpipe", 4, 30, 1),
    ("interleaved_1f1b", 4, 40, 2), ("interleaved_1f1b", 4, 40, 3),
])
def test_extrapolated_pipeline_equals_full_simulation(name, p, m, v):
    def fwd(stage, chunk):  # uneven on purpose: embedding on the first chunk, slower late stages
        return 1.0 + 0.3 * (stage == 0 and chunk == 0) + 0.1 * stage

    def bwd(stage, chunk):
        return 2.0 + 0.7 * (stage == p - 1 and chunk == v - 1)

    fast, full = simulate_pipeline(name, p, m, v, fwd, bwd, 0.05), _simulate_once(name, p, m, v, fwd, bwd, 0.05)
    assert fast.makespan == pytest.approx(full.makespan, rel=1e-12)
    assert fast.stage_end == pytest.approx(full.stage_end, rel=1e-12)
    assert fast.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-9)
    for kind in ("chunk_grads_done", "chunk_first_forward"):  # per-chunk DP overlap reads these
        for a, b in zip(getattr(fast, kind), getattr(full, kind), strict=True):
            assert a == pytest.approx(b, rel=1e-12)


@pytest.mark.parametrize("p, m", [(4, 16), (8, 64)])
def test_uniform_1f1b_bubble_is_the_textbook_fraction(p, m):
    times = simulate_pipeline("1f1b", p, m, 1, 1.0, 2.0, 0.0)
    assert times.makespan == pytest.approx((m + p - 1) * 3.0)
    assert times.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_ring_collectives_match_closed_forms():
    cluster = ClusterSpec.build(64, 8, "a100_80gb")
    intra = cluster.device.intra_node_bytes_per_s * cluster.device.link_efficiency
    inter = cluster.device.inter_node_bytes_per_s * cluster.device.link_efficiency
    n = 1e9
    # tp=8 inside a node: ring all-reduce 2(n-1)/n * N / B_nvlink.
    comm = CommModel(cluster, Topology(tp=8, pp=1, dp=8))
    assert comm.all_reduce(n, "tp") == pytest.approx(2 * 7 / 8 * n / intra)
    # dp=8, one member per node: every byte crosses the member's own NIC, and each of the two ring passes
    # pays NCCL's ring latency across nodes (tuning.cc ring / Simple: 8.4 us + 14 us per network step).
    assert comm.all_reduce(n, "dp") == pytest.approx(2 * (7 / 8 * n / inter + (8.4 + 7 * 14.0) * 1e-6))
    # dp=64 with tp=1: 8 members per node share 8 NICs; inside-node ring plus 1/8 across; 63 ring steps,
    # 7 over the network, 56 over NVLink (3.4 us each).
    comm = CommModel(cluster, Topology(tp=1, pp=1, dp=64))
    assert comm.reduce_scatter(n, "dp") == pytest.approx(7 / 8 * n / intra + 7 / 8 * n / 8 / inter
                                                         + (8.4 + 56 * 3.4 + 7 * 14.0) * 1e-6)
    assert CommModel(cluster, Topology(tp=1, pp=1, dp=64)).all_reduce(n, "tp") == 0.0


def test_megatron_flops_formula():
    # Narayanan et al. eq. 3: 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) with full recompute.
    config = ModelConfig(arch="gpt", num_layers=24, hidden_size=2304, num_heads=24, vocab_size=51200,
                         max_seq_len=2048, use_bias=False)
    layout = Layout(dp=4, global_batch_size=64, seq_len=2048, recompute="full")
    model, hardware = step_flops(config, layout)
    b, s, l, h, v = 64, 2048, 24, 2304, 51200
    assert hardware == pytest.approx(96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)), rel=1e-12)
    assert model == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)), rel=1e-12)


def test_more_recompute_costs_time_and_interleaving_shrinks_the_bubble():
    config = get_config("llama3_8b")
    cluster = ClusterSpec.build(64)
    base = Layout(tp=8, pp=4, dp=2, micro_batch_size=1, seq_len=4096, global_batch_size=64,
                  sequence_parallel=True)
    times = [estimate_step(config, base.replace(recompute=r), cluster).step_time_s
             for r in ("none", "selective", "full")]
    assert times[0] < times[1] < times[2]
    plain = estimate_step(config, base, cluster)
    interleaved = estimate_step(config, base.replace(schedule="interleaved_1f1b", virtual_stages=2), cluster)
    assert interleaved.bubble_fraction < plain.bubble_fraction


def test_enumerated_layouts_use_every_gpu_and_keep_tp_in_a_node():
    config = get_config("llama3_70b")
    cluster = ClusterSpec.build(256, 8)
    layouts = enumerate_layouts(config, cluster, PlanRequest(global_batch_size=512, seq_len=4096))
    assert layouts
    for layout in layouts:
        assert layout.world_size == 256 and layout.tp <= 8 and config.num_layers % layout.pp == 0
        assert 512 % (layout.dp * layout.micro_batch_size) == 0


@pytest.mark.parametrize("sp", [True, False])
def test_enumerated_layouts_follow_the_sequence_parallel_request(sp):
    """``PlanRequest.sequence_parallel``: on for every tp > 1 layout (the default), or off for every layout
    (frameworks without it, as the validation's rank check asks for the 2021 Megatron-LM rows)."""
    config = get_config("llama3_8b")
    layouts = enumerate_layouts(config, ClusterSpec.build(16, 8),
                                PlanRequest(global_batch_size=64, seq_len=2048, sequence_parallel=sp))
    assert any(layout.tp > 1 for layout in layouts)
    assert all(layout.sequence_parallel == (sp and layout.tp > 1) for layout in layouts)


def test_plan_drops_layouts_that_do_not_fit():
    config = get_config("llama3_70b")
    small = ClusterSpec.build(64, 8, "a100_80gb", device_mem="40GB")
    # the memory filter is the point, not the search's breadth: one schedule, even stages
    result = plan(config, small, PlanRequest(global_batch_size=128, seq_len=4096, top_k=5, schedules=("1f1b",),
                                             uneven_stages=False, max_virtual_stages=1))
    assert result.fitting < result.considered
    for candidate in result.ranked:
        assert candidate.peak_bytes <= 0.9 * 40e9


def test_plan_with_no_fitting_layout_says_why():
    result = plan(get_config("llama31_405b"), ClusterSpec.build(8),
                  PlanRequest(global_batch_size=8, seq_len=4096, schedules=("1f1b",), uneven_stages=False))
    with pytest.raises(ValueError, match="no layout"):
        result.best


@pytest.mark.parametrize("text, value", [("80GB", 80e9), ("80GiB", 80 * 2**30), ("1.5TB", 1.5e12), (1e9, 1e9)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad, key", [
    (lambda: parse_bytes("eighty"), "device_mem"),
    (lambda: ClusterSpec.build(device="tpu_v9"), "cluster.device"),
    (lambda: ClusterSpec.build(gpus=12, gpus_per_node=8), "cluster.gpus"),
    (lambda: ClusterSpec.build(peak_tflops=-1), "cluster.peak_tflops"),
    (lambda: PlanRequest(global_batch_size=0, seq_len=8), "plan.global_batch_size"),
    (lambda: PlanRequest(global_batch_size=8, seq_len=8, zero_stages=(4,)), "plan.zero_stages"),
    (lambda: PlanRequest(global_batch_size=8, seq_len=8, offload_modes=("disk",)), "plan.offload"),
    (lambda: estimate_step(get_config("gpt_tiny"), Layout(tp=2, seq_len=32), ClusterSpec.build(4)), "cluster.gpus"),
])
def test_bad_inputs_name_the_key(bad, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        bad()


def test_planner_searches_stage3_and_offloads_only_when_nothing_fits():
    """Stage 3 at dp 8 needs no tensor parallelism to fit 7B in 24 GB (no TP all-reduces; its gathers
    hide behind compute), so the planner finds it; cpu offload, when allowed, is chosen only if nothing
    fits on the device, and it costs time."""
    config = get_config("llama2_7b")
    request = dict(global_batch_size=8, seq_len=1024, micro_batch_sizes=(1,), recompute_modes=("full",))
    tight = ClusterSpec.build(8, device="a100_40gb", device_mem="24GB")
    without = plan(config, tight, PlanRequest(**request, zero_stages=(1, 2))).best
    best = plan(config, tight, PlanRequest(**request)).best
    assert best.layout.zero_stage == 3 and best.layout.offload == "none" and best.layout.tp == 1
    assert without.layout.tp > 1 and best.step.step_time_s < without.step.step_time_s
    tighter = ClusterSpec.build(8, device="a100_40gb", device_mem="12GB")
    with pytest.raises(ValueError, match="no layout"):
        plan(config, tighter, PlanRequest(**request)).best
    offloaded = plan(config, tighter, PlanRequest(**request, offload_modes=("none", "cpu"))).best
    assert offloaded.layout.offload == "cpu" and offloaded.memory.worst.host > 0
    on_device = evaluate(config, offloaded.layout.replace(offload="none"), tighter)
    assert offloaded.step.step_time_s > on_device.step.step_time_s  # offload costs time


def test_zero3_gathers_cost_more_per_microbatch_than_per_step():
    config = get_config("llama2_7b")
    # dp across 16 nodes on slow NICs, little compute per microbatch: the gathers cannot all hide.
    cluster = ClusterSpec.build(32, gpus_per_node=2, device="h100_80gb", inter_node_gbps=5)
    base = Layout(tp=1, pp=2, dp=16, zero_stage=3, micro_batch_size=1, seq_len=256, global_batch_size=64)
    per_step = estimate_step(config, base.replace(zero3_reshard="step"), cluster)
    per_microbatch = estimate_step(config, base.replace(zero3_reshard="microbatch"), cluster)
    assert per_microbatch.dp_exposed_s > per_step.dp_exposed_s


def test_pipeline_sizes_divide_layers_unless_uneven_stages_are_allowed():
    from parallel3d.planning.planner import pipeline_sizes

    assert pipeline_sizes(96) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    uneven = pipeline_sizes(126, uneven=True)
    assert 16 in uneven and 16 not in pipeline_sizes(126)  # 8 or 7 layers per stage
    assert 100 not in uneven  # 2 or 1 layers: stages 60% apart


def _uneven_case(num_layers: int = 15, hidden: int = 512, vocab: int = 32000):
    config = ModelConfig(arch="llama", num_layers=num_layers, hidden_size=hidden, num_heads=8, num_kv_heads=8,
                         ffn_hidden_size=4 * hidden, vocab_size=vocab, max_seq_len=2048)
    layout = Layout(tp=1, pp=4, dp=1, virtual_stages=2, schedule="interleaved_1f1b", global_batch_size=8,
                    micro_batch_size=1, seq_len=2048)
    return config, layout


def test_chunk_layer_counts_follow_the_engine_split_and_the_loop_placement():
    from parallel3d.pipeline.partition import partition_layers
    from parallel3d.planning.cost import chunk_layer_counts
    from parallel3d.planning.params import stage_layer_counts
    config, layout = _uneven_case()
    ranges = partition_layers(config, 4, 2)
    # Loop placement: model chunk k runs on stage k % p as that stage's local chunk k // p.
    expected = [[0, 0] for _ in range(4)]
    for k, (a, b) in enumerate(ranges):
        expected[k % 4][k // 4] = b - a
    got = chunk_layer_counts(config, layout)
    assert got == expected
    assert len({n for row in got for n in row}) > 1  # the case is uneven (an empty last chunk)
    assert [sum(r) for r in got] == stage_layer_counts(config, 4, 2)


# The engine's split beats (13 layers) / loses to (19) an even spread of each stage's layers; a
# small vocabulary keeps the embedding and head out of the comparison.
@pytest.mark.parametrize("num_layers", [13, 19])
def test_uneven_chunks_are_priced_by_their_own_layers_in_the_direction_the_simulator_says(num_layers):
    """Pricing each chunk by its own layers must move the pipeline time the way a direct simulation
    of those chunk sizes (one time unit per layer, no messages) does against the even spread."""
    from parallel3d.pipeline.schedules import build_schedule, simulate
    from parallel3d.planning.cost import chunk_layer_counts
    config, layout = _uneven_case(num_layers, hidden=2048, vocab=256)
    cluster = ClusterSpec.build(4, 4, "h100_80gb")
    real = chunk_layer_counts(config, layout)
    even = [[sum(r) / 2] * 2 for r in real]

    def makespan(counts):
        sched = build_schedule("interleaved_1f1b", 4, layout.num_microbatches, 2)
        return simulate(sched, lambda s, c: counts[s][c], lambda s, c: 2 * counts[s][c], 0.0).makespan

    real_est = estimate_step(config, layout, cluster, chunk_layers=real)
    even_est = estimate_step(config, layout, cluster, chunk_layers=even)
    assert makespan(real) != makespan(even)
    assert (real_est.pipeline_s < even_est.pipeline_s) == (makespan(real) < makespan(even))
    assert abs(real_est.pipeline_s / even_est.pipeline_s - 1) > 0.01
    # The default prices the engine's split.
    assert estimate_step(config, layout, cluster).pipeline_s == real_est.pipeline_s
