"""The data-parallel gradient traffic of an MoE layout (issue 26): a rank reduces only the routed
experts it holds (``experts / ep``, ``1 / etp`` of each), over the expert data-parallel group, and its
dense parameters over dp x cp.

Independent reference: the expert and dense parameter counts written out by hand from the model's
dimensions, and the ring collectives of ``CommModel`` over the groups the topology builds."""

from __future__ import annotations

import pytest

from models import ModelConfig
from models.moe_config import MoEConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.comm_cost import CommModel
from parallel3d.planning.cost import CostOptions, estimate_step, stage_grad_groups
from parallel3d.planning.grad_buckets import bucket_count
from parallel3d.planning.layout import Layout

L, H, F, E, V = 8, 1024, 2048, 8, 32000


def _config() -> ModelConfig:
    return ModelConfig(arch="llama", num_layers=L, hidden_size=H, num_heads=16, num_kv_heads=4,
                       ffn_hidden_size=4 * H, vocab_size=V, max_seq_len=1024, tie_embeddings=False, use_bias=False,
                       moe=MoEConfig(num_experts=E, top_k=2, ffn_hidden_size=F))


def _hand_counts(tp: int, pp: int, ep: int, etp: int, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters on one rank of ``stage`` (uniform split, no biases)."""
    layers = L // pp
    kv = H // 16 * 4
    attention = (H * H + 2 * H * kv) // tp + H * H // tp + 2 * H  # qkv, out (tp-split), two norms
    router = E * H  # replicated
    dense = layers * (attention + router)
    if stage == 0:
        dense += V * H // tp
    if stage == pp - 1:
        dense += V * H // tp + H  # head and final norm
    expert = layers * (E // ep) * 3 * H * F // etp  # SwiGLU: w1, w3 (ffn out) and w2
    return dense, expert


@pytest.mark.parametrize("tp, pp, dp, ep, etp", [(2, 2, 8, 8, 1), (2, 1, 8, 4, 2), (1, 2, 4, 1, 1)])
def test_grad_groups_hold_the_ranks_own_experts(tp, pp, dp, ep, etp):
    layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=None if etp == tp else etp, micro_batch_size=1,
                    seq_len=1024, global_batch_size=4 * dp, zero_stage=1)
    for stage in range(pp):
        groups = stage_grad_groups(_config(), layout, stage, L // pp)
        dense, expert = _hand_counts(tp, pp, ep, etp, stage)
        assert groups[0][:2] == (dense, "dp_cp")
        assert groups[1][:2] == (expert, "edp")


def test_exposed_dp_time_is_the_dense_and_expert_reductions():
    """Non-overlapped all-reduce (ZeRO 0, nothing hidden): the exposed time is exactly the dense
    all-reduce over dp_cp plus the expert one over edp, the sizes counted by hand."""
    config = _config()
    cluster = ClusterSpec.build(64, 8, "h100_80gb")
    layout = Layout(tp=2, pp=1, dp=32, ep=8, etp=1, micro_batch_size=1, seq_len=1024, global_batch_size=64)
    options = CostOptions(overlapped_zero_stages=(), dp_grad_bytes=4)
    step = estimate_step(config, layout, cluster, options)
    comm = CommModel(cluster, layout.topology)
    dense, expert = _hand_counts(2, 1, 8, 1, 0)
    # one collective call per bucket of parallel3d's runtime (``bucket_count``, checked against the runtime's
    # buffers in test_planning_grad_buckets), fp32 parameters (the layout's default precision)
    want = (comm.all_reduce(4 * dense, "dp_cp", bucket_count(dense, 4))
            + comm.all_reduce(4 * expert, "edp", bucket_count(expert, 4)))
    assert step.dp_exposed_s == pytest.approx(want, rel=1e-12)
    # the edp group (tp*dp/(ep*etp) = 8 ranks) is not the dense dp group
    assert comm.group_size("edp") == 8 and comm.group_size("dp_cp") == 32
