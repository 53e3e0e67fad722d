"""Peak activation bytes of a stage whose backwards are split into ``B`` and ``W`` (zb_h1, zbv, the split
drain of 1f1b and interleaved 1F1B, any schedule whose action list has ``W``s), read off the action list the engine runs.

Invariant: a (microbatch, chunk) holds, from its ``F`` to its ``B``, what its forward saved (``held``: the
layers' bytes under the layout's recompute, the embedding's on the model's first chunk, the head's on its
last, its output while kept); from its ``B`` to its ``W``, what the deferred weight GEMMs read
(``waiting``: each deferring linear's input and output gradient, ``deferred_grads``; recomputed inputs
under full recompute, so much more than the checkpoint), except on the model's first chunk, whose ``B`` has
no input gradient to send and keeps the whole graph until ``W`` (``step_run.StepRun.backward``). The engine
records its peak after every ``F`` and every ``B``; so does ``split_peak_bytes``, counting each chunk's
microbatches on the stage's own actions, a backward split where its ``W`` is listed (no schedule logic restated).
A sent output is held until its send is released: on NCCL (and for one chunk a stage) at the next forward but its
own; on gloo with more chunks once a receive of its batch was waited, read off the stage's batches
(``pipeline.sent_release`` on ``actions.comm_plan``'s plan, as the engine posts it).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterator, Sequence

from models.config import ModelConfig
from parallel3d.pipeline.actions import default_prefetch
from parallel3d.pipeline.schedules import stage_compute_order
from parallel3d.pipeline.sent_release import released_sends
from parallel3d.planning.activations import (
    ActivationAssumptions,
    _block,
    chunk_output_bytes,
    embedding_activation_bytes,
    head_activation_bytes,
    received_input_bytes,
)
from parallel3d.planning.layout import Layout
from parallel3d.planning.schedule_cache import ScheduleCache
from parallel3d.planning.sequence_experts import local_seq_len
from parallel3d.planning.zb_lags import head_weight_grad_input_bytes, zb_h1_w_lags

__all__ = ["layer_weight_grad_bytes", "split_moments", "split_peak_bytes", "stage_computations"]


def _moments(actions: Sequence[tuple[str, int, int]]) -> Iterator[tuple[list[tuple[int, int]], int | None]]:
    """After each ``F`` and ``B`` of ``actions`` (``(kind, microbatch, local chunk)``, one stage's order; where
    the engine records its peak): per local chunk, (microbatches whose ``B`` is pending, whose ``W`` is), and
    the local chunk of the newest ``F`` while its ``B`` is pending (else None: its output is gone or was never
    this stage's to send). A backward is split where its ``W`` is in the list (``actions.split_backwards``'
    rule: the split drain splits only some), else its ``B`` frees all it held."""
    split = {(mb, c) for kind, mb, c in actions if kind == "W"}
    chunks = sorted({c for _, _, c in actions})
    pending = {c: [0, 0] for c in chunks}
    newest: tuple[int, int] | None = None
    for kind, mb, chunk in actions:
        counts = pending[chunk]
        if kind == "F":
            counts[0] += 1
            newest = (mb, chunk)
        elif kind == "B":
            counts[0] -= 1
            counts[1] += (mb, chunk) in split
            if newest == (mb, chunk):
                newest = None
        else:
            counts[1] -= 1
        if kind != "W":
            yield [(pending[c][0], pending[c][1]) for c in chunks], None if newest is None else newest[1]


def _held_sent(actions: Sequence[tuple[str, int, int]], sends: Sequence[bool | None],
               releases: Sequence[Sequence[tuple[int, int]]]) -> Iterator[int]:
    """After each ``F`` and ``B`` of ``actions`` (as ``_moments`` yields): the outputs held that go by message,
    those of sending chunks (``sends``) whose ``B`` is pending and whose send is not released yet (``releases``:
    per computation, the keys the engine releases after it, ``sent_release.released_sends``)."""
    held: set[tuple[int, int]] = set()
    for (kind, mb, c), released in zip(actions, releases, strict=True):
        if kind == "F" and sends[c]:
            held.add((mb, c))
        elif kind == "B":
            held.discard((mb, c))
        held.difference_update(released)
        if kind != "W":
            yield len(held)


def _gloo_releases(layout: Layout, stage: int, actions: Sequence[tuple[str, int, int]],
                   schedules: ScheduleCache | None) -> list[tuple[tuple[int, int], ...]]:
    """Per computation of ``stage``'s ``actions``, the sent outputs the engine frees after it on gloo with more
    than one chunk a stage (``sent_release``): its batches are those of the stage's built action list, messages
    included, uncoalesced, at the engine's default prefetch (``actions.default_prefetch``)."""
    built = ScheduleCache.of(schedules).build(layout.schedule, layout.pp, layout.num_microbatches,
                                              layout.virtual_stages, split_drain=layout.splits_drain)
    full = built[stage]
    if [(a.kind, a.microbatch, a.chunk) for a in full if a.is_compute] != list(actions):
        # not a ValueError: callers read that as "no estimate for this model" (rank_report), this is a bug
        raise RuntimeError(f"stage {stage}: its computations are not those of its built {layout.schedule} schedule")
    return released_sends(full, default_prefetch(False))


def split_moments(actions: Sequence[tuple[str, int, int]]) -> frozenset[tuple[int, ...]]:
    """The stage's most-loaded moments with split backwards: the maximal vectors of ``(B-pending,
    W-pending)`` per chunk after its ``F``s and ``B``s (``actions``: ``(kind, microbatch, local chunk)``).
    Its peak is at one of them whatever the bytes a chunk holds in either state (the dry run's reduced
    step must keep them: ``dryrun.step``)."""
    seen = {tuple(n for pair in moment for n in pair) for moment, _ in _moments(actions)}
    return frozenset(x for x in seen if not any(y != x and all(b >= a for a, b in zip(x, y)) for y in seen))


@lru_cache(maxsize=4096)
def _compute_order(name: str, stage: int, p: int, m: int, v: int, w_lag: int | None,
                   split_drain: bool) -> tuple[tuple[str, int, int], ...]:
    """``stage_compute_order`` with these arguments, as a tuple (shared: read only). Cached: a search asks for
    the same (schedule, stage, p, m, v) for every recompute / ZeRO setting of a layout (session 46 profile of
    the 175B search in ``tests/test_planning_published.py``: a tenth of it)."""
    return tuple(stage_compute_order(name, stage, p, m, v, w_lag, split_drain))


def stage_computations(config: ModelConfig, layout: Layout, stage: int, w_lags: Sequence[int] | None = None,
                       schedules: ScheduleCache | None = None) -> list[tuple[str, int, int]] | None:
    """``stage``'s computations ``(kind, microbatch, local chunk)`` in the order the engine runs them, or None
    where the stage splits none of its backwards. The order ``build_schedule`` lowers (``stage_compute_order``: one
    stage, no messages; zbv: its built action list), with the engine's arguments: zb_h1's lags
    (``w_lags``, else ``zb_h1_w_lags``'s) and the split drain (``Layout.splits_drain``; 1f1b's stage 0
    keeps its drain whole, so its peak is the plain estimate's). ``schedules``: the search's (``ScheduleCache``):
    zbv's stages are built together, so its stages share one build."""
    p, m, v = layout.pp, layout.num_microbatches, layout.virtual_stages
    if layout.schedule == "zbv":
        built = ScheduleCache.of(schedules).build("zbv", p, m, v)
        order = [(a.kind, a.microbatch, a.chunk) for a in built[stage] if a.is_compute]
    else:
        lag = (w_lags or zb_h1_w_lags(config, layout))[stage] if layout.schedule == "zb_h1" else None
        order = list(_compute_order(layout.schedule, stage, p, m, v, lag, layout.splits_drain))
    return order if any(kind == "W" for kind, _, _ in order) else None


def layer_weight_grad_bytes(config: ModelConfig, layout: Layout, assumptions: ActivationAssumptions,
                            layer: int) -> float:
    """What global layer ``layer``'s deferred ``W`` keeps for one microbatch on one tp rank: each
    deferring linear's input (the sequence shard under sequence parallel: ``gathered_linear`` gathers it
    again in ``W``) and its output's gradient. Whatever the recompute (``B`` rebuilt what W reads)."""
    block = _block(config, layer)
    s, b, h, t, e = local_seq_len(layout), layout.micro_batch_size, block.hidden_size, layout.tp, \
        assumptions.element_bytes
    sb = s * b
    column_input = sb * h / (t if layout.sequence_parallel else 1)  # a norm's output: QKV's, MLP's input
    # QKV's output gradient has the kv heads unrepeated (cp a2a repeats them after the projection,
    # ``context_parallel.ulysses``)
    q, kv = block.attention.q_size, block.attention.kv_size
    attention = column_input + sb * (q + 2 * kv) / t + sb * q / t + sb * h  # QKV in/grad, proj in/grad
    if block.moe is not None:  # the experts' GEMMs do not defer (computed in B); router / shared: small
        return e * attention
    f = block.mlp.ffn_size
    up_outputs = {"gelu": 1, "swiglu": 2}[block.mlp.kind]
    mlp = column_input + sb * f * up_outputs / t + sb * f / t + sb * h  # up in/grads, down in/grad
    return float(e * (attention + mlp))


def split_peak_bytes(config: ModelConfig, layout: Layout, stage: int, actions: Sequence[tuple[str, int, int]],
                     chunk_layers: Sequence[Sequence[int]], assumptions: ActivationAssumptions,
                     layers_bytes: Callable[[Sequence[int]], float],
                     schedules: ScheduleCache | None = None) -> tuple[float, int]:
    """(peak activation bytes, (microbatch, chunk)s held then) of ``stage`` running ``actions`` (its
    computations in order, ``(kind, microbatch, local chunk)``: ``stage_computations``), whose
    local chunk ``c`` holds global layers ``chunk_layers[c]``; ``layers_bytes(ids)`` is one microbatch's
    forward-saved bytes of those layers (the memory estimate's own). ``schedules``: the search's
    (``ScheduleCache``), where the gloo batches are read off the built schedule."""
    place = layout.placement
    last = place.total - 1
    held, waiting, sends = [], [], []  # sends: the chunk's output goes to another stage (else handed over here)
    for c, ids in enumerate(chunk_layers):
        k = place.model_chunk(stage, c)
        h = layers_bytes(ids)
        w = sum(layer_weight_grad_bytes(config, layout, assumptions, i) for i in ids)
        if k == 0:
            h += embedding_activation_bytes(config, layout, assumptions)
        elif place.stage_of(k - 1) != stage:  # received, not handed over (that is the previous chunk's output)
            h += received_input_bytes(config, layout, assumptions, bool(ids))
        if k == last:
            h += head_activation_bytes(config, layout, assumptions)
            w += head_weight_grad_input_bytes(config, layout, assumptions)
        held.append(h)
        waiting.append(h if k == 0 else w)  # the first chunk's B defers all of its backward
        sends.append(None if k == last else place.stage_of(k + 1) != stage)  # None: no output (the loss)
    output = chunk_output_bytes(config, layout, assumptions)
    freed = assumptions.sent_outputs_freed and (layout.virtual_stages == 1 or assumptions.sends_complete_unwaited)
    # gloo, chunks > 1: a sent output goes once a receive of its batch was waited (sent_release; fuzz case 2044)
    by_batch = assumptions.sent_outputs_freed and not freed
    held_sent = _held_sent(actions, sends, _gloo_releases(layout, stage, actions, schedules)) if by_batch else None
    peak, peak_live = 0.0, 0
    for counts, newest in _moments(actions):
        # A B-pending chunk keeps its output; a sent one goes once its send completes where the engine frees
        # them: then only the newest forward's, not sent before the moment, and only if that forward sends
        # (after the loss chunk's forward nothing waits to go: fuzz case 2064); one handed to the stage's next
        # chunk stays until its B.
        sent = sum(n for (n, _), s in zip(counts, sends) if s)
        handed = sum(n for (n, _), s in zip(counts, sends) if s is False)
        if held_sent is not None:
            unsent = next(held_sent)
        else:
            unsent = int(newest is not None and bool(sends[newest])) if freed else sent
        total = sum(n * hb + x * wb for (n, x), hb, wb in zip(counts, held, waiting)) + (unsent + handed) * output
        if total > peak:
            peak, peak_live = total, sum(n + x for n, x in counts)
    return peak, peak_live
