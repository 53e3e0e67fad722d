"""Run one rank's pipeline schedule for one optimizer step.

``PipelineEngine.run_step`` walks this stage's action list from
``schedules.build_schedule``: it receives activations/gradients, runs its model
chunks, keeps exactly the activations the schedule still needs (a microbatch's
stored input and output live from its ``F`` to its ``B``), sends, and
accumulates gradients over microbatches into ``.grad`` (callers zero them).
With pp == 1 the same loop is plain gradient accumulation.

Loss scale invariant: each microbatch's loss is multiplied by
``loss_scale / num_microbatches`` before backward, so after a step the grads are
those of ``loss_scale`` times the mean loss over the step's microbatches,
whatever pp and m are (DP averaging is the optimizer's job).

Sent activations (Megatron's trick): once a chunk's output has been sent
downstream, only its autograd graph is needed for the backward, not its values,
unless autograd saved the output tensor itself. With ``free_sent_activations``
the engine then swaps the output's data for a one-element placeholder (expanded
to the same shape, so ``backward`` still type-checks); the storage goes when the
send's batch has completed (``PipelineP2P.release_sent``), and from then on it is
no longer counted in ``peak_activation_bytes``. A stage then holds its in-flight
microbatches' saved tensors plus at most the newest output, not every output.
gloo says a send is done only from a blocking ``wait``, so on single-chunk
schedules (1f1b, gpipe) the engine waits, after each forward, for the batches
holding its earlier activation sends; interleaved schedules free a sent output
only once the backend reports its batch complete on its own (NCCL does).

Communication follows ``actions.comm_plan``: the comm actions between two
computations form one batch; on gloo receives are also posted ``prefetch_recvs``
(default 2) ahead of need so their transfer overlaps compute. Where a batch
completes as one unit and a rank's batches run in FIFO order
(``pstate.p2p_coalesces``: NCCL), a receive posted ahead would stall every later
batch of the rank, sends included: the default there is 0, and the schedule is
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
chunk's last ``B`` and before ``W`` whether it is its last ``W``.

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
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

import torch

from parallel3d.deferred_grads import DeferredWeightGrads, backward_inputs
from parallel3d.pipeline.backward_split import FullBackward, split_backward
from parallel3d.pipeline.actions import Action, CommStep, ScheduleError, comm_plan, splits_backward, virtual_stage
from parallel3d.pipeline.microbatch import TOKEN_KEYS, stage_keys
from parallel3d.pipeline.p2p import MessageSpec, PipelineP2P
from parallel3d.pipeline.schedules import build_schedule, check_coalesced_progress
from parallel3d.pipeline.tied import TiedGradFinalizer

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


class GradSync(Protocol):
    """What the engine asks of gradient synchronisation (ZeRO's ``GradSync``, or ``TiedGradFinalizer``)."""

    def prepare(self, is_last_microbatch: bool) -> None: ...

    def finalize(self) -> None: ...


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage that survives a resize (ZeRO-3 frees and re-gathers parameter
    storage in place, which changes its data pointer but not the storage object)."""
    return t.untyped_storage()._cdata


@dataclass
class StepResult:
    """What one ``run_step`` measured on this rank.

    ``loss`` is the mean loss over the step's microbatches (unscaled) on ranks of
    the last stage, ``None`` elsewhere. Times are wall-clock seconds;
    ``bubble_fraction = 1 - busy_time / step_time``. ``peak_live_activations`` is
    the most (microbatch, chunk) pairs stored at once; ``peak_activation_bytes``
    the most bytes they held (tensors autograd saved for backward plus the stage's
    stored input and output, each storage counted once, parameters excluded; a sent
    output freed by ``free_sent_activations`` counts until its send completes).
    """

    loss: float | None
    step_time: float
    busy_time: float
    peak_live_activations: int
    peak_activation_bytes: int
    num_microbatches: int
    comm_time: float = 0.0  # seconds blocked in point-to-point (posting + waiting for receives)
    timeline: list[tuple[Action, float, float]] = field(default_factory=list, repr=False)

    @property
    def bubble_fraction(self) -> float:
        return 0.0 if self.step_time <= 0 else max(0.0, 1.0 - self.busy_time / self.step_time)


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


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _SavedBytes:
    """Counts storage bytes autograd saves during one forward (parameters excluded).

    The pack hook only collects the tensors (it runs once per saved tensor, so it stays
    minimal); their storages are deduplicated and summed once, in ``total``/``storages``.
    """

    def __init__(self, param_storages: set[int]) -> None:
        self.param_storages = param_storages
        self._seen: list[torch.Tensor] = []  # not yet counted
        self._counted: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        self._seen.append(t)

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._seen.append(t)
        # A saved output returned as itself would hold its own grad_fn (tensor -> node -> saved
        # tensor): a cycle of C++ references no GC can see. A plain backward breaks it by releasing
        # the saved tensors; a split backward (B with retain_graph, W off the input path) never
        # releases the input path's, so every graph would leak. A detached alias has no grad_fn.
        return t.detach() if t.grad_fn is not None else t

    @property
    def storages(self) -> dict[int, int]:
        """storage key -> bytes of each non-parameter storage seen (tensors are dropped once counted)."""
        for t in self._seen:
            if t.device.type != "meta":
                key = storage_key(t)
                if key not in self.param_storages and key not in self._counted:
                    self._counted[key] = t.untyped_storage().nbytes()
        self._seen = []
        return self._counted

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class PipelineEngine:
    """Executes this rank's part of the pipeline schedule.

    ``chunks[c]`` is model chunk ``pp_rank + c * pp`` (``len(chunks)`` virtual
    stages); chunk modules follow the models contract
    ``module(x, labels=None, *, sample_ids=None, step=0)``.
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        pstate: "ParallelState",
        *,
        schedule: str = "1f1b",
        num_microbatches: int,
        micro_batch_size: int,
        seq_len: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
        grad_sync: GradSync | None = None,
        prefetch_recvs: int | None = None,
        free_sent_activations: bool = True,
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
        p = pstate.pp_size
        self.schedule_name = schedule
        coalesces = pstate.p2p_coalesces
        full = build_schedule(schedule, p, num_microbatches, self.num_virtual_stages, coalesced_p2p=coalesces)
        self.actions = full[pstate.pp_rank]
        self.spec = MessageSpec.from_config(
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            hidden_size=hidden_size,
            dtype=dtype,
            tp_size=pstate.tp_size,
            sequence_parallel=sequence_parallel,
        )
        self.p2p = PipelineP2P(pstate, self.spec, self.num_virtual_stages)
        self.microbatch_keys = stage_keys(pstate.is_first_stage, pstate.is_last_stage)
        self._last_virtual = p * self.num_virtual_stages - 1
        if prefetch_recvs is None:
            prefetch_recvs = 0 if coalesces else 2
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
        self.plan = comm_plan(self.actions, prefetch_recvs)
        # Per chunk, its last B and its last W: after them no more gradients of that kind arrive.
        self.split_backward = splits_backward(self.actions)
        last: dict[tuple[str, int], Action] = {(a.kind, a.chunk): a for a in self.actions if a.kind in ("B", "W")}
        self._completing = {(a.kind, a.microbatch, a.chunk) for a in last.values()}

    # ---- helpers -------------------------------------------------------------------
    def _virtual(self, chunk: int) -> int:
        return virtual_stage(self.pstate.pp_rank, chunk, self.pstate.pp_size)

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
                    f"rank {self.pstate.rank} (pipeline stage {self.pstate.pp_rank}): microbatch {i} lacks keys "
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
        self, microbatches: Sequence[dict[str, Any]], *, loss_scale: float = 1.0, step: int = 0
    ) -> StepResult:
        """Forward and backward every microbatch once; grads accumulate into ``.grad``."""
        self._check_microbatches(microbatches)
        # Parameters may have been moved into flat buffers (ZeRO) since construction.
        param_storages = {storage_key(p) for c in self.chunks for p in c.parameters() if p.device.type != "meta"}
        run = _StepRun(self, microbatches, loss_scale, step, param_storages)
        if self.split_backward:
            run.undeferred = [backward_inputs(c.parameters()) for c in self.chunks]
        for plan_step in self.plan:
            run.communicate(plan_step)
            action = plan_step.compute
            if action is None:
                continue
            start = time.perf_counter()
            if action.kind == "F":
                run.forward(action)
            elif action.kind == "B":
                run.backward(action)
            else:
                run.weight_grad(action)
            end = time.perf_counter()
            run.busy += end - start
            run.timeline.append((action, start - run.t0, end - run.t0))
            if action.kind == "F":
                run.release_sent(block=self._wait_for_sent_activations)
                run.record_peak()
        self.p2p.wait_sends()
        if run.outputs or run.inputs or run.grads_in or run.grads_out or run.weight_work:
            raise RuntimeError(f"rank {self.pstate.rank}: activations left after the step (schedule bug)")
        self.grad_sync.finalize()
        loss = torch.stack(run.losses).float().mean().item() if run.losses else None
        return StepResult(
            loss=loss,
            step_time=time.perf_counter() - run.t0,
            busy_time=run.busy,
            peak_live_activations=run.peak_live,
            peak_activation_bytes=run.peak_bytes,
            num_microbatches=self.num_microbatches,
            comm_time=run.comm_time,
            timeline=run.timeline,
        )


class _StepRun:
    """The mutable state of one ``run_step``: what is stored, received, pending and measured.

    Keys are ``(microbatch, chunk)``. A microbatch-chunk's input and output are stored
    from its ``F`` to its ``B``; received gradients from their receive to the ``B``;
    input gradients from the ``B`` to their send.
    """

    def __init__(self, engine: PipelineEngine, microbatches, loss_scale: float, step: int,
                 param_storages: set[int]) -> None:
        self.engine = engine
        self.microbatches = microbatches
        self.loss_factor = loss_scale / engine.num_microbatches
        self.step = step
        self.param_storages = param_storages
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activations (require grad)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # chunk outputs; scaled loss on the last chunk
        self.stored_bytes: dict[tuple[int, int], int] = {}
        # Outputs that may lose their storage once sent (autograd did not save them): their bytes.
        self.freeable_bytes: dict[tuple[int, int], int] = {}
        self.grads_in: dict[tuple[int, int], torch.Tensor] = {}
        self.grads_out: dict[tuple[int, int], torch.Tensor] = {}
        self.weight_work: dict[tuple[int, int], DeferredWeightGrads | FullBackward] = {}  # split: B done, W owed
        self.undeferred: list[list[torch.Tensor]] = []  # split: per chunk, the parameters B accumulates
        self.losses: list[torch.Tensor] = []
        self.timeline: list[tuple[Action, float, float]] = []
        self.peak_live = self.peak_bytes = 0
        self.busy = self.comm_time = 0.0
        self.t0 = time.perf_counter()

    def communicate(self, step: CommStep) -> None:
        """Post the step's batch (and receives ahead of need); wait for the receives it needs."""
        if not (step.batch or step.ahead or step.needs):
            return
        sends = []
        for a in step.batch:
            key = (a.microbatch, a.chunk)
            if a.kind == "SEND_ACT":
                sends.append((a, self.outputs[key]))
            elif a.kind == "SEND_GRAD":
                sends.append((a, self.grads_out.pop(key)))
        start = time.perf_counter()
        for a, tensor in self.engine.p2p.exchange(sends, step.needs, step.ahead).items():
            key = (a.microbatch, a.chunk)
            if a.kind == "RECV_ACT":
                self.inputs[key] = tensor.requires_grad_(True)
            else:
                self.grads_in[key] = tensor
        for a, tensor in sends:
            key = (a.microbatch, a.chunk)
            if a.kind == "SEND_ACT" and key in self.freeable_bytes:
                # The p2p layer's reference keeps the storage alive until the send is done.
                tensor.data = torch.empty(1, dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)
        end = time.perf_counter()
        self.comm_time += end - start
        self.timeline.extend((a, start - self.t0, end - self.t0) for a in [*(a for a, _ in sends), *step.needs])

    def release_sent(self, block: bool) -> None:
        """Stop counting the sent outputs whose sends completed (their storage is gone now)."""
        start = time.perf_counter()
        released = self.engine.p2p.release_sent(wait_for_activations=block)
        self.comm_time += time.perf_counter() - start
        for a in released:
            key = (a.microbatch, a.chunk)
            freed = self.freeable_bytes.pop(key, 0) if a.kind == "SEND_ACT" else 0
            if key in self.stored_bytes:
                self.stored_bytes[key] -= freed

    def forward(self, action: Action) -> None:
        e = self.engine
        key = (action.microbatch, action.chunk)
        vs = e._virtual(action.chunk)
        is_last = vs == e._last_virtual
        mb = self.microbatches[action.microbatch]
        x = mb["input_ids"] if vs == 0 else self.inputs[key]
        saved = _SavedBytes(self.param_storages)
        with saved.recording():
            out = e.chunks[action.chunk](x, mb["labels"] if is_last else None, sample_ids=mb["sample_ids"],
                                         step=self.step)
        if vs > 0:
            saved.add(x)
        if is_last:
            self.losses.append(out.detach())
            out = out * self.loss_factor
        else:
            if e.free_sent_activations and out.grad_fn is not None and storage_key(out) not in saved.storages:
                self.freeable_bytes[key] = out.untyped_storage().nbytes()
            saved.add(out)
        self.outputs[key] = out
        self.stored_bytes[key] = saved.total

    def held_bytes(self, tensors: Sequence[torch.Tensor]) -> int:
        """Bytes of the distinct non-parameter storages behind ``tensors``."""
        sizes = {storage_key(t): t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"}
        return sum(n for k, n in sizes.items() if k not in self.param_storages)

    def record_peak(self) -> None:
        """Activations peak right after a forward (before its output is sent)."""
        self.peak_live = max(self.peak_live, len(self.stored_bytes))  # F until B (split: until W)
        self.peak_bytes = max(self.peak_bytes, sum(self.stored_bytes.values()))

    def backward(self, action: Action) -> None:
        e = self.engine
        key = (action.microbatch, action.chunk)
        vs = e._virtual(action.chunk)
        e.grad_sync.prepare(("B", *key) in e._completing)
        out = self.outputs.pop(key)
        grad = None if vs == e._last_virtual else self.grads_in.pop(key)
        inp = self.inputs.pop(key, None)
        if e.split_backward:
            if vs == 0:  # no input gradient to send: all of the backward is W's (the graph stays)
                self.weight_work[key] = FullBackward(out, grad)
                return
            self.grads_out[key], work = split_backward(out, grad, inp, e.pstate.weight_grads, self.undeferred[action.chunk])
            self.weight_work[key] = work
            self.stored_bytes[key] = self.held_bytes(work.held)  # the graph is gone: only W's inputs remain
            self.freeable_bytes.pop(key, None)
            return
        torch.autograd.backward(out, grad_tensors=grad)
        del out, grad  # the graph and its saved activations go now
        self.stored_bytes.pop(key)
        self.freeable_bytes.pop(key, None)
        if vs > 0:
            if inp.grad is None:
                raise RuntimeError(
                    f"rank {e.pstate.rank}: chunk {action.chunk}'s output does not depend on its input"
                )
            self.grads_out[key] = inp.grad

    def weight_grad(self, action: Action) -> None:
        """``W``: accumulate this microbatch-chunk's weight gradients; its graph goes now."""
        e = self.engine
        key = (action.microbatch, action.chunk)
        e.grad_sync.prepare(("W", *key) in e._completing)
        self.weight_work.pop(key).run()
        self.stored_bytes.pop(key)
        self.freeable_bytes.pop(key, None)
