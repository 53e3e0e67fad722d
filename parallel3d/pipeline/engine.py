"""Run one rank's pipeline schedule for one optimizer step.

``PipelineEngine.run_step`` walks this stage's action list from
``schedules.build_schedule``, compiled once into a plan (``step_plan``: every key,
peer, module and flag resolved ahead, the batches of ``actions.comm_plan``): it
receives activations/gradients, runs its model chunks, keeps exactly the activations
the schedule still needs (a microbatch's stored input and output live from its ``F``
to its ``B``), sends, and accumulates gradients over microbatches into ``.grad``
(callers zero them). With pp == 1 the same loop is plain gradient accumulation.
The chunks sit where the schedule's ``placement`` says (``placement``: a loop, or
ZB-V's V, whose turns hand activations and gradients over inside the stage).

Loss scale invariant: each microbatch's loss is backpropagated from the seed
``loss_scale / num_microbatches`` (the gradients of the loss times that factor, bit for bit:
``step_run``'s ``root_grad``), so after a step the grads are those of ``loss_scale`` times the
mean loss over the step's microbatches, whatever pp and m are (DP averaging is the optimizer's job).

Sent activations (Megatron's trick): once a chunk's output has been sent
downstream, only its autograd graph is needed for the backward, not its values,
unless autograd saved the output tensor itself (on a step that accounts activations,
the saved-tensor hooks' record says; on the others ``activation_bytes.output_saved``,
which answers "saved" whenever it cannot prove otherwise: both free the same outputs). With ``free_sent_activations``
the engine then swaps the output's data for a one-element placeholder (expanded
to the same shape, so ``backward`` still type-checks); the storage goes when the
send's batch has completed (``PipelineP2P.release_sent``), and from then on it is
no longer counted in ``peak_activation_bytes``. A stage then holds its in-flight
microbatches' saved tensors plus at most the newest output, not every output.
gloo says a send is done only from a blocking ``wait``, so on single-chunk
schedules (1f1b, gpipe) the engine waits, after each forward, for the batches
holding its earlier activation sends; interleaved schedules free a sent output
only once its batch is known complete: the backend reports it on its own (NCCL does),
or, on gloo, a receive of the same batch was taken (``sent_release``).

Communication follows ``actions.comm_plan``: the comm actions between two
computations form one batch; on gloo receives are also posted ``prefetch_recvs``
(default ``actions.default_prefetch``) ahead of need so their transfer overlaps compute. Where a batch
completes as one unit and a rank's batches run in FIFO order
(``pstate.p2p_coalesces``: NCCL), a receive posted ahead would stall every later
batch of the rank, sends included (that default is 0 there), and the schedule is
built for FIFO batches (``build_schedule(coalesced_p2p=True)``). The constructor
proves the resulting plan, waits included, deadlock-free under the backend's
semantics (``check_coalesced_progress``) and refuses one that is not.

Split backwards (schedules with ``W``, e.g. ``zb_h1``; ``backward_split``): ``B`` is
one backward that computes the input gradient to send upstream and the gradients
of parameters no layer defers (norms), frees the graph, and leaves the deferring
layers' weight-gradient GEMMs queued (``parallel3d.deferred_grads``); ``W`` runs
them, and their gradients reach ``.grad`` (and its hooks) then. A microbatch-chunk
holds its activations from ``F`` to ``B`` and the queue's tensors from ``B`` to
``W`` (the first model chunk, with no input gradient to send, runs its whole
backward at ``W``). ``grad_sync.prepare`` is told before ``B`` whether it is the
chunk's last ``B`` and before ``W`` whether it is its last ``W``. A stage may split only some
backwards (``1f1b`` and ``interleaved_1f1b`` with ``split_drain``: those after its last forward); each ``B``
knows whether it is split (``PlannedCompute.split``), the others run whole. ``w_lags`` (zb_h1): how far
each stage's ``W``s trail (``build_schedule``; ``planning.zb_lags.zb_h1_w_lags`` keeps every stage
within 1F1B's peak bytes); the same on every rank.

The loss lives on the stage holding the last model chunk; where that is not the last
pipeline stage (ZB-V: stage 0), it is sent there at the end of the step, so
``StepResult.loss`` is on the last stage's ranks for every schedule.

Measured per step: ``busy_time`` (computations), ``wait_time`` (blocked in p2p waits),
``finalize_time`` (the closing phase: freeing parked graphs, gradient finalisation and the loss, mostly a
wait for the slowest stage) and what is left, ``executor_time``: the executor's own work
(posting, bookkeeping), reported per action by ``scripts/bench_pipeline.py``, also as
``executor_cpu_time`` (the loop thread's CPU time outside computations), which a busy
machine's preemption does not inflate. For putting ranks on one axis (the benchmark's
bubble, ``scripts/bench_pipeline_bubble.py``): ``start_time`` (the system-wide monotonic
clock at the step's start), ``schedule_wait_time`` (p2p waits until the action loop ends)
and ``compute_cpu`` (each computation's thread CPU time).

Gradient finalisation has one owner, called once per step: at the end of
``run_step``, after the last send has completed, the engine calls
``grad_sync.finalize()`` (ZeRO's ``GradSync``: finish the DP reduction, sum tied
embeddings over the ``embedding`` group; without ZeRO,
``tied.TiedGradFinalizer`` does the tied sum alone). Cross-stage collectives are
safe there because no pipeline message is outstanding. It is not counted as busy
time.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch
import torch.distributed as dist

from parallel3d import comm
from parallel3d.deferred_grads import backward_inputs
from parallel3d.pipeline.activation_bytes import storage_key
from parallel3d.pipeline.actions import Action, ScheduleError, default_prefetch, splits_backward
from parallel3d.pipeline.microbatch import TOKEN_KEYS, stage_keys
from parallel3d.pipeline.options import PipelineOptions, drain_is_split
from parallel3d.pipeline.p2p import MessageSpec, PipelineP2P
from parallel3d.pipeline.placement import ChunkPlacement
from parallel3d.pipeline.schedules import build_schedule, check_coalesced_progress
from parallel3d.pipeline.step_plan import compile_plan
from parallel3d.pipeline.step_run import StepRun
from parallel3d.pipeline.tied import TiedGradFinalizer

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


class GradSync(Protocol):
    """What the engine asks of gradient synchronisation (ZeRO's ``GradSync``, or ``TiedGradFinalizer``)."""

    def prepare(self, is_last_microbatch: bool) -> None: ...

    def finalize(self) -> None: ...


@dataclass
class StepResult:
    """What one ``run_step`` measured on this rank.

    ``loss`` is the mean loss over the step's microbatches (unscaled) on ranks of
    the last stage, ``None`` elsewhere. Times are wall-clock seconds;
    ``bubble_fraction = 1 - busy_time / step_time``. ``peak_live_activations`` is
    the most (microbatch, chunk) pairs stored at once; ``peak_activation_bytes``
    (``None`` unless the step was asked for it: ``run_step(account_activations=True)``)
    the most bytes they held (tensors autograd saved for backward plus the stage's
    stored input and output, each storage counted once, parameters excluded; a sent
    output freed by ``free_sent_activations`` counts until its send completes; after
    a split backward's ``B``, what its weight-gradient queue holds), sampled after
    every ``F`` and, with split backwards, every ``B``.
    """

    loss: float | None
    step_time: float
    busy_time: float
    peak_live_activations: int
    peak_activation_bytes: int | None
    num_microbatches: int
    comm_time: float = 0.0  # seconds in point-to-point (posting + waiting for receives)
    timeline: list[tuple[Action, float, float]] = field(default_factory=list, repr=False)
    wait_time: float = 0.0  # seconds blocked waiting for p2p to complete
    num_actions: int = 0  # actions of this stage's schedule (computations and messages)
    # Seconds in the step's closing phase (freeing parked backward graphs, grad_sync.finalize, the loss
    # to the last stage): mostly waiting for the slowest stage, so neither the executor's work nor a p2p wait.
    finalize_time: float = 0.0
    # This thread's CPU seconds in the action loop outside computations: the executor's own work
    # measured so that a busy machine's preemption and blocking waits do not count.
    executor_cpu_time: float = 0.0
    # ``time.perf_counter()`` when the step began (a system-wide monotonic clock on Linux, so the
    # ranks' timelines, which are relative to it, can be put on one axis).
    start_time: float = 0.0
    # Seconds blocked in p2p waits until the action loop ended (``wait_time`` less the closing
    # ``wait_sends``): the waiting inside the schedule, the measured counterpart of simulate()'s idle.
    schedule_wait_time: float = 0.0
    # Per computation, in timeline order: its thread CPU seconds (its cost on a core of its own,
    # which time-sharing the cores does not inflate, unlike the wall span in ``timeline``).
    compute_cpu: list[tuple[Action, float]] = field(default_factory=list, repr=False)

    @property
    def bubble_fraction(self) -> float:
        return 0.0 if self.step_time <= 0 else max(0.0, 1.0 - self.busy_time / self.step_time)

    @property
    def executor_time(self) -> float:
        """The step's time neither computing, nor waiting for messages, nor in the closing
        collectives: the executor's own work (wall clock)."""
        return max(0.0, self.step_time - self.busy_time - self.wait_time - self.finalize_time)


def split_batch(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Cut a global-for-this-rank batch ``{input_ids, labels, sample_ids}`` into microbatches."""
    size = batch["input_ids"].shape[0]
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"train.micro_batch_size={micro_batch_size!r} must be an integer >= 1")
    if size % micro_batch_size:
        raise ValueError(
            f"train.micro_batch_size={micro_batch_size} does not divide the batch of {size} samples"
        )
    return [
        {k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, size, micro_batch_size)
    ]


def send_loss_to_last_stage(loss: float | None, placement: ChunkPlacement, pstate: "ParallelState") -> float | None:
    """The step's loss moved from the stage holding the last model chunk to the last pipeline stage.

    Collective over the pipeline's two end stages when they differ (ZB-V); otherwise ``loss``.
    Called after every pipeline message of the step has completed (FIFO order is trivially kept).
    """
    p = pstate.size("pp")
    owner = placement.stage_of(placement.total - 1)
    if owner == p - 1 or pstate.coord("pp") not in (owner, p - 1):
        return loss if pstate.coord("pp") == p - 1 else None
    value = torch.tensor([0.0 if loss is None else loss], dtype=torch.float64, device=pstate.device)
    sender = pstate.coord("pp") == owner
    peer = pstate.topology.stage_rank(pstate.rank, p - 1 if sender else owner)
    op = dist.P2POp(dist.isend if sender else dist.irecv, value, peer, group=pstate.group("pp"))
    for work in comm.batch_isend_irecv([op], pstate, "pp"):
        work.wait()
    return None if sender else value.item()


class PipelineEngine:
    """Executes this rank's part of the pipeline schedule.

    ``chunks[c]`` is local chunk ``c``: model chunk ``placement.model_chunk(pp_rank, c)``
    (``len(chunks)`` chunks per stage; the loop placement's ``pp_rank + c * pp``, ZB-V's
    ``pp_rank`` and ``2 pp - 1 - pp_rank``; ``placement_for(schedule, pp, len(chunks))``);
    chunk modules follow the models contract ``module(x, labels=None, *, sample_ids=None, step=0)`` (plus
    ``document_ids=`` when the microbatches carry them, ``microbatch.document_kwargs``).
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        pstate: "ParallelState",
        *,
        schedule: str = PipelineOptions.schedule,
        num_microbatches: int,
        micro_batch_size: int,
        seq_len: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
        grad_sync: GradSync | None = None,
        prefetch_recvs: int | None = None,
        free_sent_activations: bool = True,
        w_lags: Sequence[int] | None = None,
        split_drain: bool | str = PipelineOptions.split_drain,
    ) -> None:
        if not chunks:
            raise ValueError("PipelineEngine needs at least one model chunk")
        self.chunks = list(chunks)
        self.pstate = pstate
        self.num_virtual_stages = len(self.chunks)
        self.num_microbatches = num_microbatches
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.grad_sync: GradSync = grad_sync if grad_sync is not None else TiedGradFinalizer(self.chunks, pstate)
        p = pstate.size("pp")
        self.schedule_name = schedule
        coalesces = pstate.p2p_coalesces
        self.split_drain = drain_is_split(schedule, split_drain)  # resolved: the schedule was built with it
        full = build_schedule(schedule, p, num_microbatches, self.num_virtual_stages, coalesced_p2p=coalesces,
                              w_lags=w_lags, split_drain=self.split_drain)
        self.placement: ChunkPlacement = full.placement
        self.actions = full[pstate.coord("pp")]
        self.spec = MessageSpec.from_config(
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            hidden_size=hidden_size,
            dtype=dtype,
            tp_size=pstate.size("tp"),
            sequence_parallel=sequence_parallel,
        )
        self.p2p = PipelineP2P(pstate, self.spec, self.num_virtual_stages, self.placement)
        held = self.placement.chunks_of(pstate.coord("pp"))
        self.microbatch_keys = stage_keys(0 in held, self.placement.total - 1 in held)
        if prefetch_recvs is None:
            prefetch_recvs = default_prefetch(coalesces)
        if isinstance(prefetch_recvs, bool) or not isinstance(prefetch_recvs, int) or prefetch_recvs < 0:
            raise ValueError(f"prefetch_recvs={prefetch_recvs!r} must be an integer >= 0")
        self.prefetch_recvs = prefetch_recvs
        self.free_sent_activations = bool(free_sent_activations)
        self._wait_for_sent_activations = self.free_sent_activations and self.num_virtual_stages == 1
        try:  # the exact batches and waits run_step will use, on every stage
            check_coalesced_progress(full, prefetch=prefetch_recvs, coalesced=coalesces,
                                     wait_sent_activations=self._wait_for_sent_activations)
        except ScheduleError as exc:
            raise ValueError(f"prefetch_recvs={prefetch_recvs}, schedule {schedule!r}, {pstate}: {exc}") from exc
        self.split_backward = splits_backward(self.actions)  # any; which ones: PlannedCompute.split
        # A stage without the model's first chunk waits for the stages above it to drain at the end of
        # its step: it frees its finished backward graphs then, not between its actions (step_run), a
        # split B's too (else freed in pieces by the W that drops the last linear input referencing it).
        self.park_spent_graphs = 0 not in held and any(a.kind == "B" for a in self.actions)
        # Each chunk's parameters, listed once: walking the module tree cost about 0.06 ms per step (a
        # 4-layer GPT chunk; more when the machine is busy), paid before a stage's first action, on the
        # critical path.
        # The Parameter objects are those of construction for good (ZeRO moves their ``.data`` only);
        # what may change between steps, ``requires_grad``, is read per step (backward_inputs).
        self._chunk_params = [list(c.parameters()) for c in self.chunks]
        self.plan = compile_plan(self.actions, pstate.coord("pp"), self.placement, self.chunks, prefetch_recvs,
                                 self.p2p.peer)

    # ---- helpers -------------------------------------------------------------------
    def _check_microbatches(self, microbatches: Sequence[dict[str, Any]]) -> None:
        if len(microbatches) != self.num_microbatches:
            raise ValueError(
                f"run_step got {len(microbatches)} microbatches; the engine was built for "
                f"num_microbatches={self.num_microbatches}"
            )
        want = (self.micro_batch_size, self.seq_len)
        for i, mb in enumerate(microbatches):
            missing = [k for k in self.microbatch_keys if k not in mb]
            if missing:
                raise ValueError(
                    f"rank {self.pstate.rank} (pipeline stage {self.pstate.coord('pp')}): microbatch {i} lacks keys "
                    f"{missing}; this stage reads {self.microbatch_keys} (pipeline.microbatch.stage_keys)"
                )
            for key in TOKEN_KEYS:
                if key in self.microbatch_keys and tuple(mb[key].shape) != want:
                    raise ValueError(
                        f"microbatch {i}: {key} has shape {tuple(mb[key].shape)}, expected "
                        f"[micro_batch_size, seq_len]={list(want)}"
                    )

    # ---- the step ------------------------------------------------------------------
    def run_step(
        self, microbatches: Sequence[dict[str, Any]], *, loss_scale: float = 1.0, step: int = 0,
        account_activations: bool = False,
    ) -> StepResult:
        """Forward and backward every microbatch once; grads accumulate into ``.grad``.

        ``account_activations``: measure ``peak_activation_bytes`` (saved-tensor hooks around
        every forward: a Python call per saved tensor, so only on steps that read it, e.g. the
        trainer's log steps). Losses, gradients and which sent outputs are freed do not
        depend on it; without it the result's ``peak_activation_bytes`` is None.
        """
        if not isinstance(account_activations, bool):
            raise TypeError(f"account_activations must be a bool, got {account_activations!r}")
        self._check_microbatches(microbatches)
        # Parameters may have been moved into flat buffers (ZeRO) since construction. Only the
        # accounting reads them (to leave them out of the activation bytes).
        param_storages = ({storage_key(p) for ps in self._chunk_params for p in ps}
                          if account_activations else set())
        undeferred = [backward_inputs(ps) for ps in self._chunk_params] if self.split_backward else []
        waited = self.p2p.wait_time
        run = StepRun(self, microbatches, loss_scale, step, param_storages, undeferred, account_activations)
        block, timeline, clock, cpu = self._wait_for_sent_activations, run.timeline, time.perf_counter, time.thread_time
        handlers = {"F": run.forward, "B": run.backward, "W": run.weight_grad}
        communicate, release_sent, record_peak, t0 = run.communicate, run.release_sent, run.record_peak, run.t0
        cpu_start, cpu_busy, busy = cpu(), 0.0, 0.0
        compute_cpu: list[tuple[Action, float]] = []
        # Split backwards: each chunk's W graph is built once this step and rerun (deferred_grads).
        with self.pstate.weight_grads.reusing_graphs() if self.split_backward else nullcontext():
            for planned in self.plan:
                if planned.communicates:
                    communicate(planned)
                c = planned.compute
                if c is None:
                    continue
                kind = c.kind
                cpu_before = cpu()
                start = clock()
                handlers[kind](c)
                end = clock()
                spent = cpu() - cpu_before
                cpu_busy += spent
                busy += end - start
                compute_cpu.append((c.action, spent))
                timeline.append((c.action, start - t0, end - t0))
                if kind == "F":
                    release_sent(block)
                    record_peak()
                elif c.split:
                    # A split B leaves one more microbatch waiting for W (zero_bubble.pending_at_forwards):
                    # the peak is here where W's inputs + output grads outweigh a forward's saved tensors
                    # (full recompute saves only the chunk input)
                    record_peak()
        run.busy = busy
        schedule_wait = self.p2p.wait_time - waited
        self.p2p.wait_sends()
        executor_cpu = cpu() - cpu_start - cpu_busy
        if run.leftovers():
            raise RuntimeError(f"rank {self.pstate.rank}: activations left after the step (schedule bug)")
        finalize_start = clock()
        # Part of the closing phase, not of any action: the graphs this stage parked (step_run) go
        # while the stages above it finish their last backwards, which finalize waits for anyway.
        run.free_parked_graphs()
        self.grad_sync.finalize()
        loss = torch.stack(run.losses).float().mean().item() if run.losses else None
        loss = send_loss_to_last_stage(loss, self.placement, self.pstate)
        finalize_time = clock() - finalize_start
        return StepResult(
            loss=loss,
            step_time=time.perf_counter() - run.t0,
            busy_time=run.busy,
            peak_live_activations=run.peak_live,
            peak_activation_bytes=run.peak_bytes if account_activations else None,
            num_microbatches=self.num_microbatches,
            comm_time=run.comm_time,
            timeline=run.timeline,
            wait_time=self.p2p.wait_time - waited,
            num_actions=len(self.actions),
            finalize_time=finalize_time,
            executor_cpu_time=executor_cpu,
            start_time=run.t0,
            schedule_wait_time=schedule_wait,
            compute_cpu=compute_cpu,
        )
