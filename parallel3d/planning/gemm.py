"""Achieved matmul throughput as a function of each GEMM's per-rank shape.

A GEMM of ``m x k`` by ``k x n`` does ``2 m n k`` FLOPs and moves at least ``2 (m k + k n + m n)``
bytes; its arithmetic intensity is proportional to the *shape size*

    x = m n k / (m k + k n + m n) = 1 / (1/m + 1/n + 1/k),

which is symmetric in m, n, k (so the backward's dgrad and wgrad GEMMs, the same three dims
permuted, run at the forward's rate) and is dominated by the smallest dim: a thin tensor-parallel
shard (k = h/tp), a small hidden size, or attention's head dimension all pull it down. The
achieved fraction of peak is the roofline-shaped saturating curve

    efficiency(m, n, k) = matmul_efficiency * x / (x + gemm_knee),

``matmul_efficiency`` being what the largest GEMMs reach and ``gemm_knee`` the shape size at which
half of it is left (both per device, in its YAML; calibrated on the ``calibration`` rows of
``published_runs.yaml`` only). ``gemm_knee = 0`` is the old constant efficiency.

The per-rank dims of every matmul come from the model-shape module (``models.shape``): a
column-parallel weight's output and a row-parallel weight's input are split over tp, routed
experts over etp (each expert sees ``tokens / tp * etp * top_k / num_experts * ep`` rows: the expert
grid's ranks hold ``1 / tp`` of the tokens each, gathered over ep and etp), and the rows are
the micro-batch's tokens on this rank (``mbs * seq / cp``). Attention is two batched GEMMs per
head (QK^T contracting over the score dim, PV over the keys); a device with an
``attention_efficiency`` prices fused (flash) attention at that flat fraction of peak instead
(``GemmCurve.fused_attention_of``).

Invariant: only the *rate* depends on shapes; the FLOPs charged are exactly ``models.shape``'s,
so MFU accounting is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from models.config import ModelConfig
from models.shape import LayerShape, ParamShape


@dataclass(frozen=True)
class GemmCurve:
    """``efficiency(m, n, k)`` of one device (module docstring)."""

    peak_flops: float
    max_efficiency: float
    knee: float  # shape size x where the efficiency is half of ``max_efficiency``; 0: constant

    @classmethod
    def of(cls, device) -> "GemmCurve":
        return cls(device.peak_flops, device.matmul_efficiency, device.gemm_knee)

    @classmethod
    def fused_attention_of(cls, device) -> "GemmCurve":
        """The device's fused (flash) attention kernels. With ``attention_efficiency`` set, one flat
        fraction of peak: such a kernel works on fixed query x key tiles held on chip whatever the
        head count or length, so the per-head GEMM shape says nothing of its rate. Without it, the
        per-head GEMMs on the device's GEMM curve (the older, shape-based pricing)."""
        if device.attention_efficiency is None:
            return cls.of(device)
        return cls(device.peak_flops, device.attention_efficiency, 0.0)

    def efficiency(self, m: float, n: float, k: float) -> float:
        if self.knee <= 0:
            return self.max_efficiency
        x = 1.0 / (1.0 / m + 1.0 / n + 1.0 / k)
        return self.max_efficiency * x / (x + self.knee)

    def seconds(self, flops: float, m: float, n: float, k: float) -> float:
        """Time of ``flops`` FLOPs of GEMMs shaped ``m x k @ k x n``."""
        return flops / (self.peak_flops * self.efficiency(m, n, k))


def _expert_local(t: ParamShape, hidden: int, etp: int) -> tuple[int, int]:
    """(out, in) of a routed expert's weight on one etp rank: its ffn side is split over etp."""
    out, inp = t.shape
    return (out // etp, inp) if inp == hidden else (out, inp // etp)


def _layer_gemms(layer: LayerShape, hidden: int, tp: int, etp: int, ep: int, tokens: float,
                 split_qkv: bool = False) -> list[tuple[float, float, float, float]]:
    """(FLOPs per token over the tp group, m, n, k) of each distinct matmul of ``layer`` on one rank,
    in forward order; ``split_qkv``: a fused q/k/v projection as the three matmuls separate wq, wk, wv
    run (its FLOPs and output dim split in proportion to q, k and v's widths).

    Every routed expert of a layer has the same shape, so expert 0 stands for all of them."""
    out = []
    for t in layer.tensors:
        if not t.matmul or (t.expert is not None and t.expert != 0):
            continue
        share = 2.0 * t.numel * t.active
        if t.expert is not None:
            n, k = _expert_local(t, hidden, etp)
            share *= layer.block.moe.num_experts
            # The expert grid's ranks hold different tokens (tokens / tp each); an expert's ep ranks
            # send it their rows and its etp ranks all-gather them (``parallel3d.moe``).
            rows = max(1.0, tokens / tp * etp * t.active * ep)
        else:
            n, k = t.local_shape(tp) if len(t.shape) == 2 else (t.shape[0], 1)
            rows = tokens
        if split_qkv and t.name.endswith("qkv.weight"):
            a = layer.block.attention
            q, kv = a.num_heads * a.score_dim, a.num_kv_heads * a.score_dim
            out += [(share * w / (q + 2 * kv), rows, n * w / (q + 2 * kv), k) for w in (q, kv, kv)]
        else:
            out.append((share, rows, n, k))
    return out


def _layers_matmuls(config: ModelConfig, *, tp: int, cp: int, ep: int, etp: int | None, micro_batch_size: int,
                    seq_len: int, split_qkv: bool = False
                    ) -> Iterator[tuple[object, float, list[tuple[float, float, float, float]]]]:
    """(block, tokens on this rank, ``_layer_gemms``) of every layer of the model, in order: the one
    walk over a layer's matmuls that ``matmul_seconds`` and ``alternate_matmul_seconds`` share. Layers
    built from one BlockSpec have the same GEMMs, so each block's list is built once."""
    tokens = micro_batch_size * seq_len / cp
    etp = tp if etp is None else etp
    by_block: dict[object, list[tuple[float, float, float, float]]] = {}
    for layer in config.shape.layers:
        if layer.block not in by_block:
            by_block[layer.block] = _layer_gemms(layer, config.hidden_size, tp, etp, ep, tokens, split_qkv)
        yield layer.block, tokens, by_block[layer.block]


def matmul_seconds(config: ModelConfig, curve: GemmCurve, *, tp: int, cp: int = 1, ep: int = 1,
                   etp: int | None = None, micro_batch_size: int, seq_len: int) -> float:
    """Forward time of the weight matmuls of one microbatch on one rank, mean over the layers."""
    by_block: dict[object, float] = {}
    total, layers = 0.0, 0
    for block, tokens, gemms in _layers_matmuls(config, tp=tp, cp=cp, ep=ep, etp=etp,
                                                micro_batch_size=micro_batch_size, seq_len=seq_len):
        if block not in by_block:
            by_block[block] = sum(curve.seconds(share * tokens / tp, m, n, k) for share, m, n, k in gemms)
        total, layers = total + by_block[block], layers + 1
    return total / layers


def tp_split_gemms(config: ModelConfig, curve: GemmCurve, *, tp: int, cp: int = 1, micro_batch_size: int,
                   seq_len: int, chunks: tuple[int, int] = (1, 1)) -> list[tuple[float, list[tuple[int, float]]]]:
    """(share of the layers, [(split dim, forward seconds)]) per distinct block: the dense tp-split matmuls
    of one microbatch on one rank in forward order, split dim 0 column-parallel (its input all-gathered
    under sequence parallelism), 1 row-parallel (its output reduce-scattered). Each GEMM runs as
    ``chunks[split dim]`` GEMMs over equal slices of its token rows, one after another, each priced at
    its own (thinner) shape, as a comm-GEMM overlap splits it. Routed experts are left out (their
    tokens travel over ep)."""
    tokens = micro_batch_size * seq_len / cp
    by_block: dict[object, list[tuple[int, float]]] = {}
    counts: dict[object, int] = {}
    for layer in config.shape.layers:
        counts[layer.block] = counts.get(layer.block, 0) + 1
        if layer.block in by_block:
            continue
        gemms = []
        for t in layer.tensors:
            if not t.matmul or t.expert is not None or t.split_dim not in (0, 1) or len(t.shape) != 2:
                continue
            n, k = t.local_shape(tp)
            rows = tokens / chunks[t.split_dim]
            flops = 2.0 * t.numel * t.active * rows / tp
            gemms.append((t.split_dim, chunks[t.split_dim] * curve.seconds(flops, rows, n, k)))
        by_block[layer.block] = gemms
    total = sum(counts.values())
    return [(counts[b] / total, g) for b, g in by_block.items()]


def alternate_matmul_seconds(config: ModelConfig, curve: GemmCurve, *, tp: int, cp: int = 1, ep: int = 1,
                             etp: int | None = None, micro_batch_size: int, seq_len: int) -> float:
    """Forward time of every second weight matmul of each layer (its 2nd, 4th, ... in forward order),
    mean over the layers, the attention's q, k and v projections counted as three matmuls as
    separate wq, wk, wv run them: what per-op selective checkpointing that saves every compute op's
    output except every second matmul (torchtitan's ``selective_ac_option: op``) recomputes."""
    total, layers = 0.0, 0
    for _, tokens, gemms in _layers_matmuls(config, tp=tp, cp=cp, ep=ep, etp=etp, micro_batch_size=micro_batch_size,
                                            seq_len=seq_len, split_qkv=True):
        total += sum(curve.seconds(share * tokens / tp, m, n, k) for share, m, n, k in gemms[1::2])
        layers += 1
    return total / layers


def attention_seconds(config: ModelConfig, curve: GemmCurve, flops: float, *, cp: int = 1,
                      seq_len: int, causal_skip: bool = False) -> float:
    """Time of ``flops`` attention-score FLOPs (QK^T and PV over the full ``s x s`` product, this
    rank's share) over this rank's ``seq / cp`` queries at the rate of per-head GEMMs whose score and
    value dims (of layer 0) are their thin side; fused (flash) kernels too, which the calibration
    rows prefer over a sequence-sized shape. ``causal_skip``: a causal flash kernel that skips the
    masked blocks does only ``causal_work_fraction`` of those FLOPs (an unfused softmax path
    computes the full product and masks it). Only the time changes; the FLOPs counted do not."""
    a = config.shape.layers[0].block.attention
    rows = seq_len / cp
    qk = curve.efficiency(rows, rows, a.score_dim)
    pv = curve.efficiency(rows, a.value_dim, rows)
    # FLOPs split between the two products in proportion to their contracted dims.
    w = a.score_dim / (a.score_dim + a.value_dim)
    done = causal_work_fraction(seq_len) if causal_skip else 1.0
    return done * flops / curve.peak_flops * (w / qk + (1 - w) / pv)


# A flash kernel's backward recomputes the scores S = QK^T from the saved softmax statistics before
# it forms dP, dS, dQ and dK (FlashAttention, Dao et al. 2022, algorithm 4): 5 GEMMs of the
# forward's size against the forward's 2, so 2.5 forwards where a kernel that stored S needs 2.
FLASH_BACKWARD_FACTOR = 2.5

# Query/key block edge of flash-style kernels (FlashAttention-2/3, cuDNN): a causal kernel skips
# the key blocks wholly above the diagonal and computes the diagonal blocks in full.
FLASH_BLOCK = 128


def causal_work_fraction(seq_len: int, block: int = FLASH_BLOCK) -> float:
    """Fraction of the full ``s x s`` score product a causal block-skipping kernel computes:
    of ``n = ceil(s / block)`` query blocks, block i visits i + 1 key blocks, so
    ``n (n + 1) / 2`` of ``n^2`` blocks, i.e. ``(n + 1) / (2 n)`` (1 for one block, -> 1/2 long).
    Load-balanced context parallelism splits the same blocks over its ranks, so the fraction holds
    per rank too."""
    n = max(1, -(-seq_len // block))
    return (n + 1) / (2 * n)


def head_seconds(curve: GemmCurve, flops: float, *, tokens: float, vocab_per_rank: int, hidden: int) -> float:
    """The logits matmul (``tokens x hidden @ hidden x vocab / tp``) of one rank."""
    return curve.seconds(flops, tokens, vocab_per_rank, hidden)


__all__ = ["FLASH_BACKWARD_FACTOR", "FLASH_BLOCK", "GemmCurve", "alternate_matmul_seconds", "attention_seconds",
           "causal_work_fraction", "head_seconds",
           "matmul_seconds"]
