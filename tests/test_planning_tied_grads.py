"""The tied word embedding's gradient sum over the first and last pipeline stage, as the step prices it
(issue 26: ``CostOptions.tied_grad_whole``).

Reference, independent of ``CommModel``: the two ends sit in different nodes here, so the sum is a
two-member all-reduce over one NIC each, ``2 x (1/2) x bytes / (NIC bandwidth x link efficiency)`` from
the device's own datasheet fields, of the word embedding's rows on one tp rank (the runtime's vocabulary
padding) in the gradient dtype (fp32 for parallel3d's bf16 runs). Megatron-LM sums the whole gradient; parallel3d's ZeRO only its DP-reduced
piece (1/dp of it), so the two step times differ by the whole minus the piece; untied models, one
stage, and ZB-V (both ends on stage 0) send nothing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from models import ModelConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.layout import Layout
from parallel3d.planning.cost import CostOptions, estimate_step
from parallel3d.planning.memory import PrecisionBytes
from parallel3d.tensor_parallel.layers import padded_vocab_size

GPT = ModelConfig(arch="gpt", num_layers=8, hidden_size=1024, num_heads=16, ffn_hidden_size=4096,
                  vocab_size=50257, max_seq_len=2048, tie_embeddings=True)
CLUSTER = ClusterSpec.build(16, 8, "a100_80gb")


def _layout(pp: int, schedule: str = "1f1b") -> Layout:
    tp = 2
    dp = CLUSTER.gpus // (tp * pp)
    # tp x dp = 4 at pp 4: stages 0-1 share node 0 and stages 2-3 node 1, so only the first-last pair (not a
    # neighbouring one) crosses nodes.
    return Layout(tp=tp, pp=pp, dp=dp, schedule=schedule, virtual_stages=2 if schedule == "zbv" else 1,
                  micro_batch_size=1, seq_len=2048,
                  global_batch_size=8 * dp, zero_stage=1, precision="bf16", sequence_parallel=True)


def _steps(config: ModelConfig, pp: int, schedule: str = "1f1b") -> tuple[float, float]:
    """Step seconds with the ZeRO piece summed (parallel3d) and with the whole gradient (Megatron-LM)."""
    layout = _layout(pp, schedule)
    piece = estimate_step(config, layout, CLUSTER, CostOptions(tied_grad_whole=False)).step_time_s
    whole = estimate_step(config, layout, CLUSTER, CostOptions(tied_grad_whole=True)).step_time_s
    return piece, whole


def test_whole_gradient_sum_costs_the_two_node_all_reduce_of_the_embedding_rows():
    layout = _layout(4)
    dev = CLUSTER.device
    words = padded_vocab_size(GPT.vocab_size, layout.tp) // layout.tp * GPT.hidden_size
    grad_bytes = PrecisionBytes.for_precision("bf16").grad  # parallel3d reduces bf16 runs' gradients in fp32
    whole_s = 2 * (1 / 2) * words * grad_bytes / (dev.inter_node_bytes_per_s * dev.link_efficiency)
    piece_s = whole_s / layout.dp
    piece, whole = _steps(GPT, 4)
    # Stage 0 ends the 1F1B step after the last stage, so the sum adds its own length to the step.
    assert whole - piece == pytest.approx(whole_s - piece_s, rel=1e-6)


@pytest.mark.parametrize("config, pp, schedule", [
    pytest.param(replace(GPT, tie_embeddings=False), 4, "1f1b", id="untied"),
    pytest.param(GPT, 1, "1f1b", id="one-stage"),
    pytest.param(GPT, 4, "zbv", id="zbv-both-ends-on-stage-0"),
])
def test_no_message_without_two_ends_holding_a_tied_copy(config, pp, schedule):
    piece, whole = _steps(config, pp, schedule)
    assert whole == piece
