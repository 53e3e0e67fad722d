"""TransformerEngine userbuffers TP overlap (``planning.tp_overlap``) against its mechanism (issue 26).

TE's defaults (``initialize_ub`` without ``ub_cfgs``): ring-exchange all-gathers in ``tp`` splits on 1 SM,
pipelined reduce-scatters in 4 splits on 16 SMs, bulk backward overlaps on 16 SMs, of the device's SMs
(``DeviceSpec.compute_units``: an H100's 132, an A100's 108). Each
test pins one consequence: a pipelined reduce-scatter's last slice is never hidden, fewer splits or more
SMs taken expose more, and with nothing to overlap the price is the unoverlapped one.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from models.config import ModelConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.comm_cost import CommModel
from parallel3d.planning.cost import CostOptions, layer_times
from parallel3d.planning.gemm import GemmCurve
from parallel3d.planning.layout import Layout
from parallel3d.planning.tp_overlap import (UbConfig, concurrent_exposed, pipelined_exposed, ring_exchange_exposed,
                                            tp_overlap_exposed)

MCORE = CostOptions.megatron_core()
COMMS, GEMMS = (0.1e-3, 0.5e-3, 2e-3), (0.0, 0.3e-3, 1e-3, 4e-3)


def _gpt32b() -> ModelConfig:  # a 32B-class GPT (h 7168, 56 heads, as the Megatron-LM README's 32B)
    return ModelConfig(arch="gpt", num_layers=60, hidden_size=7168, num_heads=56, num_kv_heads=56,
                       ffn_hidden_size=4 * 7168, vocab_size=51200, max_seq_len=4096, tie_embeddings=False,
                       use_bias=False)


def _layout(tp: int = 8) -> Layout:
    return Layout(tp=tp, pp=1, dp=1, micro_batch_size=4, seq_len=4096, global_batch_size=4, recompute="none",
                  sequence_parallel=True, precision="bf16", zero_stage=1)


def test_pipelined_reduce_scatter_exposes_more_with_fewer_splits():
    for comm, gemm in itertools.product(COMMS, GEMMS):
        exposed = [pipelined_exposed(comm, gemm, gemm, n, 16, 132) for n in (1, 2, 4, 8)]
        assert all(a >= b for a, b in zip(exposed, exposed[1:])), (comm, gemm, exposed)
    assert pipelined_exposed(1e-3, 4e-3, 4e-3, 2, 16, 132) > pipelined_exposed(1e-3, 4e-3, 4e-3, 4, 16, 132)


def test_more_communication_sms_slow_the_overlapped_gemm():
    for comm, gemm in itertools.product(COMMS, GEMMS[1:]):
        exposed = [concurrent_exposed(comm, gemm, sm, 132) for sm in (0, 1, 16, 32)]
        assert all(a <= b for a, b in zip(exposed, exposed[1:])), (comm, gemm, exposed)
    # A collective shorter than its GEMM costs exactly the SMs it takes for as long as it runs.
    assert concurrent_exposed(1e-3, 4e-3, 16, 132) == pytest.approx(1e-3 * 16 / 132)


def test_never_below_the_unoverlappable_part():
    for comm, gemm, n, sm in itertools.product(COMMS, GEMMS, (1, 2, 4, 8), (0, 1, 16)):
        assert pipelined_exposed(comm, gemm, gemm, n, sm, 132) >= comm / n  # the last slice's reduce-scatter
        assert concurrent_exposed(comm, gemm, sm, 132) >= max(0.0, comm - gemm)  # what the GEMM cannot cover
        assert ring_exchange_exposed(comm, gemm, gemm, n, sm, 132) >= max(0.0, comm - gemm)
        assert concurrent_exposed(comm, gemm, sm, 132) <= comm  # never worse than not overlapping


def test_nothing_to_overlap_prices_the_unoverlapped_collectives():
    for comm, n in itertools.product(COMMS, (1, 2, 4, 8)):
        assert pipelined_exposed(comm, 0.0, 0.0, n, 16, 132) == pytest.approx(comm)
        assert ring_exchange_exposed(comm, 0.0, 0.0, n, 1, 132) == pytest.approx(comm)
    # GEMMs of (next to) no time: each direction's 2 all-gathers + 2 reduce-scatters stay whole.
    instant = GemmCurve(peak_flops=1e30, max_efficiency=1.0, knee=0.0)
    fwd, bwd = tp_overlap_exposed(1e-3, 2, _gpt32b(), instant, tp=8, cp=1, micro_batch_size=4, seq_len=4096,
                                  sms=132)
    assert (fwd, bwd) == (pytest.approx(4e-3), pytest.approx(4e-3))


def test_layer_tp_exposure_between_free_and_unoverlapped():
    # tp8 32B on H100s: its GEMMs are longer than its collectives, so some but not all of them hide.
    cluster = ClusterSpec.build(8, 8, "h100_80gb")
    layout, config = _layout(), _gpt32b()
    comm = CommModel(cluster, layout.topology)
    off = dict(layer_times(config, layout, cluster, comm, MCORE).comm)["tp"]
    on = layer_times(config, layout, cluster, comm, CostOptions(**{**MCORE.__dict__, "tp_comm_overlap": True}))
    exposed = dict(on.comm)["tp"]
    last_slices = 2 * (off / 2 / 4) / UbConfig().pipeline_splits  # forward: 2 reduce-scatters' last slices
    assert last_slices < exposed < 0.5 * off


def test_pricing_slices_on_the_gemm_curve_costs_more():
    config, curve = _gpt32b(), GemmCurve.of(ClusterSpec.build(8, 8, "h100_80gb").device)
    kw = dict(tp=8, cp=1, micro_batch_size=1, seq_len=4096, sms=132)
    plain = tp_overlap_exposed(0.3e-3, 2, config, curve, **kw)
    sliced = tp_overlap_exposed(0.3e-3, 2, config, curve, ub=UbConfig(price_slices=True), **kw)
    assert sliced[0] > plain[0] and sliced[1] > plain[1]


def test_a_collective_with_no_gemm_beside_it_stays_whole():
    # A GPT layer has two column -> row runs (attention, MLP); a third pair of collectives has nothing to hide behind.
    config, curve = _gpt32b(), GemmCurve.of(ClusterSpec.build(8, 8, "h100_80gb").device)
    kw = dict(tp=8, cp=1, micro_batch_size=4, seq_len=4096, sms=132)
    two, three = (tp_overlap_exposed(0.5e-3, pairs, config, curve, **kw) for pairs in (2, 3))
    assert three[0] - two[0] == pytest.approx(2 * 0.5e-3) and three[1] - two[1] == pytest.approx(2 * 0.5e-3)


def test_the_sm_share_is_the_devices_own():
    # The same layer and links on a device with fewer SMs: the 16-SM kernels take a larger share of it.
    cluster = ClusterSpec.build(8, 8, "h100_80gb")
    fewer = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, compute_units=66))
    layout, config = _layout(), _gpt32b()
    on = CostOptions(**{**MCORE.__dict__, "tp_comm_overlap": True})
    tp = [dict(layer_times(config, layout, c, CommModel(c, layout.topology), on).comm)["tp"] for c in (cluster, fewer)]
    assert tp[1] > tp[0]
    unknown = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, compute_units=None))
    with pytest.raises(ValueError, match="compute_units"):
        layer_times(config, layout, unknown, CommModel(unknown, layout.topology), on)
