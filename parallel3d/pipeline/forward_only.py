"""Forward-only execution of the pipeline: the loss of a batch without gradients (evaluation).

``ForwardOnlyRunner.run`` walks this stage's part of ``schedules.build_forward_schedule``
with the same communication plan machinery as training (``actions.comm_plan``, one
``PipelineP2P`` batch per plan step, the same message shape): receive activations,
run the chunk under ``torch.no_grad`` with the chunks in eval mode (dropout off),
send. Microbatches follow the training contract (``pipeline.microbatch.stage_keys``).

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

from parallel3d.pipeline.actions import ScheduleError, comm_plan, virtual_stage
from parallel3d.pipeline.microbatch import TOKEN_KEYS, stage_keys
from parallel3d.pipeline.p2p import MessageSpec, PipelineP2P
from parallel3d.pipeline.schedules import build_forward_schedule, check_coalesced_progress

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
    """Runs forward-only steps of this rank's stage; ``chunks[c]`` is model chunk ``pp_rank + c * pp``."""

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
    ) -> None:
        self.chunks = list(chunks)
        self.pstate = pstate
        self.num_microbatches = num_microbatches
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        p, v = pstate.size("pp"), len(self.chunks)
        coalesces = pstate.p2p_coalesces
        full = build_forward_schedule(p, num_microbatches, v, coalesced_p2p=coalesces)
        self.prefetch_recvs = (0 if coalesces else 2) if prefetch_recvs is None else prefetch_recvs
        try:
            check_coalesced_progress(full, prefetch=self.prefetch_recvs, coalesced=coalesces,
                                     wait_sent_activations=False)
        except ScheduleError as exc:
            raise ValueError(f"forward-only schedule, prefetch_recvs={self.prefetch_recvs}, {pstate}: {exc}") from exc
        self.actions = full[pstate.coord("pp")]
        self.plan = comm_plan(self.actions, self.prefetch_recvs)
        spec = MessageSpec.from_config(micro_batch_size=micro_batch_size, seq_len=seq_len, hidden_size=hidden_size,
                                       dtype=dtype, tp_size=pstate.size("tp"), sequence_parallel=sequence_parallel)
        self.p2p = PipelineP2P(pstate, spec, v)
        self.keys = stage_keys(pstate.is_first_stage, pstate.is_last_stage)
        self._last_virtual = p * v - 1

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
        with eval_mode(self.chunks):
            for plan_step in self.plan:
                sends = [(a, outputs.pop((a.microbatch, a.chunk))) for a in plan_step.batch if a.kind == "SEND_ACT"]
                if plan_step.batch or plan_step.ahead or plan_step.needs:
                    for a, tensor in self.p2p.exchange(sends, plan_step.needs, plan_step.ahead).items():
                        inputs[(a.microbatch, a.chunk)] = tensor
                action = plan_step.compute
                if action is None:
                    continue
                vs = virtual_stage(self.pstate.coord("pp"), action.chunk, self.pstate.size("pp"))
                mb = microbatches[action.microbatch]
                key = (action.microbatch, action.chunk)
                x = mb["input_ids"] if vs == 0 else inputs.pop(key)
                is_last = vs == self._last_virtual
                out = self.chunks[action.chunk](x, mb["labels"] if is_last else None, sample_ids=mb["sample_ids"],
                                                step=step)
                if is_last:
                    losses.append(out.float())
                else:
                    outputs[key] = out
                self.p2p.release_sent()
            self.p2p.wait_sends()
        if outputs or inputs:
            raise RuntimeError(f"rank {self.pstate.rank}: activations left after a forward-only step (schedule bug)")
        return torch.stack(losses).mean().item() if losses else None
