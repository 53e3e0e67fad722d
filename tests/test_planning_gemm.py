"""The shape-dependent GEMM efficiency (``parallel3d.planning.gemm``, issue 26).

References: the FLOPs counted by ``models.shape`` (the curve may change the rate, never the work),
a brute-force walk over every weight of every layer (experts included, no de-duplication), and the
curve's defining properties (symmetry in m, n, k; monotone; saturates at ``matmul_efficiency``).
"""

from __future__ import annotations

import itertools
import random

import pytest

from models import ModelConfig
from models.moe_config import MoEConfig
from parallel3d.planning.cost import layer_forward_flops
from parallel3d.planning.devices import DEVICES
from parallel3d.planning.gemm import GemmCurve, matmul_seconds


def _configs() -> list[ModelConfig]:
    rng = random.Random(26)
    out = []
    for i in range(6):
        h = rng.choice([256, 512, 1024])
        heads = rng.choice([4, 8])
        moe = MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=2 * h, num_shared_experts=i % 2) if i % 3 == 2 \
            else MoEConfig()
        out.append(ModelConfig(arch=rng.choice(["gpt", "llama"]), num_layers=rng.choice([2, 3]), hidden_size=h,
                               num_heads=heads, num_kv_heads=heads // rng.choice([1, 2]), ffn_hidden_size=4 * h,
                               vocab_size=1000, max_seq_len=4096, moe=moe))
    return out


def _brute_force_seconds(config: ModelConfig, curve: GemmCurve, tp: int, ep: int, tokens: float) -> float:
    """Every matmul weight of every layer, one by one, on one tp rank."""
    total = 0.0
    for layer in config.shape.layers:
        for t in layer.tensors:
            if not t.matmul:
                continue
            flops = 2.0 * t.numel * t.active * tokens / tp
            if t.expert is not None:
                out, inp = t.shape
                n, k = (out // tp, inp) if inp == config.hidden_size else (out, inp // tp)
                rows = tokens * t.active * ep
            else:
                (n, k), rows = t.local_shape(tp), tokens
            total += flops / (curve.peak_flops * curve.efficiency(rows, n, k))
    return total / config.num_layers


def _cases() -> list[tuple[ModelConfig, int, int]]:
    return [(c, tp, ep) for c in _configs() for tp, ep in ((1, 1), (2, 1), (2, 2))
            if not (c.num_heads % tp or c.kv_heads % tp or (ep > 1 and not c.moe.enabled))]


@pytest.mark.parametrize("config, tp, ep", _cases(),
                         ids=lambda x: f"{x.arch}-h{x.hidden_size}-moe{x.moe.enabled}" if isinstance(x, ModelConfig)
                         else str(x))
def test_matmul_time_is_the_per_tensor_sum_and_keeps_the_flops(config, tp, ep):
    curve = GemmCurve(peak_flops=1e15, max_efficiency=0.7, knee=200.0)
    got = matmul_seconds(config, curve, tp=tp, ep=ep, micro_batch_size=2, seq_len=512)
    assert got == pytest.approx(_brute_force_seconds(config, curve, tp, ep, 1024.0), rel=1e-12)
    # With no knee the rate is constant, so the time is models.shape's FLOPs at that rate.
    flat = GemmCurve(peak_flops=1e15, max_efficiency=0.7, knee=0.0)
    flops = layer_forward_flops(config, 2, 512).matmul / tp
    assert matmul_seconds(config, flat, tp=tp, ep=ep, micro_batch_size=2, seq_len=512) == \
        pytest.approx(flops / (0.7e15), rel=1e-9)
    assert got > flops / 0.7e15  # the knee only slows GEMMs down


def test_curve_is_symmetric_monotone_and_saturates():
    curve = GemmCurve(peak_flops=1e15, max_efficiency=0.7, knee=200.0)
    dims = [64, 128, 1024, 8192, 65536]
    for m, n, k in itertools.product(dims, repeat=3):
        e = curve.efficiency(m, n, k)
        assert all(e == pytest.approx(curve.efficiency(*p)) for p in itertools.permutations((m, n, k)))
        assert 0 < e < 0.7
        assert curve.efficiency(2 * m, n, k) > e  # bigger shapes run closer to peak
    assert curve.efficiency(1e9, 1e9, 1e9) == pytest.approx(0.7, rel=1e-5)
    # half of the maximum at shape size x == knee (m = n = k = 3 * knee)
    assert curve.efficiency(600, 600, 600) == pytest.approx(0.35)


def test_thin_tp_shards_and_small_hidden_run_further_from_peak():
    """Calibrated H100 curve: a 2k-hidden model's GEMMs, or an 8-way shard of an 8k one, are slower
    per FLOP than the 8k model's at tp 2 (the issue's two named effects)."""
    curve = GemmCurve.of(DEVICES["h100_80gb"])
    assert curve.knee > 0

    def rate(h: int, tp: int) -> float:
        config = ModelConfig(arch="gpt", num_layers=1, hidden_size=h, num_heads=h // 128, ffn_hidden_size=4 * h,
                             vocab_size=1000, max_seq_len=4096)
        flops = layer_forward_flops(config, 1, 4096).matmul / tp
        return flops / matmul_seconds(config, curve, tp=tp, micro_batch_size=1, seq_len=4096)

    assert rate(2048, 1) < rate(8192, 2)
    assert rate(8192, 8) < rate(8192, 2)


def _causal_blocks_brute_force(seq_len: int, block: int) -> float:
    """Fraction of the (block x block) tiles of an s x s score matrix that hold at least one unmasked
    (key <= query) entry: the tiles a causal block-skipping kernel must compute."""
    n = -(-seq_len // block)
    kept = 0
    for qi in range(n):
        last_query = min(seq_len, (qi + 1) * block) - 1
        for ki in range(n):
            kept += ki * block <= last_query  # the tile's first key is visible to its last query
    return kept / (n * n)


@pytest.mark.parametrize("seq_len", [64, 128, 300, 2048, 4096, 8192])
def test_causal_work_fraction_counts_the_unmasked_tiles(seq_len):
    from parallel3d.planning.gemm import FLASH_BLOCK, causal_work_fraction
    assert causal_work_fraction(seq_len) == pytest.approx(_causal_blocks_brute_force(seq_len, FLASH_BLOCK))


def test_causal_flash_attention_time_is_about_half_the_full_product_at_long_sequences():
    from parallel3d.planning.gemm import attention_seconds
    config = _configs()[0]
    curve = GemmCurve(peak_flops=1e15, max_efficiency=0.7, knee=200.0)
    for seq, lo, hi in ((131072, 0.5, 0.501), (8192, 0.5, 0.51), (2048, 0.53, 0.532)):
        full = attention_seconds(config, curve, 1e12, seq_len=seq)
        causal = attention_seconds(config, curve, 1e12, seq_len=seq, causal_skip=True)
        assert lo <= causal / full <= hi, (seq, causal / full)


def test_unfused_attention_prices_the_whole_product_and_fused_the_causal_part():
    """At 128k tokens the full-product attention time alone exceeds the rest of a layer, so a layer
    whose fused (causal) kernel skips half of it runs in less than that full-product time; the
    unfused path computes all of it (and moves the scores), so its layer takes longer."""
    from parallel3d.planning.cluster import ClusterSpec
    from parallel3d.planning.comm_cost import CommModel
    from parallel3d.planning.cost import CostOptions, layer_forward_flops, layer_times
    from parallel3d.planning.gemm import attention_seconds
    from parallel3d.planning.layout import Layout
    config = ModelConfig(arch="llama", num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=8,
                         ffn_hidden_size=4096, vocab_size=1000, max_seq_len=131072)
    cluster = ClusterSpec.build(8, 8, "h100_80gb")
    layout = Layout(tp=8, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, seq_len=131072)
    comm = CommModel(cluster, layout.topology)
    curve = GemmCurve.of(cluster.device)
    full_att = attention_seconds(config, curve, layer_forward_flops(config, 1, 131072).attention / 8, seq_len=131072)
    fused = layer_times(config, layout, cluster, comm, CostOptions())
    unfused = layer_times(config, layout, cluster, comm, CostOptions(fused_attention=False))
    assert fused.fwd < full_att < unfused.fwd
    assert unfused.fwd - fused.fwd >= 0.49 * full_att
