"""Which global layers each pipeline chunk holds.

``partition_layers`` returns one ``(first, last_exclusive)`` layer range per model
chunk, in model order (chunk ``k`` of ``pp * v``; stage ``s`` holds chunks
``s, s + pp, ...``, see ``schedules.virtual_stage``). The first chunk also holds
the embedding, the last the final norm, the head and the loss.

Invariant: the ranges are contiguous and cover ``[0, num_layers)``; every middle chunk holds at least
one layer, while the first chunk may hold none (the embedding only) and the last none (the final norm,
the head and the loss only), as Llama 3 405B's pp=16 layout takes one layer off each end. An empty
chunk still runs: it maps token ids (or hidden states) to hidden states (or the loss), so the p2p
messages between chunks keep their shape (``topology.fewest_layers`` is the smallest model that fits).

Default split: contiguous, minimising the most expensive chunk under ``chunk_costs``'s estimate (forward FLOPs per token of each layer from
``models.shape``, where the head and the embedding count too), ties broken towards even costs. An
explicit ``pp_layers`` list overrides it.
"""

from __future__ import annotations

from typing import Sequence

from models.config import ModelConfig
from parallel3d.pipeline.placement import ChunkPlacement
from parallel3d.topology import LayoutError, fewest_layers


def layer_costs(config: ModelConfig, seq_len: int) -> list[float]:
    """Forward FLOPs per token of each global layer (``models.shape``: matmuls and causal attention)."""
    return [layer.forward_flops(seq_len, attention="causal").total for layer in config.shape.layers]


def head_flops(config: ModelConfig) -> float:
    """Forward cost per token of the output projection (``models.shape``) and the cross entropy
    (memory-bound: charged 4 per vocabulary entry, like an elementwise pass over the logits)."""
    return config.shape.head_forward_flops() + 4 * config.vocab_size


def embedding_flops(config: ModelConfig) -> float:
    """The lookup is memory-bound; charge it like an elementwise pass over the hidden state."""
    return 4 * config.hidden_size


def _chunk_cost(costs: Sequence[float], a: int, b: int, first: bool, last: bool, emb: float, head: float) -> float:
    return sum(costs[a:b]) + (emb if first else 0.0) + (head if last else 0.0)


def _balanced_split(costs: Sequence[float], chunks: int, emb: float, head: float) -> list[int]:
    """Layer counts per chunk minimising (max chunk cost, sum of squared costs); the first and the
    last chunk may get 0 layers (their embedding / head cost can be worth a whole chunk), the middle
    ones at least 1."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))

    def fewest(k: int) -> int:  # layers the first k < chunks chunks hold at least (chunk 1 may be empty)
        return max(k - 1, 0)

    # best[k][i]: best (max, sumsq) for the first i layers in k chunks; cut[k][i]: start of chunk k.
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, chunks + 1):
        may_be_empty = k == 1 or k == chunks
        # The chunks after k need fewest(chunks - k) layers too (the last of them may be empty);
        # all chunks together hold all n layers.
        ends = [n] if k == chunks else range(fewest(k), n - fewest(chunks - k) + 1)
        for i in ends:
            for j in range(fewest(k - 1), i + 1 if may_be_empty else i):
                if best[k - 1][j] == inf:
                    continue
                c = prefix[i] - prefix[j] + (emb if k == 1 else 0.0) + (head if k == chunks else 0.0)
                cand = (max(best[k - 1][j][0], c), best[k - 1][j][1] + c * c)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    counts, i = [], n
    for k in range(chunks, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def partition_layers(
    config: ModelConfig,
    num_stages: int,
    num_virtual_stages: int = 1,
    pp_layers: Sequence[int] | None = None,
    seq_len: int | None = None,
) -> list[tuple[int, int]]:
    """Layer ranges ``[(a, b), ...]`` of the ``num_stages * num_virtual_stages`` model chunks."""
    for key, value in (("parallel.pp", num_stages), ("parallel.virtual_stages", num_virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"{key}={value!r} must be an integer >= 1")
    chunks = num_stages * num_virtual_stages
    n = config.num_layers
    if n < fewest_layers(chunks):
        raise LayoutError(
            f"model.num_layers={n} is fewer than the pipeline chunks parallel.pp*virtual_stages="
            f"{num_stages}*{num_virtual_stages}={chunks} less the first and the last ({chunks - 2}); "
            f"every chunk but the first (embedding) and the last (final norm, head) needs at least one layer"
        )
    if pp_layers is not None:
        counts = list(pp_layers)
        if len(counts) != chunks:
            raise LayoutError(
                f"parallel.pp_layers={counts} has {len(counts)} entries; it needs one per pipeline chunk "
                f"(pp*virtual_stages={chunks})"
            )
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise LayoutError(f"parallel.pp_layers={counts}: every entry must be an integer >= 1 "
                              f"(>= 0 for the first and the last chunk)")
        if any(c < 1 for c in counts[1:-1]):
            raise LayoutError(
                f"parallel.pp_layers={counts}: every entry must be an integer >= 1 but the first and the last, "
                f"which may be 0 (a chunk of the embedding, or of the final norm and head, alone): a middle "
                f"chunk with no layer would only pass its input on"
            )
        if sum(counts) != n:
            raise LayoutError(
                f"parallel.pp_layers={counts} sums to {sum(counts)} but model.num_layers={n}"
            )
    else:
        seq = config.max_seq_len if seq_len is None else seq_len
        counts = _balanced_split(layer_costs(config, seq), chunks, embedding_flops(config), head_flops(config))
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def chunk_costs(config: ModelConfig, ranges: Sequence[tuple[int, int]], seq_len: int | None = None) -> list[float]:
    """Estimated forward FLOPs per token of each chunk (embedding on the first, head on the last)."""
    costs = layer_costs(config, config.max_seq_len if seq_len is None else seq_len)
    last = len(ranges) - 1
    return [
        _chunk_cost(costs, a, b, k == 0, k == last, embedding_flops(config), head_flops(config))
        for k, (a, b) in enumerate(ranges)
    ]


def stage_layer_ranges(ranges: Sequence[tuple[int, int]], num_stages: int, stage: int,
                       placement: ChunkPlacement | None = None) -> list[tuple[int, int]]:
    """The ranges held by ``stage``, by local chunk: model chunks ``placement.chunks_of(stage)`` (default:
    the loop placement, chunks stage + c*num_stages)."""
    place = placement or ChunkPlacement(num_stages, len(ranges) // num_stages)
    return [ranges[k] for k in place.chunks_of(stage)]
