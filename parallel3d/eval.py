"""Validation loss during training: ``train.eval_iters`` global batches, forward only, through the pipeline.

``Evaluator.evaluate`` is collective (every rank calls it at the same step). Evaluation
batch ``i`` is validation samples ``[i*G, (i+1)*G)`` (``G = train.global_batch_size``),
the same samples at every evaluation and on every layout, split over DP ranks and into
microbatches exactly like training batches (``DistributedBatchIterator``; each stage gets
the keys ``pipeline.microbatch.stage_keys`` names). Each batch runs through
``pipeline.forward_only.ForwardOnlyRunner`` (dropout off, no graph).

Invariant: ``eval_loss`` = mean over the ``eval_iters`` batches of the batch's mean
per-token loss (mean over DP ranks of the runner's microbatch mean), i.e. what one
process computes for the same samples; ``eval_ppl = exp(eval_loss)``. An evaluation that
``interrupt`` stops (a preemption signal or the time budget, agreed by every rank before each
batch) reports no loss at all rather than the mean of the batches it ran: a partial mean is
not comparable with the other evaluations.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from parallel3d import comm, data, user_warnings
from parallel3d.config import ResolvedJob
from parallel3d.pipeline.forward_only import ForwardOnlyRunner
from parallel3d.pipeline.microbatch import with_documents
from parallel3d.zero.precision import precision_dtype

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


@dataclass(frozen=True)
class EvalResult:
    loss: float | None  # eval loss on last-stage ranks, None elsewhere (and None when interrupted)
    seconds: float
    interrupted: str | None = None  # why the evaluation stopped early (the same on every rank), None if it ran whole
    batches: int = 0  # evaluation batches run

    def metrics(self) -> dict[str, float]:
        """The JSONL / W&B keys of the logged step."""
        if self.loss is None:
            return {}
        return {"eval_loss": self.loss, "eval_ppl": math.exp(min(self.loss, 700.0)), "eval_time": self.seconds}


class Evaluator:
    """Evaluates this rank's model chunks on the validation set; see module doc."""

    def __init__(self, rj: ResolvedJob, pstate: "ParallelState", chunks: list[torch.nn.Module],
                 dataset: data.GPTDataset, to_device: Callable, eod_id: int | None = None) -> None:
        t, p = rj.job.train, rj.job.parallel
        self.pstate = pstate
        self.iters = t.eval_iters
        self.to_device = to_device
        self.runner = ForwardOnlyRunner(
            chunks, pstate, num_microbatches=rj.grad_accum, micro_batch_size=t.micro_batch_size,
            seq_len=t.seq_len // p.cp,
            hidden_size=rj.model.hidden_size, dtype=precision_dtype(t.precision), sequence_parallel=p.sequence_parallel,
            schedule=p.schedule,
        )
        self.batches = data.DistributedBatchIterator.for_rank(dataset, pstate, t.global_batch_size,
                                                              t.micro_batch_size, eod_id=eod_id,
                                                              keys=with_documents(self.runner.keys, eod_id is not None))
        wanted = self.iters * t.global_batch_size
        if wanted > dataset.samples_per_epoch and pstate.rank == 0:
            user_warnings.warn(f"the validation set has {dataset.samples_per_epoch} samples of seq_len={t.seq_len}; "
                               f"train.eval_iters={self.iters} reads {wanted}, so some are read twice")

    def evaluate(self, step: int, interrupt: Callable[[], str | None] | None = None) -> EvalResult:
        """Collective: the validation loss of the current weights (``step`` only seeds nothing: dropout is off).

        ``interrupt`` (collective, the same answer on every rank: ``StopPolicy.should_stop``) is asked before
        each batch; a reason ends the evaluation there, so a preemption signal or the time budget is not held
        up by ``eval_iters`` forward passes (the job then saves and stops at this step)."""
        start = time.perf_counter()
        self.batches.load_state_dict({"next_sample": 0}, strict=False)
        total, last_stage = 0.0, False
        for i in range(self.iters):
            reason = interrupt() if interrupt is not None else None
            if reason is not None:
                return EvalResult(None, time.perf_counter() - start, interrupted=reason, batches=i)
            loss = self.runner.run(self.to_device(next(self.batches)), step=step)
            if loss is not None:
                total += loss
                last_stage = True
        mean = None
        if last_stage:
            t = torch.tensor([total / self.iters], dtype=torch.float64, device=self.pstate.device)
            comm.all_reduce(t, self.pstate, "dp_cp")  # token-weighted over cp too (models.transformer's loss)
            mean = t.item() / comm.group_size(self.pstate, "dp_cp")
        return EvalResult(mean, time.perf_counter() - start, batches=self.iters)
