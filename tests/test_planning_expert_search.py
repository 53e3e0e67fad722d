"""The planner's MoE search covers etp (issue 26): at every tp > 1 both the dense tp and whole experts.

Reference: the layout grid itself over every tp the model allows (generated, not hand-picked). The
expert ZeRO stage is searched too (``expert_zero_choices``) but no test yet shows it chosen.
"""

from __future__ import annotations

from models import ModelConfig
from models.moe_config import MoEConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.planner import enumerate_layouts
from parallel3d.planning.request import PlanRequest

MOE = ModelConfig(arch="llama", num_layers=4, hidden_size=1024, num_heads=16, num_kv_heads=8, ffn_hidden_size=2816,
                  vocab_size=32000, max_seq_len=4096, moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=4096))


def test_moe_layouts_include_whole_experts_at_tp_above_one():
    request = PlanRequest(global_batch_size=16, seq_len=1024, micro_batch_sizes=(1,))
    layouts = enumerate_layouts(MOE, ClusterSpec.build(16, 8, "h100_80gb"), request)
    for tp in (2, 4, 8):
        etps = {lay.etp for lay in layouts if lay.tp == tp}
        assert etps == {None, 1}, tp
    off = enumerate_layouts(MOE, ClusterSpec.build(16, 8, "h100_80gb"),
                            PlanRequest(global_batch_size=16, seq_len=1024, micro_batch_sizes=(1,),
                                        search_expert_options=False))
    assert {lay.etp for lay in off} == {None}
