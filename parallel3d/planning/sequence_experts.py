"""What context parallelism and experts add to one rank's activations and step workspace.

Context parallelism (``parallel3d.context_parallel``) gives each of the cp ranks ``seq_len / cp``
tokens, so every per-token activation falls by cp. What each ``cp_comm`` variant holds beyond that:

- ``p2p`` (ring): keeps only its own K/V between forward and backward; while a layer runs, at most
  two received K/V blocks are in flight (``ring.py`` double-buffers), and in backward the travelling
  dK/dV (compute dtype, fp32) as well.
- ``allgather``: the gathered K/V of all cp ranks while a layer's attention runs (re-gathered in
  backward, with a gathered dK/dV buffer in the compute dtype; gloo also keeps its own flat gathered
  copy and the packed send buffer until the work is released).
- ``a2a`` (Ulysses): attention keeps the head-sharded full-sequence q/k/v (kv heads repeated when cp
  exceeds them) and its head-layout output; the all-to-all's send and receive buffers are in flight.
- ``a2a+p2p``: both, the ring running on the head-sharded tensors of its a2a group.

In-flight buffers live one layer at a time, so they are workspace (counted once), not activations.
Experts (``parallel3d.moe``): every token is dispatched ``top_k`` times; the expert FFN keeps the
permuted rows of its etp group (``etp`` times its own), their SwiGLU tensors (width ``ffn / etp``) and its
own output rows for the weighted combine; the fp32 router keeps its logits and probabilities (and, for
16-bit activations, the fp32 copies of its input and weight). The combine's backward, the first op of a MoE
layer's backward, allocates row-sized tensors beside all of those (``moe_combine_backward_bytes``).
Expert parallelism moves rows between ranks but, dropless and balanced, leaves ``tokens * top_k``
rows per rank: ep shrinks expert *states*, not these.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.spec import BlockSpec
from parallel3d.context_parallel.ulysses import kv_repeats as ulysses_kv_repeats
from parallel3d.planning.layout import Layout

COMPUTE_BYTES = 4  # the fp32 compute dtype of CP's blockwise attention accumulators and dK/dV
RING_BUFFERS = 2  # K/V blocks a ring rank has in flight (double buffering)


def local_seq_len(layout: Layout) -> int:
    """Tokens of one sequence on one cp rank."""
    return layout.seq_len // layout.cp


def a2a_size(layout: Layout) -> int:
    """Ranks of the all-to-all of the a2a variants (1: none)."""
    if layout.cp == 1 or layout.cp_comm not in ("a2a", "a2a+p2p"):
        return 1
    return layout.cp if layout.cp_comm == "a2a" else int(layout.cp_a2a_size or 1)


def kv_repeats(config: ModelConfig, layout: Layout) -> int:
    """How often a2a repeats each kv head (1 otherwise): GQA heads fewer than the a2a group."""
    n = a2a_size(layout)
    if n == 1:
        return 1
    return ulysses_kv_repeats(config.num_heads // layout.tp, config.kv_heads // layout.tp, n)


def attention_block_tokens(layout: Layout) -> int:
    """Query (and key) tokens of the largest block a cp rank's attention computes: a load-balanced chunk
    ``seq / (2 cp)`` times the a2a group size (the shares an all-to-all brings together are reordered
    into runs of ``a`` chunks; one run of the whole sequence when ``a = cp``)."""
    n_a2a = a2a_size(layout)
    chunks = 2 * n_a2a if n_a2a == layout.cp else n_a2a
    return layout.seq_len // (2 * layout.cp) * chunks


def cp_backward_workspace_bytes(config: ModelConfig, layout: Layout, element_bytes: int,
                                reference_kernels: bool = False) -> float:
    """Bytes the blockwise attention backward allocates beyond the K/V traffic (every ``cp_comm``).

    The fp32 ``dq`` accumulator and ``delta`` of the rank's queries (in the head layout after an
    all-to-all), and one block's backward: with ``reference_kernels`` (torch's CPU flash attention)
    contiguous copies of ``dout`` and ``out``, K/V repeated to every query head, the kernel's dq/dk/dv
    and the GQA head sums of dk/dv; the Triton kernel only its dq/dk/dv. While a block runs, the
    previous block's dq/dk/dv are still referenced (``blockwise.attend_backward``), where a call has
    more than one block (not the single whole-sequence run of ``a2a``).
    """
    if layout.cp == 1:
        return 0.0
    block = config.spec.blocks[0]
    n_a2a = a2a_size(layout)
    q_width = block.attention.q_size / layout.tp / n_a2a  # elements per token, this rank's heads
    kv_width = block.attention.kv_size * kv_repeats(config, layout) / layout.tp / n_a2a
    tokens = local_seq_len(layout) * n_a2a * layout.micro_batch_size
    heads = block.attention.num_heads / layout.tp / n_a2a
    accumulators = COMPUTE_BYTES * tokens * (q_width + heads)  # dq and delta
    t = attention_block_tokens(layout) * layout.micro_batch_size
    results = COMPUTE_BYTES * t * (q_width + 2 * kv_width)  # one block's dq, dk, dv (compute dtype)
    current = results
    if reference_kernels:  # dout/out copies, repeated k/v, the kernel's outputs (then summed to kv heads)
        current = element_bytes * t * (2 * q_width + 2 * q_width + 3 * q_width) + COMPUTE_BYTES * t * 2 * kv_width
    previous = results if attention_block_tokens(layout) < local_seq_len(layout) * n_a2a else 0.0
    return accumulators + current + previous


def cp_inflight_kv_bytes(config: ModelConfig, layout: Layout, element_bytes: int, *,
                         reference_kernels: bool = False, gather_staging_copies: int = 0) -> float:
    """Peak bytes a cp rank allocates inside one layer's attention backward (module doc): the K/V and
    dK/dV buffers in flight for its ``cp_comm``, plus ``cp_backward_workspace_bytes``.

    ``gather_staging_copies``: whole gathered copies the collective backend allocates itself (gloo's
    all-gather gathers into a flat tensor of its own and keeps it until the work is released; NCCL
    none)."""
    if layout.cp == 1:
        return 0.0
    block = config.spec.blocks[0]
    tokens = local_seq_len(layout) * layout.micro_batch_size
    kv = 2 * block.attention.kv_size * kv_repeats(config, layout) / layout.tp * tokens  # k and v elements
    q = block.attention.q_size / layout.tp * tokens
    n_a2a = a2a_size(layout)
    ring = layout.cp // n_a2a if layout.cp_comm in ("p2p", "a2a", "a2a+p2p") else 0
    total = 0.0
    if n_a2a > 1:  # send + receive buffers of the packed q/k/v all-to-all
        total += 2 * element_bytes * (q + kv)
    if ring > 1:
        # backward (the larger phase): min(n-1, 2) K/V receive buffers, and three fp32 dK/dV sets (two
        # partial-gradient buffers, one arriving), as ring.py allocates them
        total += min(ring - 1, RING_BUFFERS) * kv * element_bytes + 3 * kv * COMPUTE_BYTES
    elif ring == 1:  # a ring of one (a2a): its single fp32 dK/dV set
        total += kv * COMPUTE_BYTES
    if layout.cp_comm == "allgather":
        # the gathered K/V (re-gathered in backward), the backend's own gathered copies, this rank's
        # packed send buffer, and the fp32 dK/dV of every member's share awaiting the reduce-scatter
        total += layout.cp * kv * element_bytes * (1 + gather_staging_copies) + kv * element_bytes
        total += layout.cp * kv * COMPUTE_BYTES
    return total + cp_backward_workspace_bytes(config, layout, element_bytes, reference_kernels)


def moe_layer_activation_bytes(block: BlockSpec, layout: Layout, element_bytes: int, swiglu_tensors: int) -> float:
    """Bytes one MoE layer's MLP keeps for backward on one rank (module doc), for one microbatch."""
    moe = block.moe
    tokens = local_seq_len(layout) * layout.micro_batch_size
    if layout.sequence_parallel:
        tokens /= layout.tp
    h, rows = block.hidden_size, tokens * moe.top_k
    etp = layout.etp or layout.tp
    router = 2 * COMPUTE_BYTES * tokens * moe.num_experts  # fp32 logits and probabilities
    if element_bytes != COMPUTE_BYTES:  # its linear runs in fp32: it keeps fp32 copies of its input and weight
        router += COMPUTE_BYTES * h * (tokens + moe.num_experts)
    # An expert rank computes the rows of its whole etp group (every rank of it holds different tokens), at
    # 1/etp of the width: it keeps their gathered input and SwiGLU tensors; the combine keeps this rank's
    # rows of the output (reduce-scattered back).
    experts = element_bytes * rows * (etp * h + swiglu_tensors * moe.ffn_hidden + h)
    combine = COMPUTE_BYTES * rows  # the top-k weights the combine multiplies by
    shared = 0.0
    if moe.num_shared_experts:
        # split over tp like the dense MLP: every token of the sequence (gathered under sequence
        # parallel), 1/tp of the width
        whole = local_seq_len(layout) * layout.micro_batch_size
        shared = element_bytes * whole * swiglu_tensors * moe.num_shared_experts * moe.shared_width / layout.tp
    return router + experts + combine + shared


def moe_combine_backward_bytes(block: BlockSpec, layout: Layout, element_bytes: int) -> float:
    """Bytes alive on one rank at the weighted combine's backward (``moe.permutation``), the first op of
    a MoE layer's backward, beyond its kept activations: the gradient arriving at the layer's output
    (and its fp32 copy when the activations are 16-bit), the rows' gradient, and for the routing
    weights' gradient the fp32 gathered expert outputs and their product with the gradient (summed
    over hidden after both exist). Measured: the allocator peak of deepseek_tiny's first stage
    (tests/test_planning_layers.py)."""
    tokens = local_seq_len(layout) * layout.micro_batch_size
    if layout.sequence_parallel:
        tokens /= layout.tp
    h, rows = block.hidden_size, tokens * block.moe.top_k
    arriving = element_bytes * tokens * h + (COMPUTE_BYTES * tokens * h if element_bytes != COMPUTE_BYTES else 0)
    return arriving + element_bytes * rows * h + 2 * COMPUTE_BYTES * rows * h
