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

Tied embeddings: with ``grad_sync=None`` the engine sums tied-embedding grads
over the ``embedding`` group at the end of ``run_step``; with a ``grad_sync``
(ZeRO) it does not, and the optimizer calls ``sync_tied_embedding_grads``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

import torch

from parallel3d.pipeline.p2p import MessageSpec, PipelineP2P
from parallel3d.pipeline.schedules import Action, build_schedule, virtual_stage
from parallel3d.pipeline.tied import sync_tied_embedding_grads

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

MICROBATCH_KEYS = ("input_ids", "labels", "sample_ids")


class GradSync(Protocol):
    def prepare(self, is_last_microbatch: bool) -> None: ...

    def finish(self) -> None: ...


@dataclass
class StepResult:
    """What one ``run_step`` measured on this rank.

    ``loss`` is the mean loss over the step's microbatches (unscaled) on ranks of
    the last stage, ``None`` elsewhere. Times are wall-clock seconds;
    ``bubble_fraction = 1 - busy_time / step_time``. ``peak_live_activations`` is
    the most (microbatch, chunk) pairs stored at once; ``peak_activation_bytes``
    the most bytes they held (tensors autograd saved for backward plus the stage's
    stored input and output, each storage counted once, parameters excluded).
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


class _SavedBytes:
    """Counts storage bytes autograd saves during one forward (parameters excluded)."""

    def __init__(self, param_storages: set[int]) -> None:
        self.param_storages = param_storages
        self.storages: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.param_storages:
            self.storages[ptr] = storage.nbytes()

    @contextmanager
    def recording(self) -> Iterator[None]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.add(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

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
        prefetch_recvs: int = 0,
    ) -> None:
        if not chunks:
            raise ValueError("PipelineEngine needs at least one model chunk")
        self.chunks = list(chunks)
        self.pstate = pstate
        self.num_virtual_stages = len(self.chunks)
        self.num_microbatches = num_microbatches
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.grad_sync = grad_sync
        p = pstate.pp_size
        self.schedule_name = schedule
        self.actions = build_schedule(schedule, p, num_microbatches, self.num_virtual_stages)[pstate.pp_rank]
        self.spec = MessageSpec.from_config(
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            hidden_size=hidden_size,
            dtype=dtype,
            tp_size=pstate.tp_size,
            sequence_parallel=sequence_parallel,
        )
        self.p2p = PipelineP2P(pstate, self.spec, self.num_virtual_stages)
        self._last_virtual = p * self.num_virtual_stages - 1
        if isinstance(prefetch_recvs, bool) or not isinstance(prefetch_recvs, int) or prefetch_recvs < 0:
            raise ValueError(f"prefetch_recvs={prefetch_recvs!r} must be an integer >= 0")
        self.prefetch_recvs = prefetch_recvs
        self._recv_order = [a for a in self.actions if a.kind in ("RECV_ACT", "RECV_GRAD")]
        self._recv_index = {a: i for i, a in enumerate(self._recv_order)}
        # The backward that completes each chunk's gradient accumulation.
        last_b: dict[int, Action] = {}
        for a in self.actions:
            if a.kind == "B":
                last_b[a.chunk] = a
        self._completing_backwards = set(last_b.values())
        self._final_backward = [a for a in self.actions if a.kind == "B"][-1]
        self._param_storages = {
            p.untyped_storage().data_ptr() for c in self.chunks for p in c.parameters() if p.device.type != "meta"
        }

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
            missing = [k for k in MICROBATCH_KEYS if k not in mb]
            if missing:
                raise ValueError(f"microbatch {i} lacks keys {missing}; expected {MICROBATCH_KEYS}")
            for key in ("input_ids", "labels"):
                if tuple(mb[key].shape) != want:
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
        m = self.num_microbatches
        inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activations (require grad)
        outputs: dict[tuple[int, int], torch.Tensor] = {}  # chunk outputs (scaled loss on the last chunk)
        stored_bytes: dict[tuple[int, int], int] = {}
        grads_in: dict[tuple[int, int], torch.Tensor] = {}
        grads_out: dict[tuple[int, int], torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        timeline: list[tuple[Action, float, float]] = []
        pending: list[Action] = []
        peak_live = peak_bytes = 0
        busy = comm_time = 0.0
        posted_upto = consumed = 0  # receives self._recv_order[:posted_upto] are posted, [:consumed] used
        t0 = time.perf_counter()

        def flush() -> None:
            sends, recvs = [], []
            for a in pending:
                key = (a.microbatch, a.chunk)
                if a.kind == "SEND_ACT":
                    sends.append((a, outputs[key]))
                elif a.kind == "SEND_GRAD":
                    sends.append((a, grads_out.pop(key)))
                else:
                    recvs.append(a)
            nonlocal posted_upto, consumed, comm_time
            # Post every receive up to K past the ones needed now, in schedule order.
            consumed = max([self._recv_index[a] + 1 for a in recvs], default=consumed)
            horizon = max(posted_upto, consumed + self.prefetch_recvs)
            prefetch = self._recv_order[posted_upto:horizon]
            posted_upto = horizon
            start = time.perf_counter()
            got = self.p2p.exchange(sends, recvs, prefetch)
            for a, tensor in got.items():
                key = (a.microbatch, a.chunk)
                if a.kind == "RECV_ACT":
                    inputs[key] = tensor.requires_grad_(True)
                else:
                    grads_in[key] = tensor
            end = time.perf_counter()
            comm_time += end - start
            for a in pending:
                timeline.append((a, start - t0, end - t0))
            pending.clear()

        for action in self.actions:
            if not action.is_compute:
                pending.append(action)
                continue
            if pending:
                flush()
            key = (action.microbatch, action.chunk)
            vs = self._virtual(action.chunk)
            start = time.perf_counter()
            if action.kind == "F":
                mb = microbatches[action.microbatch]
                is_last = vs == self._last_virtual
                x = mb["input_ids"] if vs == 0 else inputs[key]
                saved = _SavedBytes(self._param_storages)
                with saved.recording():
                    out = self.chunks[action.chunk](
                        x, mb["labels"] if is_last else None, sample_ids=mb["sample_ids"], step=step
                    )
                if is_last:
                    losses.append(out.detach())
                    out = out * (loss_scale / m)
                else:
                    saved.add(out)
                if vs > 0:
                    saved.add(inputs[key])
                outputs[key] = out
                stored_bytes[key] = saved.total
                peak_live = max(peak_live, len(outputs))
                peak_bytes = max(peak_bytes, sum(stored_bytes.values()))
            else:
                if self.grad_sync is not None:
                    self.grad_sync.prepare(action in self._completing_backwards)
                out = outputs.pop(key)
                grad = None if vs == self._last_virtual else grads_in.pop(key)
                torch.autograd.backward(out, grad_tensors=grad)
                del out, grad
                stored_bytes.pop(key)
                inp = inputs.pop(key, None)
                if vs > 0:
                    if inp.grad is None:
                        raise RuntimeError(
                            f"rank {self.pstate.rank}: chunk {action.chunk}'s output does not depend on its input"
                        )
                    grads_out[key] = inp.grad
                if self.grad_sync is not None and action == self._final_backward:
                    self.grad_sync.finish()
            end = time.perf_counter()
            busy += end - start
            timeline.append((action, start - t0, end - t0))
        if pending:
            flush()
        self.p2p.wait_sends()
        if outputs or inputs or grads_in or grads_out:
            raise RuntimeError(f"rank {self.pstate.rank}: activations left after the step (schedule bug)")
        if self.grad_sync is None:
            sync_tied_embedding_grads(self.chunks, self.pstate)
        loss = torch.stack(losses).float().mean().item() if losses else None
        return StepResult(
            loss=loss,
            step_time=time.perf_counter() - t0,
            busy_time=busy,
            peak_live_activations=peak_live,
            peak_activation_bytes=peak_bytes,
            num_microbatches=m,
            comm_time=comm_time,
            timeline=timeline,
        )
