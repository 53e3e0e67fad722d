"""The planner's cp search prices every cp_comm variant (issue 26): ``plan.max_cp=4`` used to stop the
whole search with a config error on the first a2a+p2p layout (the cost model rebuilt the layout at cp 1
but kept cp_comm=a2a+p2p). Reference: the enumerated grid itself, and every layout's breakdown adding
up to its own step time."""

from __future__ import annotations

import pytest

from models import ModelConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.planner import enumerate_layouts, evaluate, plan
from parallel3d.planning.request import PlanRequest

DENSE = ModelConfig(arch="llama", num_layers=4, hidden_size=1024, num_heads=16, num_kv_heads=8, ffn_hidden_size=2816,
                    vocab_size=32000, max_seq_len=8192)


def test_every_cp_comm_variant_is_priced_and_the_search_completes():
    cluster = ClusterSpec.build(8, 8, "h100_80gb")
    request = PlanRequest(global_batch_size=8, seq_len=8192, micro_batch_sizes=(1,), max_cp=4, top_k=3)
    layouts = enumerate_layouts(DENSE, cluster, request)
    variants = {(lay.cp, lay.cp_comm, lay.cp_a2a_size) for lay in layouts}
    assert (4, "a2a+p2p", 2) in variants and (2, "a2a", None) in variants and (4, "allgather", None) in variants
    for lay in [lay for lay in layouts if lay.cp > 1][:12]:
        step = evaluate(DENSE, lay, cluster).step
        assert sum(t for _, t in step.breakdown) == pytest.approx(step.step_time_s, rel=1e-9)
    assert plan(DENSE, cluster, request).ranked
