"""Forward-only execution of the pipeline: the loss of a batch without gradients (evaluation).

``ForwardOnlyRunner.run`` walks this stage's part of ``schedules.build_forward_schedule``
(on the training schedule's chunk placement) with the same plan machinery as training
(``step_plan.compile_plan``, one ``PipelineP2P`` batch per plan step, the same message
shape): receive activations, run the chunk under ``torch.no_grad`` with the chunks in
eval mode (dropout off), send; at a turn of ZB-V's V the output goes to the next chunk
on this stage directly. Microbatches follow the training contract (``pipeline.microbatch.stage_keys``).

Invariant: the returned loss is the mean over the batch's microbatches of each
microbatch's mean token loss, on last-stage ranks (``None`` elsewhere), the same
quantity ``PipelineEngine.run_step`` reports for training, so it equals the
single-process number on every layout (up to summation order). Nothing is kept
between calls; the chunks' train/eval modes are restored afterwards.

As in the engine, the constructor proves the plan deadlock-free under the backend's
p2p semantics (``check_coalesced_progress``; no receives ahead where batches coalesce).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from parallel3d.pipeline.actions import ScheduleError, default_prefetch
from parallel3d.pipeline.engine import send_loss_to_last_stage
from parallel3d.pipeline.microbatch import TOKEN_KEYS, document_kwargs, stage_keys
from parallel3d.pipeline.p2p import MessageSpec, PipelineP2P
from parallel3d.pipeline.placement import placement_for
from parallel3d.pipeline.schedules import build_forward_schedule, check_coalesced_progress
from parallel3d.pipeline.step_plan import compile_plan

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


@contextmanager
def eval_mode(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Chunks in eval mode (dropout off) and no autograd graph; previous modes restored after."""
    modes = [c.training for c in chunks]
    try:
        for c in chunks:
            c.eval()
        with torch.no_grad():
            yield
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)


class ForwardOnlyRunner:
    """Runs forward-only steps of this rank's stage; ``chunks[c]`` is local chunk ``c`` of the placement
    ``schedule`` (the training schedule) runs on (``PipelineEngine``)."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        pstate: "ParallelState",
        *,
        num_microbatches: int,
        micro_batch_size: int,
        seq_len: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
        prefetch_recvs: int | None = None,
        schedule: str = "1f1b",
    ) -> None:
        self.chunks = list(chunks)
        self.pstate = pstate
        self.num_microbatches = num_microbatches
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        p, v = pstate.size("pp"), len(self.chunks)
        coalesces = pstate.p2p_coalesces
        self.placement = placement_for(schedule, p, v)
        full = build_forward_schedule(p, num_microbatches, v, coalesced_p2p=coalesces, placement=self.placement.kind)
        self.prefetch_recvs = default_prefetch(coalesces) if prefetch_recvs is None else prefetch_recvs
        try:
            check_coalesced_progress(full, prefetch=self.prefetch_recvs, coalesced=coalesces,
                                     wait_sent_activations=False)
        except ScheduleError as exc:
            raise ValueError(f"forward-only schedule, prefetch_recvs={self.prefetch_recvs}, {pstate}: {exc}") from exc
        self.actions = full[pstate.coord("pp")]
        spec = MessageSpec.from_config(micro_batch_size=micro_batch_size, seq_len=seq_len, hidden_size=hidden_size,
                                       dtype=dtype, tp_size=pstate.size("tp"), sequence_parallel=sequence_parallel)
        self.p2p = PipelineP2P(pstate, spec, v, self.placement)
        self.plan = compile_plan(self.actions, pstate.coord("pp"), self.placement, self.chunks, self.prefetch_recvs,
                                 self.p2p.peer)
        held = self.placement.chunks_of(pstate.coord("pp"))
        self.keys = stage_keys(0 in held, self.placement.total - 1 in held)

    def _check(self, microbatches: Sequence[dict[str, Any]]) -> None:
        if len(microbatches) != self.num_microbatches:
            raise ValueError(f"forward-only step got {len(microbatches)} microbatches, built for "
                             f"{self.num_microbatches}")
        want = (self.micro_batch_size, self.seq_len)
        for i, mb in enumerate(microbatches):
            missing = [k for k in self.keys if k not in mb]
            if missing:
                raise ValueError(f"rank {self.pstate.rank}: eval microbatch {i} lacks keys {missing}; this stage "
                                 f"reads {self.keys} (pipeline.microbatch.stage_keys)")
            for key in TOKEN_KEYS:
                if key in self.keys and tuple(mb[key].shape) != want:
                    raise ValueError(f"eval microbatch {i}: {key} has shape {tuple(mb[key].shape)}, expected {list(want)}")

    def run(self, microbatches: Sequence[dict[str, Any]], *, step: int = 0) -> float | None:
        """Forward every microbatch once (collective over the pipeline); the mean loss on the last stage."""
        self._check(microbatches)
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        p2p = self.p2p
        with eval_mode(self.chunks):
            for planned in self.plan:
                if planned.communicates:
                    p2p.post([(a, outputs.pop(key), peer) for a, key, peer in planned.sends], planned.posts)
                    for recv in planned.ahead:
                        p2p.post_recv(*recv)
                    for a in planned.needs:
                        inputs[(a.microbatch, a.chunk)] = p2p.take(a)
                c = planned.compute
                if c is None:
                    continue
                mb = microbatches[c.microbatch]
                x = mb["input_ids"] if c.first else outputs.pop(c.local_input) if c.local_input else inputs.pop(c.key)
                out = c.module(x, mb["labels"] if c.last else None, sample_ids=mb["sample_ids"], step=step,
                               **document_kwargs(mb))
                if c.last:
                    losses.append(out.float())
                else:
                    outputs[c.key] = out
                p2p.release_sent()
            p2p.wait_sends()
        if outputs or inputs:
            raise RuntimeError(f"rank {self.pstate.rank}: activations left after a forward-only step (schedule bug)")
        loss = torch.stack(losses).mean().item() if losses else None
        return send_loss_to_last_stage(loss, self.placement, self.pstate)
