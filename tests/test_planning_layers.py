"""The estimator on models whose layers differ (DeepSeek's dense first layers): every stage sums its own
layers. References: the model built on the meta device per pipeline stage (its parameters on one rank),
and the CPU allocator's peak of a real 2-stage deepseek_tiny job (tests/peak_rss.py)."""

from __future__ import annotations

import pytest

from models import build_model, get_config
from models.registry import NAMED_CONFIGS
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.partition import partition_layers
from parallel3d.planning.activations import ActivationAssumptions, layer_activation_bytes
from parallel3d.planning.layout import Layout
from parallel3d.planning.memory import estimate_memory, stage_layer_indices
from parallel3d.topology import Topology
from tests.peak_rss import job_values, peak_allocated_of_job, token_file

TOLERANCE = 0.10


def _layouts():
    """Generated (pp, ep) layouts of a 4-layer model. ep = 1 only: a meta build without process groups
    holds every expert whatever ep says, so it is no reference for the ep split."""
    return [(pp, ep) for pp in (1, 2, 3, 4) for ep in (1,)]


@pytest.mark.parametrize("name", ["deepseek_tiny", "mixtral_tiny"])
@pytest.mark.parametrize("pp,ep", _layouts())
def test_stage_params_equal_the_meta_built_stage(name, pp, ep):
    config = get_config(name)
    estimate = estimate_memory(config, Layout(pp=pp, dp=ep, ep=ep, seq_len=64, micro_batch_size=1))
    topo = Topology(pp=pp, dp=ep, ep=ep)
    ranges = partition_layers(config, pp)
    for stage in range(pp):
        rank = topo.rank_of(pp=stage, dp=ep - 1)  # the last expert shard
        held = build_model(config, ParallelState.without_groups(topo, rank), device="meta",
                           layer_range=ranges[stage])
        assert estimate.stages[stage].params == sum(p.numel() for p in held.parameters()), (stage, ranges)


def test_a_dense_first_layer_is_counted_as_dense():
    """deepseek_tiny's layer 0 is dense: stage 0 of pp=4 holds its activations, not an MoE layer's."""
    config = get_config("deepseek_tiny")
    layout = Layout(pp=4, seq_len=64, micro_batch_size=1)
    a = ActivationAssumptions.for_model(config, layout.precision)
    ids = stage_layer_indices(config, layout, [1, 1, 1, 1])
    assert ids == [[0], [1], [2], [3]]
    dense, moe = (layer_activation_bytes(config, layout, a, i) for i in (0, 1))
    assert dense != moe
    est = estimate_memory(config, layout, a)
    assert est.stages[0].activations < est.stages[1].activations  # the dense layer keeps less here


@pytest.mark.parametrize("name", ["deepseek_v3_671b", "qwen3_235b_a22b"])
def test_real_size_moe_presets_estimate(name):
    if name not in NAMED_CONFIGS:
        pytest.skip(f"no preset {name}")
    config = get_config(name)
    est = estimate_memory(config, Layout(tp=4, pp=16, dp=64, ep=64, seq_len=4096, micro_batch_size=1,
                                         zero_stage=1, recompute="full", sequence_parallel=True))
    assert len(est.stages) == 16 and all(s.total > 0 for s in est.stages)


def test_deepseek_tiny_peak_per_stage_as_estimated(tmp_path):
    """Two pipeline stages of deepseek_tiny (stage 0: the dense layer 0 and MoE layer 1) at a longer
    sequence: each rank's allocator peak within 10% of its stage's estimate. Stage 0's peak is MoE
    layer 1's combine backward (``sequence_experts.moe_combine_backward_bytes``), stage 1's the loss's.
    In the default run (~7 s): the one measured proof of per-layer estimates on a layer-varying model."""
    seq = 1024
    model = {**NAMED_CONFIGS["deepseek_tiny"], "name": "rss_deepseek", "max_seq_len": seq, "dropout": 0.0}
    values = job_values(token_file(str(tmp_path)), str(tmp_path / "out"), model, dict(pp=2),
                        dict(seq_len=seq, micro_batch_size=1, global_batch_size=1))
    measured = peak_allocated_of_job(values, 2)
    config = get_config("deepseek_tiny", max_seq_len=seq, dropout=0.0)
    est = estimate_memory(config, Layout(pp=2, seq_len=seq, micro_batch_size=1, precision="fp32"),
                          ActivationAssumptions.for_model(config, "fp32", kernels="torch"))
    failures = [f"stage {s}: estimated {est.stages[s].total / 2**20:.2f} MiB, measured {got / 2**20:.2f} MiB"
                for s, got in enumerate(measured) if abs(est.stages[s].total - got) > TOLERANCE * got]
    assert not failures, "\n".join(failures)
