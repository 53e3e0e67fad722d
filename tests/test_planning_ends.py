"""The embedding and the output head with its loss are priced on the chunks that run them, also when
one chunk runs both (pp = 1, v = 1): checked against the head's time written out by hand."""

from __future__ import annotations

import pytest

from models import ModelConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.cost import estimate_step
from parallel3d.planning.layout import Layout


def _head_seconds_by_hand(device, tokens: int, hidden: int, vocab: int) -> float:
    """Forward + backward (2x) of the logits GEMM on the device's shape curve, plus its fp32 logits
    written once and read once per pass (tp = 1, vocab a multiple of 128: no padding)."""
    x = 1.0 / (1.0 / tokens + 1.0 / vocab + 1.0 / hidden)
    efficiency = device.matmul_efficiency * x / (x + device.gemm_knee)
    gemm = 2.0 * tokens * hidden * vocab / (device.peak_flops * efficiency)
    logits = 2.0 * 4.0 * tokens * vocab / device.hbm_bytes_per_s
    return 3.0 * (gemm + logits)


@pytest.mark.parametrize("pp", [1, 2])
def test_the_head_costs_its_hand_computed_time_whatever_the_pipeline(pp):
    cluster = ClusterSpec.build(pp, 8, "h100_80gb")
    # Plain 1F1B: the whole head is on the critical path. With the drain split (the default) the last
    # stage's head W runs beside stage 0's backward, so only part of it would show in the step.
    layout = Layout(tp=1, pp=pp, dp=1, micro_batch_size=2, global_batch_size=2, seq_len=2048, recompute="none",
                    precision="bf16", split_drain=False)
    small, large = 32768, 131072

    def pipeline_end(vocab: int) -> float:
        config = ModelConfig(arch="gpt", num_layers=4, hidden_size=1024, num_heads=8, vocab_size=vocab,
                             max_seq_len=2048, tie_embeddings=False)
        step = estimate_step(config, layout, cluster)
        return step.step_time_s - step.optimizer_s - step.dp_exposed_s

    tokens = layout.micro_batch_size * layout.seq_len
    by_hand = (_head_seconds_by_hand(cluster.device, tokens, 1024, large)
               - _head_seconds_by_hand(cluster.device, tokens, 1024, small))
    assert pipeline_end(large) - pipeline_end(small) == pytest.approx(by_hand, rel=1e-9)


@pytest.mark.parametrize("dp, vocab, bucket", [
    (4, 65536, 40e6),  # DistributedDataParallel's floor: 40M parameters
    (64, 65536, 64e6),  # 1M parameters per DP rank
    (4, 256000, 256000 // 8 * 4096),  # the embedding shard on stage 0 is one parameter, never split
])
def test_overlapped_dp_exposes_its_last_gradient_bucket_and_first_parameter_bucket(dp, vocab, bucket):
    from dataclasses import replace

    from parallel3d.planning.cost import CostOptions

    cluster = ClusterSpec.build(8 * dp, 8, "h100_80gb")
    config = ModelConfig(arch="gpt", num_layers=8, hidden_size=4096, num_heads=32, vocab_size=vocab,
                         max_seq_len=4096, tie_embeddings=False)
    # One microbatch per step with a long backward: every bucket but the last hides behind it.
    layout = Layout(tp=8, pp=1, dp=dp, micro_batch_size=16, global_batch_size=16 * dp, seq_len=4096,
                    recompute="none", zero_stage=1, sequence_parallel=True, precision="bf16")
    options = CostOptions.megatron_core()
    assert options.grad_bucket == (40e6, 1e6)
    # tp8 puts one DP member on each node: a ring over dp nodes through each member's own NIC.
    nic = cluster.device.inter_node_bytes_per_s * cluster.device.link_efficiency
    # bf16 gradients reduce-scattered, bf16 weights gathered; each one NCCL ring call over dp nodes
    # (src/graph/tuning.cc ring / Simple: 8.4 us base + 14 us per network step).
    one_pass = (dp - 1) / dp * bucket * 2 / nic + (8.4 + 14.0 * (dp - 1)) * 1e-6
    assert estimate_step(config, layout, cluster, options).dp_exposed_s == pytest.approx(2 * one_pass, rel=1e-9)
    assert estimate_step(config, layout, cluster, replace(options, grad_bucket=None)).dp_exposed_s == 0.0
