"""The mutable state of one training step of the pipeline engine, and what each planned step does.

Keys are ``(microbatch, local chunk)``. A microbatch-chunk's input and output are stored
from its ``F`` to its ``B``; received (or, at a turn of ZB-V, handed over) output
gradients from their arrival to the ``B``; input gradients from the ``B`` to their
send (or to the ``B`` of the chunk before it on this stage); with split backwards the
weight-gradient work from ``B`` to ``W``. ``stored_bytes`` has a key per stored
microbatch-chunk; only a step that accounts its activations (``account``) counts their
bytes there (``activation_bytes``); the others keep 0s and skip the saved-tensor hooks. The step's
microbatch tensors count once, for the whole step (``batch_bytes``), never inside a forward's.
Everything an action needs beyond these dicts was resolved when
the plan was compiled (``step_plan``), so nothing is looked up or allocated per action
but the tensors themselves.

Spent graphs (``StepOwner.park_spent_graphs``): freeing a backward's finished graph (its nodes,
custom Functions' contexts) costs CPU (about 0.1 ms for a 4-layer GPT chunk) that on a stage
without the model's first chunk delays its next action, the critical path of a pipeline whose
later stage is its busiest. There the graphs are parked and freed together after the action
loop (``free_parked_graphs``, in the engine's closing phase), while the stage waits for the
stages above it to drain. A parked
graph holds no activation: backward has freed its saved tensors, and the one tensor it still
references, the stage's input (autograd's accumulator for it), is emptied first: its gradient
handed on and its data swapped for the step's placeholder, so its receive buffer is reused as before.
A split ``B``'s graph is parked alike (``_spent``): left to go with its output, it lived on through its
deferring layers' saved inputs and was freed, mostly, inside the microbatch's ``W`` (about 0.1 ms per
``W`` at hidden 128, pp 4, 2026-12-07, ``scripts/profile_pipeline_actions.py``), where 1F1B's parked one
costs its ``B`` nothing; not where a ``W`` reads the stage's input itself (the input must keep its data).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from parallel3d.deferred_grads import DeferredWeightGrads
from parallel3d.pipeline.activation_bytes import SavedBytes, held_bytes, output_saved, storage_key
from parallel3d.pipeline.actions import Action
from parallel3d.pipeline.backward_split import FullBackward, split_backward
from parallel3d.pipeline.microbatch import document_kwargs
from parallel3d.pipeline.step_plan import PlannedCompute, PlannedStep

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState
    from parallel3d.pipeline.p2p import PipelineP2P

Key = tuple[int, int]


class StepOwner(Protocol):
    """What a step reads from its engine (``PipelineEngine``; a protocol, so this module
    does not import the engine that imports it)."""

    p2p: "PipelineP2P"
    pstate: "ParallelState"
    num_microbatches: int
    free_sent_activations: bool
    split_backward: bool  # some backward of this stage is split (a W is listed)
    park_spent_graphs: bool  # free finished backward graphs after the action loop (module doc)
    grad_sync: Any  # engine.GradSync: prepare(is_last_microbatch), finalize()


class StepRun:
    """One ``run_step``'s stored tensors, pending work and measurements (see the module doc)."""

    def __init__(self, engine: StepOwner, microbatches: Sequence[dict[str, Any]], loss_scale: float,
                 step: int, param_storages: set[int], undeferred: list[list[torch.Tensor]],
                 account: bool) -> None:
        self.engine = engine
        self.account = account  # count activation bytes (saved-tensor hooks) this step
        self.p2p = engine.p2p
        self.microbatches = microbatches
        self.loss_factor = loss_scale / engine.num_microbatches
        self.step = step
        # The step's microbatch tensors (token ids, labels, sample ids) are held by the caller from the first
        # action to the last, whatever autograd saves of them: counted once, for the whole step (``batch_bytes``),
        # and left out of each forward's saved bytes like the parameters. Counted per forward, a storage every
        # microbatch shares (a CPU job's step token buffer, of which each microbatch's ids are views) was counted
        # once per microbatch in flight, and a rank's peak depended on which ops happen to save the ids.
        batch = [t for mb in microbatches for t in mb.values() if isinstance(t, torch.Tensor)] if account else []
        self.batch_bytes = held_bytes(batch, set())
        self.excluded_storages = param_storages | {storage_key(t) for t in batch}  # not activations
        self.undeferred = undeferred  # split backwards: per chunk, the parameters B accumulates
        self.inputs: dict[Key, torch.Tensor] = {}  # received (or handed-over) activations, requiring grad
        self.outputs: dict[Key, torch.Tensor] = {}  # chunk outputs; the scaled loss on the last chunk
        self.stored_bytes: dict[Key, int] = {}  # bytes 0 unless ``account``
        # Outputs that may lose their storage once sent (autograd did not save them): their bytes
        # (0 unless ``account``).
        self.freeable_bytes: dict[Key, int] = {}
        self.grads_in: dict[Key, torch.Tensor] = {}
        self.grads_out: dict[Key, torch.Tensor] = {}
        self.weight_work: dict[Key, DeferredWeightGrads | FullBackward] = {}  # split backwards: B done, W owed
        self.losses: list[torch.Tensor] = []
        self.root_grad: torch.Tensor | None = None  # loss_factor, in the loss's dtype (root_grad)
        self.timeline: list[tuple[Action, float, float]] = []
        # What a freed sent output (or a parked graph's input) keeps (all messages share one shape and
        # dtype): one per step.
        self.placeholder: torch.Tensor | None = None
        # Finished backward graphs (their output's grad_fn) freed after the action loop; None: at once.
        self.parked_graphs: list[Any] | None = [] if engine.park_spent_graphs else None
        self.peak_live = self.peak_bytes = 0
        self.busy = self.comm_time = 0.0
        self.t0 = time.perf_counter()

    def leftovers(self) -> bool:
        return bool(self.outputs or self.inputs or self.grads_in or self.grads_out or self.weight_work)

    # ---- communication ------------------------------------------------------------------
    def communicate(self, step: PlannedStep) -> None:
        """Post the step's batch (and receives ahead of need); wait for the receives it needs."""
        start = time.perf_counter()
        outputs, grads_out, p2p = self.outputs, self.grads_out, self.p2p
        sends = [(a, outputs[key] if a.kind == "SEND_ACT" else grads_out.pop(key), peer) for a, key, peer in step.sends]
        if sends or step.posts:
            p2p.post(sends, step.posts)
        for recv in step.ahead:
            p2p.post_recv(*recv)
        freeable = self.freeable_bytes
        for a, tensor, _ in sends:
            if a.kind == "SEND_ACT" and (a.microbatch, a.chunk) in freeable:
                # The p2p layer's alias keeps the storage alive until the send is done; the output
                # keeps only a placeholder of its shape (never read: autograd did not save it).
                tensor.data = self._placeholder(tensor)
        take, inputs, grads_in = p2p.take, self.inputs, self.grads_in
        for a, key, activation in step.received:
            if activation:
                inputs[key] = take(a).requires_grad_(True)
            else:
                grads_in[key] = take(a)
        end = time.perf_counter()
        self.comm_time += end - start
        start, end = start - self.t0, end - self.t0
        timeline = self.timeline
        for a, _, _ in sends:
            timeline.append((a, start, end))
        for a in step.needs:
            timeline.append((a, start, end))

    def _root_grad(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss's backward seed: ``loss_factor`` (d(loss_factor * loss) / d loss), made once per step.

        Why not ``loss * loss_factor`` in the forward: one node (and op) less per microbatch, the same
        gradients bit for bit, since that product's backward hands on exactly this value (1 times the
        factor, rounded to the loss's dtype) to the loss's own backward."""
        if self.root_grad is None:
            self.root_grad = torch.full_like(loss, self.loss_factor)
        return self.root_grad

    def _placeholder(self, like: torch.Tensor) -> torch.Tensor:
        if self.placeholder is None:
            self.placeholder = torch.empty(1, dtype=like.dtype, device=like.device).expand(like.shape)
        return self.placeholder

    def free_parked_graphs(self) -> None:
        """Free the finished backward graphs parked during the action loop (module doc)."""
        if self.parked_graphs:
            self.parked_graphs.clear()

    def release_sent(self, block: bool) -> None:
        """Stop counting the sent outputs whose sends completed (their storage is gone now)."""
        start = time.perf_counter()
        released = self.p2p.release_sent(wait_for_activations=block)
        self.comm_time += time.perf_counter() - start
        for a in released:
            key = (a.microbatch, a.chunk)
            freed = self.freeable_bytes.pop(key, 0) if a.kind == "SEND_ACT" else 0
            if key in self.stored_bytes:
                self.stored_bytes[key] -= freed

    # ---- computation ----------------------------------------------------------------------
    def forward(self, c: PlannedCompute) -> None:
        mb = self.microbatches[c.microbatch]
        key = c.key
        if c.first:
            x = mb["input_ids"]
        elif c.local_input is not None:  # a turn of the V: the previous chunk's output, on this stage
            x = self.inputs[key] = self.outputs[c.local_input].detach().requires_grad_(True)
        else:
            x = self.inputs[key]
        # Saved-tensor hooks only on a step that accounts its activations; on the others whether a sent
        # output may go is read off the output itself (output_saved).
        saved = SavedBytes(self.excluded_storages) if self.account else None
        with saved.recording() if saved is not None else nullcontext():
            out = c.module(x, mb["labels"] if c.last else None, sample_ids=mb["sample_ids"], step=self.step,
                           **document_kwargs(mb))
        if saved is not None and not c.first and c.local_input is None:
            saved.add(x)
        if c.last:
            self.losses.append(out.detach())  # the loss is scaled at its backward (root_grad), not here
        elif c.sends_output and self.engine.free_sent_activations \
                and (saved is None or storage_key(out) not in saved.storages) and not output_saved(out):
            # output_saved: what autograd or a custom Function's ctx holds; the hooks, where they ran,
            # what autograd saved: free only what neither holds (the same outputs either way).
            self.freeable_bytes[key] = out.untyped_storage().nbytes() if saved is not None else 0
        self.outputs[key] = out
        if saved is None:
            self.stored_bytes[key] = 0
            return
        if not c.last:
            saved.add(out)
        self.stored_bytes[key] = saved.total

    def record_peak(self) -> None:
        """Activations peak right after a forward (before its output is sent), or with split backwards
        right after a ``B`` (its microbatch now holds W's tensors; the engine records both)."""
        self.peak_live = max(self.peak_live, len(self.stored_bytes))  # F until B (split: until W)
        if self.account:
            self.peak_bytes = max(self.peak_bytes, sum(self.stored_bytes.values()) + self.batch_bytes)

    def backward(self, c: PlannedCompute) -> None:
        e, key = self.engine, c.key
        e.grad_sync.prepare(c.completes)
        out = self.outputs.pop(key)
        if c.last:
            grad = self._root_grad(out)
        elif c.local_grad is not None:  # from the next chunk's B on this stage
            grad = self.grads_out.pop(c.local_grad)
        else:
            grad = self.grads_in.pop(key)
        inp = self.inputs.pop(key, None)
        if c.split:
            if c.first:  # no input gradient to send: all of the backward is W's (the graph stays)
                self.weight_work[key] = FullBackward(out, grad)
                return
            self.grads_out[key], work = split_backward(out, grad, inp, e.pstate.weight_grads,
                                                       self.undeferred[c.action.chunk])
            self.weight_work[key] = work
            if not work.holds(inp):  # else W reads the input itself: W frees the graph
                self._spent(out, inp)
            # the graph's activations are gone; what the queue holds counts instead
            self.stored_bytes[key] = held_bytes(work.held, self.excluded_storages) if self.account else 0
            self.freeable_bytes.pop(key, None)
            return
        torch.autograd.backward(out, grad_tensors=grad)
        del grad
        self.stored_bytes.pop(key)
        self.freeable_bytes.pop(key, None)
        if not c.first:
            if inp.grad is None:
                raise RuntimeError(f"rank {e.pstate.rank}: chunk {c.action.chunk}'s output does not depend on its input")
            self.grads_out[key] = inp.grad
        self._spent(out, inp)

    def _spent(self, out: torch.Tensor, inp: torch.Tensor | None) -> None:
        """After a backward (whole or ``B``) whose input gradient, if any, is in ``grads_out``: park its
        graph (module doc) or let it go with ``out`` at once. A split ``B``'s graph is parked too: its
        deferring layers' saved inputs reference its nodes, so it would otherwise be freed piece by piece
        in the ``W``s that drop them, the last of which frees most of it. Not where a deferring layer
        read the input itself (its ``W`` closure holds ``inp``, whose data must stay)."""
        parked = self.parked_graphs
        if parked is None:
            return
        parked.append(out.grad_fn)  # its saved activations are gone; its nodes go after the loop
        if inp is not None:
            # The parked graph's accumulator still references the input: empty it (module doc).
            inp.grad = None
            inp.data = self._placeholder(inp)

    def weight_grad(self, c: PlannedCompute) -> None:
        """``W``: accumulate this microbatch-chunk's weight gradients; what it held goes now."""
        self.engine.grad_sync.prepare(c.completes)
        self.weight_work.pop(c.key).run()
        self.stored_bytes.pop(c.key)
        self.freeable_bytes.pop(c.key, None)
