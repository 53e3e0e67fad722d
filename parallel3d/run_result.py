"""A training run as a whole, on one rank: its outcome (``TrainResult``, what ``trainer.train`` returns), the banner
it prints as it starts and the summary it builds as it ends (``summary.RunSummary``).

Invariant: only the logging rank prints either; ``run_summary`` is collective (every rank passes its peak memory
through ``summary.per_rank_values``) and returns the summary on the logging rank alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from parallel3d.checkpoint import step_dir
from parallel3d.config import ResolvedJob
from parallel3d.metrics import ThroughputModel, memory_snapshot
from parallel3d.parallel_state import ParallelState
from parallel3d.progress import RunClock
from parallel3d.summary import RunSummary, per_rank_values


@dataclass
class TrainResult:
    """What ``train`` returns on every rank (records only on the logging rank)."""

    rank: int
    start_step: int  # steps already done when this run started (0 unless resumed)
    last_step: int
    records: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)  # steps saved successfully
    wall_time: float = 0.0
    summary: RunSummary | None = None  # logging rank only
    stopped: str | None = None  # why the run stopped before its end (signal, time budget), checkpointed


def banner(rj: ResolvedJob, chunks: Sequence[torch.nn.Module], device: torch.device, resume_dir: str | None,
           step: int) -> str:
    """The run's first line: model, layout, batch, precision, this rank's parameters, where the weights come from."""
    t, p = rj.job.train, rj.job.parallel
    n = sum(param.numel() for c in chunks for param in c.parameters())
    return (
        f"parallel3d: {rj.model.name or rj.model.arch} | {rj.topology.describe()} | zero_stage="
        f"{p.zero_stage}{'' if p.offload == 'none' else f' offload={p.offload}'} | "
        f"schedule={p.schedule} | global_batch="
        f"{t.global_batch_size} = micro {t.micro_batch_size} x accum {rj.grad_accum} x dp {rj.topology.dp} | "
        f"seq {t.seq_len} | {t.precision} on {device} | params on this rank {n:,} | "
        + (f"resumed from {resume_dir} at step {step}" if resume_dir else
           f"weights from {t.init_from}" if t.init_from else "fresh start")
    )


def run_summary(rj: ResolvedJob, pstate: ParallelState, result: TrainResult, clock: RunClock,
                throughput: ThroughputModel, checkpoint_root: str, extra_outputs: list[str]) -> RunSummary | None:
    """Collective (per-rank peak memory); the summary on the logging rank, None elsewhere."""
    peaks = per_rank_values(memory_snapshot(pstate.device)["mem_peak_bytes"], pstate)
    if not pstate.is_logging_rank():
        return None
    steps = result.last_step - result.start_step
    tp = throughput
    tflops = tp.model_flops_per_step * steps / clock.train_seconds / tp.world_size / 1e12 \
        if steps and clock.train_seconds > 0 else None
    evals = [(r["step"], r["eval_loss"]) for r in result.records if r.get("eval_loss") is not None]
    losses = [r["loss"] for r in result.records if r.get("loss") is not None]
    return RunSummary(
        steps=steps, first_step=result.start_step, last_step=result.last_step,
        total_steps=rj.job.train.steps, tokens=steps * tp.tokens_per_step, wall_seconds=result.wall_time,
        train_seconds=clock.train_seconds, tflops_per_device=tflops,
        mfu=tflops / tp.peak_tflops if tflops is not None and tp.peak_tflops else None, peak_bytes=peaks,
        out_dir=rj.job.train.out_dir, best_eval=min(evals, key=lambda e: e[1]) if evals else None,
        last_eval=evals[-1] if evals else None, final_loss=losses[-1] if losses else None,
        checkpoint=step_dir(checkpoint_root, result.checkpoints[-1]) if result.checkpoints else None,
        extra_outputs=extra_outputs,
    )
