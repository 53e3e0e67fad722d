"""Run a function in a child process whose Triton interprets kernels on the CPU.

Triton fixes compiled-vs-interpreted mode when it is imported, so a process that already
imported triton normally (a pytest run, a trainer) cannot interpret kernels. Tests call

    result = run_interpreted(fn, *args, timeout=120)

which runs the module-level ``fn(*args)`` in a spawned worker started with
``TRITON_INTERPRET=1`` (one torch thread, flush-denormal on) and returns its (picklable)
result; an exception in the worker is re-raised here (same type, the worker's traceback
attached as a note). The
worker is reused by later calls, so its start-up (~3 s) is paid once per test session.
This module imports neither triton nor the kernels, so the worker imports them only after
the environment is set.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import multiprocessing as mp
import os
import pickle
import traceback
from typing import Any, Callable


def _init_worker() -> None:
    import sys

    if "triton" in sys.modules:  # pragma: no cover - would make every kernel fail at launch
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set in the worker")
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)


def _call(fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any, str]:
    try:
        return True, fn(*args, **kwargs), ""
    except Exception as exc:
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(repr(exc))
        return False, exc, traceback.format_exc()


class InterpreterWorker:
    """One spawned process with TRITON_INTERPRET=1 that runs submitted functions in order."""

    def __init__(self) -> None:
        self.pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"), initializer=_init_worker)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> Any:
        ok, payload, worker_traceback = self.pool.submit(_call, fn, args, kwargs).result(timeout=timeout)
        if not ok:
            # Same exception type as in the worker, so tests can pytest.raises(...) on it.
            payload.add_note(f"raised by {fn.__name__} in the Triton-interpreter worker:\n{worker_traceback}")
            raise payload
        return payload

    def close(self) -> None:
        procs = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                proc.kill()


_WORKERS: dict[str, InterpreterWorker] = {}  # test-helper cache (one worker), not framework state


def _shutdown() -> None:
    for worker in _WORKERS.values():
        worker.close()
    _WORKERS.clear()


atexit.register(_shutdown)


def run_interpreted(fn: Callable, *args: Any, timeout: float = 120.0, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in the shared TRITON_INTERPRET=1 worker; see the module docstring."""
    worker = _WORKERS.get("interpreter")
    if worker is None:
        worker = _WORKERS["interpreter"] = InterpreterWorker()
    try:
        return worker.run(fn, args, kwargs, timeout)
    except (cf.TimeoutError, cf.process.BrokenProcessPool):
        # A hung or dead worker is replaced so later tests start clean.
        _WORKERS.pop("interpreter", None)
        worker.close()
        raise
