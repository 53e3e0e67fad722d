"""Stop a diverged run instead of letting it skip steps and keep checkpointing (``train.on_nonfinite``).

Invariant: every rank reaches the same verdict at the same step, with no communication of its own:
the verdict reads only ``StepInfo`` (the gradient norm is a global reduction, so ``skipped`` and
``loss_scale`` are equal on every rank) and the loss scaler's settings. ``stop`` (default) ends the
job when a skipped step cannot be an fp16 overflow the scaler will absorb:

- without a dynamic loss scale (fp32, bf16): the first non-finite gradient norm;
- fp16: an overflow at the scaler's floor (``LossScaler.min_scale``: it cannot lower the scale any
  more), or ``max_consecutive_skips`` skipped steps in a row.

The trainer checks before anything of the step is saved, so no checkpoint of the diverged step (or
after it) is written and none is rotated out because of it. Every rank raising ``TrainingDiverged`` at
that same step, the ranks meet once more after the logging rank printed its line (``exit_together``): a
launcher stops the job at the first rank that exits, and the logging rank's line says why. An update
that turns the weights non-finite has a finite gradient norm itself (the next step's norm shows it),
so a step about to be saved also checks its state (``saving_verdict``: one pass over this rank's shard
and one world all-reduce, at saves only). ``skip`` keeps the old behaviour (skip the step, warn, go on, save).

The count of skipped steps in a row is trainer state (``state_dict``): a run resumed every N steps
counts on as one uninterrupted run would, so a run that keeps overflowing still reaches the limit.
What a user reads: a step the run skips and goes on from is one warning from the logging rank
(``after_step``); the step it stops on has no such warning, only the stop line (``stop_run``), which
the CLI prints last (``parallel3d.train``).
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist

from parallel3d import comm, user_warnings
from parallel3d.parallel_state import ParallelState
from parallel3d.zero.optimizer import StepInfo, ZeroOptimizer
from parallel3d.zero.owned import STATE_KINDS
from parallel3d.zero.precision import LossScaler

# fp16: an overflow halves the scale, so the default start (2^16) reaches the floor (1.0) in 16 skips;
# twice that many in a row means the scale is not what is failing, whatever the floor is set to.
MAX_CONSECUTIVE_SKIPS = 32
SKIPS_KEY = "consecutive_skips"  # in the trainer state of a checkpoint (absent before session 43)


class TrainingDiverged(RuntimeError):
    """The run diverged (non-finite gradients or state) under ``train.on_nonfinite=stop``: the job ends with status 1.
    ``says_why``: this rank's message is the full stop line (the logging rank's); the others' is a pointer to it."""

    def __init__(self, message: str, says_why: bool) -> None:
        super().__init__(message)
        self.says_why = says_why


class DivergenceGuard:
    """Counts skipped steps and says when the run must stop (see module doc); ``announce``: this rank
    (the logging rank) warns about the skipped steps the run goes on from."""

    def __init__(self, policy: str, scaler: LossScaler, max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS,
                 announce: bool = False) -> None:
        self.policy, self.scaler, self.max_consecutive_skips = policy, scaler, max_consecutive_skips
        self.announce = announce
        self.consecutive_skips = 0

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs to count on (merged into the trainer state)."""
        return {SKIPS_KEY: self.consecutive_skips}

    def load_state_dict(self, trainer_state: dict) -> None:
        """Count on from a checkpoint's trainer state; one written before the count was saved counts from 0."""
        if SKIPS_KEY in trainer_state:
            self.consecutive_skips = int(trainer_state[SKIPS_KEY])
            return
        self.consecutive_skips = 0
        if self.announce:  # one note for the job, not one per rank
            user_warnings.warn(f"the checkpoint of step {trainer_state.get('step')} predates the saved skip count: "
                               f"this run counts consecutive skipped steps from 0 (train.on_nonfinite stops at "
                               f"{self.max_consecutive_skips} in a row)")

    def after_step(self, step: int, info: StepInfo) -> str | None:
        """``verdict``, and the warning for a skipped step the run goes on from (the logging rank's)."""
        reason = self.verdict(info)
        if reason is None and info.skipped and self.announce:
            scale = f"; loss scale {info.loss_scale:g} -> {self.scaler.scale:g}" if self.scaler.enabled else ""
            limit = (f"; the run stops at {self.max_consecutive_skips} in a row or at an overflow at the loss "
                     f"scale's floor {self.scaler.min_scale:g}" if self.policy == "stop" else
                     "; train.on_nonfinite=skip goes on")
            user_warnings.warn(f"step {step} skipped: gradient norm {info.grad_norm:g}{scale} "
                               f"({self.consecutive_skips} in a row{limit})")
        return reason

    def verdict(self, info: StepInfo) -> str | None:
        """Why the run must stop after the step that returned ``info``, or None to go on."""
        if not info.skipped:
            self.consecutive_skips = 0
            return None
        self.consecutive_skips += 1
        if self.policy == "skip":
            return None
        if not self.scaler.enabled:
            return "non-finite gradient norm (no dynamic loss scale to lower: fp32/bf16)"
        if info.loss_scale <= self.scaler.min_scale:
            return f"fp16 overflow at the loss scale's floor ({self.scaler.min_scale:g}): it cannot be lowered further"
        if self.consecutive_skips >= self.max_consecutive_skips:
            return f"{self.consecutive_skips} consecutive fp16 overflow steps skipped"
        return None

    def saving_verdict(self, opt: ZeroOptimizer, pstate: ParallelState) -> str | None:
        """Collective (with ``stop``): why the state about to be saved must not be, or None to save it."""
        if self.policy == "skip" or state_is_finite(opt, pstate):
            return None
        return "the weights or optimizer state after this step are not finite (its update overflowed them)"


def state_is_finite(opt: ZeroOptimizer, pstate: ParallelState) -> bool:
    """Collective over the world: whether every rank's master weights and Adam moments are all finite."""
    mine = all(bool(torch.isfinite(seg.state(kind)).all()) for seg in opt.owned_segments() for kind in STATE_KINDS)
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=pstate.device)
    comm.all_reduce_world(flag, pstate, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def exit_together(pstate: ParallelState) -> None:
    """Collective, every rank once at a divergence stop: return when the logging rank has printed its line (the
    others print theirs first, or nothing under torchrun). torchrun (srun too) stops the job at the first rank that
    exits, so without it the logging rank's line, the one naming the cause, was lost whenever another rank got
    out first (a loaded node)."""
    if pstate.world_size <= 1:
        return
    try:
        comm.all_reduce_world(torch.zeros(1, device=pstate.device), pstate)
    except RuntimeError:  # a peer already gone (killed): nothing left to wait for, the job exits 1 anyway
        pass


def stop_run(step: int, reason: str, loss: float | None, info: StepInfo, last_checkpoint: str | None,
             says_why: bool) -> NoReturn:
    """End the run on every rank: the full ``stop_line`` where ``says_why`` (the logging rank), a pointer elsewhere."""
    raise TrainingDiverged(stop_line(step, reason, loss, info, last_checkpoint) if says_why else
                           f"training diverged at step {step} (the logging rank's line says why)", says_why)


def stop_line(step: int, reason: str, loss: float | None, info: StepInfo, last_checkpoint: str | None) -> str:
    """The one line the logging rank's failure shows: the step, loss, grad norm, where to resume, what to try."""
    loss_text = "n/a" if loss is None else f"{loss:.6g}"
    resume = (f"the last checkpoint written is {last_checkpoint} (train.resume=auto resumes from it)"
              if last_checkpoint else "no checkpoint was written")
    return (f"training diverged at step {step}: {reason}; loss {loss_text}, grad norm {info.grad_norm:.6g}, "
            f"lr {info.lr:.6g}; stopped without saving; {resume}; try a lower optimizer.lr, optimizer.clip_grad > 0, "
            f"or train.on_nonfinite=skip to skip such steps instead")

