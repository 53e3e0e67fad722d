"""NCCL's ring latency per collective call (``CommModel.ring_latency``) and the calls a DP reduction takes
(``cost.dp_bucket`` / ``cost.dp_calls``), against hand computations from NCCL's published tuning model.

Independent reference: ``src/graph/tuning.cc`` of NVIDIA/nccl (v2.18.1-1 .. v2.30.7-1), ring / Simple:
``baseLat`` 8.4 us, ``hwLat`` 3.4 us per NVLink step and 14 us per network step, a ring of n ranks on
``nodes`` nodes taking n - 1 steps of which nodes - 1 cross the network; typed here from that table, not
imported from the module under test. Bandwidth terms are the device's, computed by hand as the cost model's
docstring states them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.comm_cost import CommModel
from parallel3d.planning.cost import bucketed_chunks, dp_bucket, dp_calls
from parallel3d.planning.cost_options import CostOptions
from parallel3d.planning.layout import Layout
from parallel3d.planning.published import load_published_runs
from parallel3d.planning.source_frameworks import run_options

BASE_US, NVLINK_STEP_US, NET_STEP_US = 8.4, 3.4, 14.0  # tuning.cc ring / Simple


def _comm(tp: int, dp: int) -> tuple[CommModel, ClusterSpec]:
    cluster = ClusterSpec.build(tp * dp, 8, "h100_80gb")
    layout = Layout(tp=tp, pp=1, dp=dp, micro_batch_size=1, global_batch_size=dp, seq_len=4096, precision="bf16")
    return CommModel(cluster, layout.topology), cluster


@pytest.mark.parametrize("tp, dp, members, nodes", [
    (8, 2, 2, 2),  # one DP member per node: every step crosses the network
    (8, 288, 288, 288),  # Nemotron-4 15B's largest ring
    (2, 16, 16, 4),  # four members per node: 12 of the 15 steps stay on NVLink
])
def test_reduce_scatter_pays_nccl_ring_latency_per_call(tp, dp, members, nodes):
    comm, cluster = _comm(tp, dp)
    per_node = members // nodes
    nbytes = 1e9
    dev = cluster.device
    bandwidth = ((per_node - 1) / per_node * nbytes / (dev.intra_node_bytes_per_s * dev.link_efficiency)
                 + (nodes - 1) / nodes * nbytes / per_node / (dev.inter_node_bytes_per_s * dev.link_efficiency))
    latency = (BASE_US + (members - nodes) * NVLINK_STEP_US + (nodes - 1) * NET_STEP_US) * 1e-6
    for calls in (1, 7):
        assert comm.reduce_scatter(nbytes, "dp", calls) == pytest.approx(bandwidth + calls * latency, rel=1e-12)
        assert comm.all_reduce(nbytes, "dp", calls) == pytest.approx(2 * (bandwidth + calls * latency), rel=1e-12)


def test_same_bytes_on_288_nodes_cost_286_network_steps_more_than_on_2():
    small, _ = _comm(8, 2)
    large, _ = _comm(8, 288)
    # Bytes per rank alike up to the ring's (n - 1) / n: take the bandwidth term out by hand.
    gap = large.ring_latency("dp") - small.ring_latency("dp")
    assert gap == pytest.approx((288 - 2) * NET_STEP_US * 1e-6, rel=1e-12)


def test_a_group_inside_one_node_pays_no_ring_latency():
    comm, _ = _comm(8, 2)
    assert comm.ring_latency("tp") == 0.0
    assert comm.reduce_scatter(0.0, "tp", calls=100) == 0.0


def test_megatron_core_buckets_keep_the_latency_flat_fixed_buckets_let_it_grow():
    """Megatron-Core sizes buckets max(4e7, 1e6 x dp) parameters so that the calls x per-call latency of a
    reduction stays flat in dp; the fixed 4e7 before Megatron-LM 0fda386c04 let it grow with the ring."""
    params = 1.96e9  # Nemotron-4 15B on one tp8 rank
    scaled = CostOptions.megatron_core()
    fixed = replace(scaled, grad_bucket=(40e6, 0.0))

    def latency(options: CostOptions, dp: int) -> float:
        comm, _ = _comm(8, dp)
        return dp_calls(dp_bucket(options, dp), params, 1, 32, 2) * comm.ring_latency("dp")

    # 1.96e9 / 96e6 -> 21 buckets, / 288e6 -> 7; / 40e6 -> 49 at any dp.
    assert latency(scaled, 96) == pytest.approx(21 * (BASE_US + 95 * NET_STEP_US) * 1e-6, rel=1e-12)  # 28.1 ms
    assert latency(scaled, 288) == pytest.approx(7 * (BASE_US + 287 * NET_STEP_US) * 1e-6, rel=1e-12)  # 28.2 ms
    assert latency(fixed, 96) == pytest.approx(49 * (BASE_US + 95 * NET_STEP_US) * 1e-6, rel=1e-12)  # 65.6 ms
    assert latency(fixed, 288) == pytest.approx(49 * (BASE_US + 287 * NET_STEP_US) * 1e-6, rel=1e-12)  # 197 ms


def test_zero3_calls_once_per_layer_under_fsdp2_and_sc21_once_per_buffer():
    assert dp_calls(dp_bucket(CostOptions(), 64), 5e9, 3, 40, 2, unit_calls=True) == 40
    assert dp_calls(dp_bucket(CostOptions.megatron_sc21(), 64), 5e9, 0, 40, 2) == 1


def test_parallel3d_zero3_calls_once_per_bucket_within_each_layer():
    """parallel3d's ZeRO-3 gathers and reduce-scatters per bucket (``params_sharded._gather``), 25 MB of bf16 =
    13,107,200 elements each, a bucket never spanning two layers: 40 layers of 125e6 parameters take
    ceil(125e6 / 13,107,200) = 10 buckets each, the first layer one more (its ~1 MiB first bucket: 524,288
    elements, then ceil((125e6 - 524,288) / 13,107,200) = 10). One call per layer priced it 10x too few."""
    assert dp_calls(dp_bucket(CostOptions(), 64), 5e9, 3, 40, 2) == 39 * 10 + 11


def test_megatron_core_buckets_only_the_first_stages_first_chunk():
    """core_r0.8.0-r0.11.0 DistributedDataParallel: bucket_size None on pipeline ranks > 0 and for model
    chunks > 0 (disable_bucketing), so each of those chunks is one call; parallel3d buckets every chunk."""
    share = [0.4, 0.3, 0.3]
    mcore = CostOptions.megatron_core()
    assert bucketed_chunks(mcore, 0, share) == (0.4, 2)
    assert bucketed_chunks(mcore, 1, share) == (0.0, 3)
    assert bucketed_chunks(CostOptions(), 1, share) == (1.0, 0)
    # stage 0 of a 3-chunk stage holding 1.2e9 parameters: 0.4 x 1.2e9 / 4.8e7 = 10 buckets, then 2 whole chunks
    assert dp_calls(dp_bucket(mcore, 48), 1.2e9, 1, 24, 2, *bucketed_chunks(mcore, 0, share)) == 12
    assert dp_calls(dp_bucket(mcore, 48), 1.2e9, 1, 24, 2, *bucketed_chunks(mcore, 1, share)) == 3


@pytest.mark.parametrize("run_id", ["torchtitan_llama3_8b_a100", "torchtitan_llama3_70b_a100"])
def test_torchtitan_rows_price_one_zero3_call_per_block(run_id):
    """torchtitan ``fully_shard``s each TransformerBlock (FSDP2): one all-gather and one reduce-scatter per block,
    whatever its size, where parallel3d's runtime would cut a 70B block into several buckets."""
    run = next(r for r in load_published_runs() if r.id == run_id)
    options = run_options(run)
    layers = run.model.layers
    calls = dp_calls(dp_bucket(options, run.layout.dp), 1e9 * layers, 3, layers, 2, unit_calls=options.zero3_unit_calls)
    assert calls == layers


@pytest.mark.parametrize("stage", [0, 2])
def test_megatron_2021_all_reduces_once_per_model_chunk(stage):
    """Megatron-LM 2021-22 wraps each interleaved model chunk in its own LocalDDP with one contiguous buffer and
    ``train_step`` all-reduces them one by one (``for model_module in model: model_module.allreduce_gradients()``):
    a stage holding 3 chunks makes 3 calls, on every stage."""
    sc21 = CostOptions.megatron_sc21()
    share = [0.4, 0.3, 0.3]
    assert dp_calls(dp_bucket(sc21, 32), 1.2e9, 0, 24, 2, *bucketed_chunks(sc21, stage, share)) == 3
    assert dp_calls(dp_bucket(sc21, 32), 1.2e9, 0, 24, 2, *bucketed_chunks(sc21, stage, [1.0])) == 1
