"""One training step of a rank's schedule, run on meta tensors over the fake backend.

``run_step`` does what ``Trainer`` does for step 1 (``zero_grad``, the MoE layers' ``before_step``,
``PipelineEngine.run_step`` over meta microbatches of the config's shape, ``MoEStep.finish``,
``ZeroOptimizer.step``, ``finish_param_sync``),
so a shape mismatch between chunks, a p2p message of the wrong shape, a ZeRO buffer or bucket
fault, or an optimizer step that does not fit the layout raises here as it would at step 1.
Receives from the ranks not simulated complete at once on the fake backend and leave their
meta buffers of the pipeline's message shape; data reads are answered by ``MetaValues``;
attention saves what a fused kernel saves (``fused_attention_on_meta``; context parallelism's blocks only
their shapes, ``block_attention_on_meta``), and where the job runs the fused
kernels (``meta_kernels.job_runs_fused_kernels``: any backend but torch, off ``train.device=cpu``) so do
the norms, SwiGLU and rotary (``fused_kernels_on_meta``); MoE layers route as if
balanced (``meta_routing``: their token counts are data, so the all-to-all sizes are an assumption).

Measured from the step itself: the peak activation bytes (the engine's saved-tensor count,
``StepResult.peak_activation_bytes``, on meta storages) and every message through ``comm``
(``CommStats``: calls and bytes per (group kind, op), ``comm``'s byte convention).

Fewer microbatches (``reduced_microbatches``): every microbatch runs the same code on the same
shapes, so a step's messages are ``a + b m`` in the microbatch count ``m`` once the stage's
schedule has the same warm-up (the same most-loaded moments: microbatches in flight per chunk, as
chunks may save different bytes per microbatch). The step runs at
``m1`` and ``m2 > m1`` microbatches (the two smallest counts with the full step's in-flight profile) and is
extrapolated linearly to ``m``; the activation peak is the ``m1`` step's, which holds the same
number of microbatches in flight as the full step, with the step's microbatch tensors at ``m``
(``StepMeasure.peak_at``: the engine counts all of them, once, for the whole step). ``m <= m2``: the full step runs once. Where the two
steps' messages are not linear (``NotLinear``: ZeRO-3's reduce-scatters on a ZB-V stage follow the order
of its W actions, not the count) the caller runs the full step instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch

from parallel3d.config import ResolvedJob
from parallel3d.data.batches import split_step
from parallel3d.dryrun.meta_attention import block_attention_on_meta, fused_attention_on_meta
from parallel3d.dryrun.meta_kernels import fused_kernels_on_meta, job_runs_fused_kernels
from parallel3d.dryrun.meta_routing import balanced_routing_on_meta
from parallel3d.dryrun.meta_values import MetaValues
from parallel3d.moe_step import MoEStep
from parallel3d.pipeline.actions import splits_backward
from parallel3d.pipeline.activation_bytes import held_bytes
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.microbatch import DOCUMENT_IDS, TOKEN_KEYS, ids_share_step_buffer, key_shape, with_documents
from parallel3d.pipeline.schedules import build_schedule
from parallel3d.planning.activations import action_in_flight_moments
from parallel3d.planning.cli import job_w_lags
from parallel3d.planning.split_memory import split_moments
from parallel3d.zero.precision import precision_dtype

__all__ = ["NotLinear", "StepMeasure", "batch_on_host", "in_flight_profile", "meta_batch", "microbatch_shape",
           "reduced_microbatches", "run_step"]

Counts = dict[tuple[str, str], tuple[int, int]]  # (group kind, op) -> (calls, bytes)


@dataclass(frozen=True)
class StepMeasure:
    """What one step of ``microbatches`` microbatches did on this rank."""

    microbatches: int
    peak_activation_bytes: int
    messages: Counts
    microbatch_bytes: int  # one microbatch's tensors (every one alike), in the peak once per microbatch of the step

    def peak_at(self, m: int) -> int:
        """The activation peak of the step at ``m`` microbatches with this step's in-flight profile: the engine
        counts the step's microbatch tensors once each, for the whole step (``pipeline.step_run``), and the
        rest of the peak is the in-flight microbatches', the same at either count."""
        return self.peak_activation_bytes + (m - self.microbatches) * self.microbatch_bytes


def in_flight_profile(name: str, pp: int, m: int, v: int, stage: int,
                      split_drain: bool = False, w_lags: Sequence[int] | None = None) -> frozenset[tuple[int, ...]]:
    """The stage's most-loaded moments, microbatches in flight per chunk
    (``planning.activations.chunk_in_flight_moments``, which the memory estimate uses too, on this
    one built action list: the engine's, with its ``w_lags``), and where
    backwards are split, per chunk those whose ``B`` and whose ``W`` is pending (``split_memory.split_moments``:
    the two hold different bytes, so equal totals in flight are not the same peak). Two counts with the same
    profile have the same activation peak whatever each chunk's bytes per microbatch in either state.
    ``split_drain``: 1f1b's drain split (``parallel.split_drain``); ``w_lags``: zb_h1's, as the engine runs
    it (``job_w_lags``)."""
    actions = build_schedule(name, pp, m, v, w_lags=w_lags, split_drain=split_drain)[stage]
    moments = action_in_flight_moments(actions)
    if not splits_backward(actions):
        return moments
    split = split_moments([(a.kind, a.microbatch, a.chunk) for a in actions if a.is_compute])
    return frozenset({("in flight", *x) for x in moments} | {("split", *x) for x in split})


def reduced_microbatches(name: str, pp: int, m: int, v: int, stage: int, split_drain: bool = False,
                         w_lags: Sequence[int] | None = None) -> tuple[int, int] | None:
    """``(m1, m2)``: the two smallest valid counts below ``m`` whose schedule for ``stage`` has the
    full step's in-flight profile (``in_flight_profile``); None when none are (then run all ``m``)."""
    want = in_flight_profile(name, pp, m, v, stage, split_drain, w_lags)
    found: list[int] = []
    for k in range(1, m):
        try:
            if in_flight_profile(name, pp, k, v, stage, split_drain, w_lags) == want:
                found.append(k)
        except ValueError:  # a count the schedule does not take (e.g. interleaved: a multiple of pp)
            continue
        if len(found) == 2:
            return found[0], found[1]
    return None


def _engine(rj: ResolvedJob, chunks, pstate, optimizer, microbatches: int) -> PipelineEngine:
    """The trainer's engine (``Trainer.__init__``) for ``microbatches`` microbatches."""
    p, t = rj.job.parallel, rj.job.train
    return PipelineEngine(
        chunks, pstate, schedule=p.schedule, num_microbatches=microbatches,
        micro_batch_size=t.micro_batch_size, seq_len=t.seq_len // p.cp, hidden_size=rj.model.hidden_size,
        dtype=precision_dtype(t.precision), sequence_parallel=p.sequence_parallel, grad_sync=optimizer.grad_sync,
        w_lags=job_w_lags(rj), split_drain=rj.pipeline.splits_drain(rj.train.recompute),
    )


def microbatch_shape(rj: ResolvedJob, key: str) -> tuple[int, ...]:
    """The shape of key ``key`` of one microbatch on a rank, as the trainer hands it to the engine
    (``pipeline.microbatch.key_shape``; ``Trainer._to_device``)."""
    t = rj.job.train
    return key_shape(key, t.micro_batch_size, t.seq_len, rj.job.parallel.cp)


def batch_on_host(rj: ResolvedJob) -> bool:
    """Whether the engine gets the data path's own microbatches (``data.batches.split_step``; views of one step
    token buffer where ``ids_share_step_buffer`` says so): a job on the CPU, whose ``Trainer._to_device`` moves
    nothing. A device job gets a copy of each tensor on the device, one storage each."""
    return rj.job.train.device == "cpu"


def meta_batch(rj: ResolvedJob, keys: tuple[str, ...], microbatches: int) -> list[dict[str, torch.Tensor]]:
    """The step's microbatches on meta, laid out as the trainer hands them to the engine: on the host the data
    path's (``batch_on_host``) where its ids and labels share the step's buffer (``ids_share_step_buffer``);
    else one storage per tensor, of ``microbatch_shape``; document ids as below."""
    t = rj.job.train
    tensors = tuple(k for k in keys if k != DOCUMENT_IDS)
    if batch_on_host(rj) and ids_share_step_buffer(t.micro_batch_size, rj.job.parallel.cp):
        rows = microbatches * t.micro_batch_size
        tokens = torch.zeros((rows, t.seq_len + 1), dtype=torch.long, device="meta") \
            if any(k in TOKEN_KEYS for k in tensors) else None
        batch = split_step(tokens, torch.zeros(rows, dtype=torch.long, device="meta"), tensors, microbatches,
                           t.micro_batch_size)
    else:
        batch = [{k: torch.zeros(microbatch_shape(rj, k), dtype=torch.long, device="meta") for k in tensors}
                 for _ in range(microbatches)]
    if DOCUMENT_IDS in keys:
        # Where documents end is data: every sequence is one document here. On the host, with values, since the
        # attention's block plan reads them (``context_parallel.blocks``); one storage per microbatch, as
        # ``split_step`` (a new tensor per microbatch) and a device job's copies give them.
        for mb in batch:
            mb[DOCUMENT_IDS] = torch.zeros(microbatch_shape(rj, DOCUMENT_IDS), dtype=torch.long)
    return batch


def run_step(rj: ResolvedJob, pstate, chunks, optimizer, microbatches: int) -> StepMeasure:
    """One step of ``microbatches`` microbatches on this rank (module doc); raises what step 1 would."""
    t, p = rj.job.train, rj.job.parallel
    engine = _engine(rj, chunks, pstate, optimizer, microbatches)
    # With data.document_mask, one document per sequence (meta_batch): where documents end is data (docs/dryrun.md,
    # "Sent outputs on gloo and document ids").
    batch = meta_batch(rj, with_documents(engine.microbatch_keys, rj.data.document_mask), microbatches)
    stats = pstate.comm_stats
    stats.reset()
    moe = MoEStep(chunks, rj.model, pstate, p.sequence_parallel)
    # Dense jobs skip the MoE handling: one dispatch mode less on every meta operator.
    routing = balanced_routing_on_meta() if rj.model.moe.enabled else contextlib.nullcontext()
    # The job's kernels: fused ones save what the Triton kernels save; the CPU job's torch ops their own.
    fused = job_runs_fused_kernels(rj.model.backend, t.device)
    kernels = fused_kernels_on_meta() if fused else fused_attention_on_meta()
    with MetaValues(), kernels, routing, block_attention_on_meta():
        optimizer.zero_grad()
        moe.before_step(optimizer.loss_scale, microbatches)
        result = engine.run_step(batch, loss_scale=optimizer.loss_scale, step=0, account_activations=True)
        moe.finish()
        optimizer.step()
        optimizer.finish_param_sync()
    counts = {key: (stats.calls[key], stats.bytes[key]) for key in stats.bytes}
    stats.reset()
    assert result.peak_activation_bytes is not None  # asked for above
    # Linear in the count: one storage per tensor, or one step buffer of as many rows as microbatches x their size.
    step_tensors = held_bytes([x for mb in batch for x in mb.values()], set())
    return StepMeasure(microbatches, result.peak_activation_bytes, counts, step_tensors // microbatches)


class NotLinear(RuntimeError):
    """Two reduced steps' messages are not ``a + b m`` (module doc): they cannot be extrapolated."""


def extrapolate(a: StepMeasure, b: StepMeasure, m: int) -> Counts:
    """Messages at ``m`` microbatches from steps at ``a`` and ``b`` microbatches (linear, exact integers)."""
    out: Counts = {}
    span = b.microbatches - a.microbatches
    for key in dict.fromkeys([*a.messages, *b.messages]):
        (ca, ba), (cb, bb) = a.messages.get(key, (0, 0)), b.messages.get(key, (0, 0))
        if (cb - ca) % span or (bb - ba) % span:
            raise NotLinear(f"{key}: messages are not linear in the microbatch count "
                               f"({a.microbatches}: {ca} calls, {b.microbatches}: {cb})")
        k = m - a.microbatches
        out[key] = (ca + (cb - ca) // span * k, ba + (bb - ba) // span * k)
    return out
