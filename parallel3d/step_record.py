"""One optimizer step's metrics record: loss over dp x cp, throughput, memory, bubble, bytes per group.

Invariant: ``record`` and ``comm_delta`` are called by every rank at the same steps (the reductions
inside are collective over the world and over dp x cp); only the logging rank (last stage, tp=0,
dp=0: it holds the loss) gets a record back, every other rank None. Memory keys carry the max and
min over ranks, bytes the sum, the bubble the mean over ranks, MoE load the max.
"""

from __future__ import annotations

from typing import Any

import torch

from parallel3d import comm
from parallel3d.metrics import ThroughputModel, memory_snapshot, reduce_over_world
from parallel3d.moe_step import MoEStep
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import GROUP_KINDS
from parallel3d.zero import ZeroOptimizer


class StepRecorder:
    """Builds the per-step record from the engine's and optimizer's results on this rank."""

    def __init__(self, pstate: ParallelState, optimizer: ZeroOptimizer, moe: MoEStep, throughput: ThroughputModel,
                 is_logging_rank: bool) -> None:
        self.pstate, self.optimizer, self.moe, self.throughput = pstate, optimizer, moe, throughput
        self.is_logging_rank = is_logging_rank

    def dp_mean_loss(self, loss: float | None) -> float | None:
        """Mean loss of the global batch (last stage only; other stages have none). Over dp x cp: each
        cp rank's loss is cp times its token share of the sequence's (``models.transformer``)."""
        if loss is None:
            return None
        t = torch.tensor([loss], dtype=torch.float64, device=self.pstate.device)
        comm.all_reduce(t, self.pstate, "dp_cp")
        return t.item() / comm.group_size(self.pstate, "dp_cp")

    def record(self, step: int, step_time: float, result: Any, info: Any, comm_bytes: dict[str, int]) -> dict[str, Any] | None:
        """Collective: the step's metrics record (on the logging rank; None elsewhere)."""
        loss = self.dp_mean_loss(result.loss)
        # Model-state bytes at their high-water mark during the log interval (inside backward,
        # where e.g. gradients peak), not what is left after the step.
        mem = memory_snapshot(self.pstate.device, self.optimizer.memory_peak_bytes())
        if result.peak_activation_bytes is None:  # _logs_after agreed with the caller: a bug if not
            raise RuntimeError(f"step {step}: logged, but the engine was not asked for its activation bytes")
        mem["mem_activations_bytes"] = result.peak_activation_bytes
        moe = self.moe.per_rank_metrics()
        per_rank = dict(mem, bubble_fraction=result.bubble_fraction,
                        **{f"comm_bytes_{k}": v for k, v in comm_bytes.items()}, **moe)
        reduced = reduce_over_world(per_rank, self.pstate)
        if not self.is_logging_rank:
            return None
        record: dict[str, Any] = {"step": step, "loss": loss, "lr": info.lr, "grad_norm": info.grad_norm,
                                  "loss_scale": info.loss_scale, "skipped": info.skipped}
        record.update(self.throughput.step_metrics(step_time))
        # Without a pipeline there is no bubble: 1 - busy/step would only measure the optimizer step.
        pipelined = comm.group_size(self.pstate, "pp") > 1
        record["bubble_fraction"] = reduced["bubble_fraction"].mean if pipelined else None
        record["comm_bytes"] = sum(reduced[f"comm_bytes_{k}"].sum for k in comm_bytes)
        for k in comm_bytes:
            record[f"comm_bytes_{k}"] = reduced[f"comm_bytes_{k}"].sum
        record.update({key: reduced[key].max for key in moe})
        for key in mem:
            record[f"{key}_max"] = int(reduced[key].max)
            record[f"{key}_min"] = int(reduced[key].min)
        return record

    def comm_delta(self, before: dict[str, int]) -> dict[str, int]:
        """Bytes this rank sent in the step per group kind: every kind whose groups have more than one
        rank (the same keys on every rank), ``world`` (the agreements between steps) excepted."""
        now = self.pstate.comm_stats.by_kind()
        kinds = [k for k in GROUP_KINDS if k != "world" and self.pstate.topology.group_size(k) > 1]
        return {k: now.get(k, 0) - before.get(k, 0) for k in kinds}
