"""Progress of long work: the run's elapsed time and ETA, checkpoint lines, and progress bars.

- ``RunClock`` (logging rank): elapsed time since the run started and the ETA of the
  rest, from this run's mean time per training step (data, step, logging and
  checkpoints included; evaluation apart) plus the evaluations still to come at
  their mean cost.
- ``checkpoint_line``: what the console says when a checkpoint is complete (path,
  size on disk, seconds).
- ``progress``: a tqdm bar over an iterable for data work (corpus building, tokenizer
  training, ``scripts/preprocess_data.py``) on the one process that does it. On a
  terminal it redraws in place; elsewhere (logs, CI) it prints one line when the work
  starts and one when it ends, instead of carriage-return noise.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, TypeVar

T = TypeVar("T")


def format_duration(seconds: float) -> str:
    """``42.0s``, ``3m05s``, ``2h07m`` (for humans; JSONL keeps seconds)."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class RunClock:
    """Elapsed time and ETA of one run (steps ``start_step + 1 .. end_step``); see module doc."""

    def __init__(self, start_step: int, end_step: int, *, eval_every: int = 0, evaluating: bool = False) -> None:
        self.t0 = time.perf_counter()
        self.start_step, self.end_step = start_step, end_step
        self.eval_every, self.evaluating = eval_every, evaluating
        self.train_seconds = 0.0
        self.train_steps = 0
        self.eval_seconds = 0.0
        self.evals = 0

    def add_step(self, seconds: float) -> None:
        self.train_seconds += seconds
        self.train_steps += 1

    def add_eval(self, seconds: float) -> None:
        self.eval_seconds += seconds
        self.evals += 1

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def evals_after(self, step: int) -> int:
        """Evaluations still to run after ``step`` (every ``eval_every`` and at the end)."""
        if not self.evaluating or step >= self.end_step:
            return 0
        regular = (self.end_step // self.eval_every - step // self.eval_every) if self.eval_every else 0
        return regular + (0 if self.eval_every and self.end_step % self.eval_every == 0 else 1)

    def eta(self, step: int) -> float | None:
        """Seconds until ``end_step``; None before the first step of this run is timed."""
        if self.train_steps == 0:
            return None
        per_step = self.train_seconds / self.train_steps
        eta = (self.end_step - step) * per_step
        if self.evals:
            eta += self.evals_after(step) * self.eval_seconds / self.evals
        return eta

    def metrics(self, step: int) -> dict[str, float | None]:
        return {"elapsed_s": self.elapsed(), "eta_s": self.eta(step)}


def directory_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass  # pruned meanwhile
    return total


def checkpoint_line(step: int, path: str, seconds: float) -> str:
    return f"checkpoint step {step}: {path} ({format_bytes(directory_bytes(path))}, {seconds:.1f}s)"


def stderr_is_terminal() -> bool:
    return _is_terminal(sys.stderr)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _LineProgress:
    """What a progress bar prints off a terminal: a start line and an end line."""

    def __init__(self, desc: str, unit: str, stream: Any) -> None:
        self.desc, self.unit, self.stream = desc, unit, stream
        self.n = 0
        self.postfix = ""
        self.t0 = time.perf_counter()
        print(f"{desc} ...", file=stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self, outcome: str = "done,") -> None:
        secs = time.perf_counter() - self.t0
        extra = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {outcome} {self.n:,} {self.unit}{extra} in {format_duration(secs)}", file=self.stream,
              flush=True)


@contextmanager
def progress_bar(desc: str, *, total: int | None = None, unit: str = "it", enabled: bool = True,
                 unit_scale: bool = False) -> Iterator[Any]:
    """A bar with ``update(n)`` / ``set_postfix_str``; a no-op object when not ``enabled``."""
    stream = sys.stderr
    if not enabled:
        bar: Any = _Silent()
    elif _is_terminal(stream):
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=stream, dynamic_ncols=True,
                   mininterval=0.5)
    else:
        bar = _LineProgress(desc, unit, stream)
    outcome = "done,"
    try:
        yield bar
    except BaseException:  # an error (its line follows), Ctrl-C, or a consumer that stopped early: not done
        outcome = "stopped after"
        raise
    finally:
        bar.close(outcome) if isinstance(bar, _LineProgress) else bar.close()


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress(items: Iterable[T], desc: str, *, total: int | None = None, unit: str = "it",
             enabled: bool = True) -> Iterator[T]:
    """``items`` unchanged, with a progress bar (see ``progress_bar``) while they are consumed."""
    with progress_bar(desc, total=total, unit=unit, enabled=enabled) as bar:
        for item in items:
            yield item
            bar.update(1)
