"""The end-of-run summary: what the run did, how fast, its best eval loss, memory, where the outputs are.

``per_rank_values`` is collective (every rank calls it): each rank's value lands in its
own slot of a world-sized vector summed over the world (``comm.all_reduce_world``). ``RunSummary`` is built
and printed by the logging rank; its ``wandb`` dict is the W&B run summary.

Numbers (this run only, a resumed run counts from its resume step):
- ``tokens`` = steps x global batch x seq_len; ``tokens_per_sec`` = tokens / the time
  spent in training steps (data, step, logging and checkpoints; evaluation and start-up
  excluded); ``tflops_per_device`` and ``mfu`` from the same time with the FLOPs
  convention of ``metrics.py`` (``mfu`` None when the device's peak is unknown).
- ``peak memory``: the per-rank peak (CUDA: peak allocated; CPU: peak RSS), with the
  ranks holding the largest and smallest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel3d import comm
from parallel3d.progress import format_bytes, format_duration

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def per_rank_values(value: float, pstate: "ParallelState") -> list[float]:
    """Collective: every rank's ``value``, indexed by global rank (float64: exact for byte counts < 2**53)."""
    slots = torch.zeros(pstate.world_size, dtype=torch.float64, device=pstate.device)
    slots[pstate.rank] = float(value)
    comm.all_reduce_world(slots, pstate)
    return slots.tolist()


@dataclass
class RunSummary:
    steps: int
    first_step: int
    last_step: int
    total_steps: int
    tokens: int
    wall_seconds: float
    train_seconds: float
    tflops_per_device: float | None
    mfu: float | None
    peak_bytes: list[float]
    out_dir: str
    best_eval: tuple[int, float] | None = None  # (step, eval_loss)
    last_eval: tuple[int, float] | None = None
    final_loss: float | None = None
    checkpoint: str | None = None
    extra_outputs: list[str] = field(default_factory=list)

    @property
    def tokens_per_sec(self) -> float | None:
        return self.tokens / self.train_seconds if self.train_seconds > 0 else None

    def lines(self) -> list[str]:
        out = [f"run summary: {self.steps} steps this run ({self.first_step} -> {self.last_step} of "
               f"{self.total_steps}), {self.tokens:,} tokens, wall {format_duration(self.wall_seconds)} "
               f"(training steps {format_duration(self.train_seconds)})"]
        speed = []
        if self.tokens_per_sec is not None:
            speed.append(f"mean {self.tokens_per_sec:,.0f} tok/s")
        if self.tflops_per_device is not None:
            speed.append(f"{self.tflops_per_device:.3g} TFLOP/s/dev")
        speed.append(f"MFU {100 * self.mfu:.1f}%" if self.mfu is not None else "MFU n/a (peak unknown: train.peak_tflops)")
        out.append("  throughput: " + ", ".join(speed))
        losses = []
        if self.final_loss is not None:
            losses.append(f"final train loss {self.final_loss:.4f}")
        if self.best_eval is not None:
            losses.append(f"best eval loss {self.best_eval[1]:.4f} at step {self.best_eval[0]}")
        if self.last_eval is not None and self.last_eval != self.best_eval:
            losses.append(f"last eval loss {self.last_eval[1]:.4f} at step {self.last_eval[0]}")
        if losses:
            out.append("  loss: " + ", ".join(losses))
        if self.peak_bytes:
            hi = max(range(len(self.peak_bytes)), key=lambda r: self.peak_bytes[r])
            lo = min(range(len(self.peak_bytes)), key=lambda r: self.peak_bytes[r])
            mem = f"max {format_bytes(self.peak_bytes[hi])} on rank {hi}"
            if len(self.peak_bytes) > 1:
                mem += f", min {format_bytes(self.peak_bytes[lo])} on rank {lo}"
            if 1 < len(self.peak_bytes) <= 8:
                mem += " (" + ", ".join(format_bytes(b) for b in self.peak_bytes) + ")"
            out.append(f"  peak memory per rank: {mem}")
        where = [os.path.join(self.out_dir, "metrics.jsonl")]
        if self.checkpoint:
            where.append(self.checkpoint)
        where += self.extra_outputs
        out.append("  outputs: " + ", ".join(where))
        out.append(f"  picture of the run: python -m parallel3d.report {self.out_dir}")
        return out

    def wandb(self) -> dict[str, Any]:
        peak = max(self.peak_bytes) if self.peak_bytes else None
        return {
            "final_loss": self.final_loss, "steps": self.last_step, "wall_time_s": self.wall_seconds,
            "tokens_this_run": self.tokens, "mean_tokens_per_sec": self.tokens_per_sec, "mean_mfu": self.mfu,
            "best_eval_loss": None if self.best_eval is None else self.best_eval[1],
            "peak_memory_bytes_max": peak,
        }
