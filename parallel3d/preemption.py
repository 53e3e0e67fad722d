"""Stopping a run on purpose: a preemption signal or a wall-clock budget, with a checkpoint.

Schedulers announce the end of a job with a signal (SLURM: SIGTERM, then SIGKILL after
``KillWait``; ``--signal=USR1@N`` earlier). ``StopPolicy`` turns that, and the
``train.max_minutes`` budget, into one decision that every rank takes at the same step:

- the signal handler only records the signal (it may arrive on some ranks only, in the
  middle of a step or of a background save; nothing unsafe runs inside it);
- ``should_stop`` is collective and runs at every step boundary: a MAX all-reduce over
  the world (``comm.all_reduce_world``) of "this rank wants to stop", so all ranks
  agree on the step, save it and leave the loop together;
- the budget asks to stop while there is still time for one more step and the save:
  when ``elapsed + 2 * longest iteration so far`` would pass ``max_minutes``.

The process then exits with ``EXIT_STOPPED`` (distinct from 0 = finished, 1 = failed,
2 = bad config), and ``train.resume=auto`` continues from the checkpoint.
Invariant: handlers are installed only between ``install`` and ``uninstall`` (the
previous ones are restored), and only in the main thread.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from parallel3d import comm
from parallel3d.option_checks import ConfigError, as_tuples, check_positive

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

EXIT_STOPPED = 3  # stopped early by a signal or the time budget, checkpointed, resumable
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_names() -> list[str]:
    return sorted(s.name for s in signal.Signals if s.name not in UNCATCHABLE)


@dataclass(frozen=True)
class StopOptions:
    """``train.preempt_signal`` / ``train.max_minutes``, validated (``ConfigError`` naming the key)."""

    # Signals that stop the run at the next step boundary with a checkpoint.
    preempt_signal: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    max_minutes: float | None = None  # wall-clock budget: save and stop before it runs out; null = none

    def __post_init__(self) -> None:
        as_tuples(self)
        names = signal_names()
        signals = self.preempt_signal
        if not isinstance(signals, tuple) or any(s not in names for s in signals):
            raise ConfigError(f"train.preempt_signal={_as_given(signals)!r}: must be a list of signal names from "
                              f"{', '.join(n for n in names if n in ('SIGTERM', 'SIGUSR1', 'SIGUSR2', 'SIGINT', 'SIGHUP'))} "
                              f"... (not SIGKILL/SIGSTOP), or [] for none")
        if self.max_minutes is not None:
            check_positive("train.max_minutes", self.max_minutes, also=" (minutes), or null for no budget")


def _as_given(value: Any) -> Any:
    """A value as the user wrote it (a list), for messages."""
    return list(value) if isinstance(value, tuple) else value


class StopPolicy:
    """When this job should stop early (see module doc); one per Trainer."""

    def __init__(self, pstate: "ParallelState", signals: list[str], max_minutes: float | None,
                 start_time: float | None = None) -> None:
        self.pstate = pstate
        self.signals = [signal.Signals[name] for name in signals]
        self.budget_s = None if max_minutes is None else 60.0 * max_minutes
        self.start = time.monotonic() if start_time is None else start_time
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._longest_iteration = 0.0

    # ---- handlers ------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works in the main thread only; a library caller keeps its handlers
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
            # Restart interrupted system calls: C++ collectives blocked in a socket read must not see EINTR.
            signal.siginterrupt(sig, False)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    # ---- the decision --------------------------------------------------------------------
    def local_reason(self, iteration_s: float) -> str | None:
        """Why this rank wants to stop now (None: it does not)."""
        self._longest_iteration = max(self._longest_iteration, iteration_s)
        if self.received is not None:
            return f"received {self.received.name}"
        if self.budget_s is not None:
            elapsed = time.monotonic() - self.start
            if elapsed + 2 * self._longest_iteration >= self.budget_s:
                return f"train.max_minutes={self.budget_s / 60:g} nearly used ({elapsed / 60:.2f} min elapsed)"
        return None

    def should_stop(self, iteration_s: float) -> str | None:
        """Collective (every rank, every step boundary): the reason to stop, the same on every rank."""
        reason = self.local_reason(iteration_s)
        # The code carries the signal number so every rank names the same signal; a budget stop is 1.
        code = 0 if reason is None else (int(self.received) + 1 if self.received is not None else 1)
        if self.pstate.world_size > 1:
            flag = torch.tensor([code], dtype=torch.int32, device=self.pstate.device)
            comm.all_reduce_world(flag, self.pstate, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        if code == 0:
            return None
        if reason is None:  # another rank asked
            reason = (f"{signal.Signals(code - 1).name} received on another rank" if code > 1
                      else "the time budget on another rank")
        return reason
