"""One rank's messages per training step, by group kind: count and bytes.

- ``pp``: the rank's own action list of the built schedule (``build_schedule``), each send or
  receive one message of ``MessageSpec`` (the engine's activation/gradient shape and dtype).
- ``dp_cp`` (and ``embedding`` for tied-embedding buckets): one collective per bucket of the
  optimizer's real ``BufferLayout``, sized as the bucket (the buffer that enters it):
  stage 0 all-reduces each bucket once per step; stage 1 reduce-scatters once per step and
  all-gathers the parameters after the step; stages 2-3 reduce-scatter every microbatch
  (``grad_sharded``); stage 3 all-gathers the parameters once per step with
  ``zero3_reshard=step``, else per microbatch each bucket twice (forward and backward),
  those of a chunk's root unit once (it stays whole from forward to backward: ``params_sharded``).
- ``tp``: an estimate from the layer count: 2 collectives in each layer's forward and 2 in its
  backward (all-reduces, or all-gather + reduce-scatter with sequence parallel), 2 more
  forward with ``recompute=full``, each of one full activation; the vocabulary-parallel
  embedding and loss are left out.
Bytes are what one rank hands to its collectives (sends for p2p), not wire bytes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from parallel3d.pipeline.actions import RECV_KINDS, SEND_KINDS, Action
from parallel3d.zero.buffers import BufferLayout


@dataclass(frozen=True)
class Messages:
    """Collectives (or p2p messages) and their bytes, per step, on one group kind."""

    kind: str
    count: int
    bytes: int
    how: str  # where the numbers come from: "schedule", "buffer layout", "estimate"


def pipeline_messages(actions: list[Action], message_bytes: int) -> list[Messages]:
    """The ``pp`` messages of one stage's action list (sends and receives, one message each)."""
    kinds = Counter(a.kind for a in actions)
    sends = sum(kinds[k] for k in SEND_KINDS)
    recvs = sum(kinds[k] for k in RECV_KINDS)
    if not sends + recvs:
        return []
    return [Messages("pp_send", sends, sends * message_bytes, "schedule"),
            Messages("pp_recv", recvs, recvs * message_bytes, "schedule")]


def zero_messages(layouts: list[BufferLayout], *, zero_stage: int | list[int], microbatches: int, grad_itemsize: int,
                  zero3_mode: str, embedding_group: bool,
                  root_buckets: frozenset[tuple[int, int]] = frozenset()) -> list[Messages]:
    """``dp_cp`` gradient reductions and parameter gathers, and ``embedding`` sums, of one step;
    ``zero_stage``: one stage, or each layout's (``parallel.expert_zero_stage``); ``root_buckets``:
    (layout index, bucket index) of stage 3's root units."""
    out = []
    stages = [zero_stage] * len(layouts) if isinstance(zero_stage, int) else zero_stage
    for g, layout in enumerate(layouts):
        zero_stage = stages[g]
        buckets = layout.buckets
        grad_bytes = sum(b.size for b in buckets) * grad_itemsize
        param_bytes = sum(b.size for b in buckets) * layout.dtype.itemsize
        n = len(buckets)
        if layout.replicas > 1:
            reduces = n if zero_stage < 2 else n * microbatches
            name = "all_reduce" if zero_stage == 0 else "reduce_scatter"
            out.append(Messages(f"{layout.reduce_kind} {name}", reduces, reduces // n * grad_bytes, "buffer layout"))
            if zero_stage in (1, 2) or (zero_stage == 3 and zero3_mode == "step"):
                out.append(Messages(f"{layout.reduce_kind} all_gather", n, param_bytes, "buffer layout"))
            elif zero_stage == 3:
                roots = [b for b in buckets if (g, b.index) in root_buckets]
                root_bytes = sum(b.size for b in roots) * layout.dtype.itemsize
                out.append(Messages(f"{layout.reduce_kind} all_gather", (2 * n - len(roots)) * microbatches,
                                    (2 * param_bytes - root_bytes) * microbatches, "buffer layout"))
        tied = [b for b in buckets if b.tied]
        if embedding_group and tied:
            size = sum(b.size if zero_stage < 2 else b.piece_size for b in tied) * grad_itemsize
            out.append(Messages("embedding all_reduce", len(tied), size, "buffer layout"))
    return out


def tensor_parallel_messages(tp: int, layers: int, microbatches: int, activation_bytes: int, *,
                             sequence_parallel: bool, full_recompute: bool) -> list[Messages]:
    """The ``tp`` collectives of the rank's transformer layers for one step (estimate; module doc)."""
    if tp == 1 or layers == 0:
        return []
    per_layer = 4 + (2 if full_recompute else 0)
    count = per_layer * layers * microbatches
    name = "tp all_gather+reduce_scatter" if sequence_parallel else "tp all_reduce"
    return [Messages(name, count, count * activation_bytes, "estimate")]
