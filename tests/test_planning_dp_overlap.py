"""Per-chunk overlap of the data-parallel traffic (``parallel3d.planning.dp_overlap``) and its use in
``estimate_step``: independent references are the single-chunk closed form it must reduce to and the
pipeline simulator's own per-chunk timeline."""

from __future__ import annotations

import pytest

from models import get_config
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.cost import CostOptions, estimate_step
from parallel3d.planning.dp_overlap import chunk_shares, exposed_gather, exposed_reduction
from parallel3d.planning.layout import Layout
from parallel3d.planning.pipeline_price import simulate_pipeline


@pytest.mark.parametrize("traffic, last_pass, floor", [(5.0, 2.0, 0.5), (1.0, 2.0, 0.5), (1.0, 2.0, 0.0)])
def test_one_chunk_is_the_single_pass_rule(traffic, last_pass, floor):
    # max(last bucket, traffic - one backward), whenever the stage's last backward ends
    assert exposed_reduction([traffic], [10.0], [last_pass], 10.0, floor) == pytest.approx(
        max(floor, traffic - last_pass))
    assert exposed_gather([traffic], [0.0], [last_pass], floor) == pytest.approx(max(floor, traffic - last_pass))


def test_early_chunks_reduce_during_later_backwards_one_after_another():
    # chunk 1 done at t=4, chunk 0 at t=10 (the end); 3 s of traffic each, 1 s passes
    assert exposed_reduction([3.0, 3.0], [10.0, 4.0], [1.0, 1.0], 10.0, 0.0) == pytest.approx(2.0)
    # chunk 1's reduction still running when chunk 0's may start: the link serialises them
    assert exposed_reduction([3.0, 3.0], [10.0, 8.5], [1.0, 1.0], 10.0, 0.0) == pytest.approx(3.5)


def test_gathers_are_late_only_past_each_chunks_first_forward():
    # chunk 0 needed at 0 (+1 s of its forward), chunk 1 at 4: 3 + 3 s on the link from t = 0
    assert exposed_gather([3.0, 3.0], [0.0, 4.0], [1.0, 1.0], 0.0) == pytest.approx(2.0)
    assert exposed_gather([1.0, 3.0], [0.0, 4.0], [1.0, 1.0], 0.0) == pytest.approx(0.0)


def test_chunk_shares_put_the_ends_on_their_chunks():
    share = chunk_shares([2, 2], [1, 0], 10.0, 2.0)  # 8 left over for 4 layers, embedding on chunk 0
    assert share == pytest.approx([0.6, 0.4])
    assert sum(chunk_shares([1, 0, 3], [0, 1, 0], 7.0, 1.0)) == pytest.approx(1.0)


def _interleaved(config, v: int) -> tuple[Layout, ClusterSpec]:
    # ZeRO-2 (its reduce-scatter overlaps), dp across 8 nodes on slow NICs: the traffic outlasts one chunk
    cluster = ClusterSpec.build(64, gpus_per_node=8, device="h100_80gb", inter_node_gbps=12)
    layout = Layout(tp=2, pp=4, dp=8, zero_stage=2, micro_batch_size=1, seq_len=2048, global_batch_size=64,
                    schedule="interleaved_1f1b" if v > 1 else "1f1b", virtual_stages=v)
    return layout, cluster


def test_per_chunk_sync_hides_more_with_interleaving_and_nothing_changes_at_one_chunk():
    config = get_config("llama2_7b")
    per_chunk, one_pass = CostOptions(), CostOptions(chunk_grad_sync=False)
    layout, cluster = _interleaved(config, 4)
    assert estimate_step(config, layout, cluster, per_chunk).dp_exposed_s < \
        0.7 * estimate_step(config, layout, cluster, one_pass).dp_exposed_s
    layout, cluster = _interleaved(config, 1)
    assert estimate_step(config, layout, cluster, per_chunk).step_time_s == pytest.approx(
        estimate_step(config, layout, cluster, one_pass).step_time_s, rel=1e-12)


def test_chunk_times_come_from_the_simulated_timeline():
    times = simulate_pipeline("interleaved_1f1b", 2, 4, 2, 1.0, 2.0, 0.0)
    for stage in range(2):
        # chunk 0 runs the stage's last backward; chunk 1 finished earlier and started later
        assert times.chunk_grads_done[stage][0] == pytest.approx(times.stage_end[stage])
        assert times.chunk_grads_done[stage][1] < times.chunk_grads_done[stage][0]
        assert times.chunk_first_forward[stage][0] == 0.0 < times.chunk_first_forward[stage][1]
