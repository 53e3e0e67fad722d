"""A rank-process entry for the fault fuzz: ``parallel3d.train`` with ONE real function wrapped on ONE rank.

Launched by torchrun in place of ``-m parallel3d.train`` (``tests/fault_fuzz.py``); ``$P3D_FUZZ_FAULT`` is a
JSON ``Fault`` (rank, step, point, how, marker). On the named rank only, the framework's own function for
``point`` is wrapped so that, in step ``step`` (1-based), it first writes ``marker`` (what fired, when) and then
misbehaves ``how``; every other rank runs the unmodified CLI. Nothing in ``parallel3d`` knows about it.

Points (each the real callee, wrapped on the class or module the framework calls it through):
``data`` the training batch iterator's ``__next__``; ``forward`` / ``backward`` the pipeline executor's
compute actions; ``p2p`` the pipeline's send/receive posting; ``reduce_scatter`` / ``all_gather`` the ZeRO
collectives in ``parallel3d.comm``; ``optimizer`` ``ZeroOptimizer.step``; ``save`` the rank's checkpoint data write
(``checkpoint_io.state._FileWriter.write_data``, in the background thread under ``train.async_save``);
``eval`` ``Evaluator.evaluate``.
Hows: ``exception`` (``InjectedFault``), ``sigkill`` (the process killed), ``hang`` (the calling thread
blocks forever; other threads, the heartbeat's included, go on), ``sigstop`` (the whole process frozen).

Invariant: a fault fires at most once per process, and only on ``rank``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from typing import Any, Callable

POINTS = ("data", "forward", "backward", "p2p", "reduce_scatter", "all_gather", "optimizer", "save", "eval")
HOWS = ("exception", "sigkill", "hang", "sigstop")
ENV = "P3D_FUZZ_FAULT"


class InjectedFault(RuntimeError):
    """The exception a fault of ``how=exception`` raises."""


def _misbehave(fault: dict[str, Any]) -> None:
    """Record that the fault fired, then do it (see module doc)."""
    with open(fault["marker"], "w") as fh:
        json.dump({**fault, "time": time.time(), "pid": os.getpid(), "thread": threading.current_thread().name}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    how = fault["how"]
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "hang":
        threading.Event().wait()  # blocks this thread for good (signals are only recorded by the handlers)
    raise InjectedFault(f"injected at {fault['point']} in step {fault['step']} on rank {fault['rank']}")


def _wrap(owner: Any, name: str, when: Callable[..., bool], fire: Callable[[], None]) -> None:
    """Replace ``owner.name`` by a wrapper that calls ``fire()`` first whenever ``when(*args)`` holds."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            fire()
        return real(*args, **kwargs)

    setattr(owner, name, wrapper)


def install(fault: dict[str, Any]) -> None:
    """Wrap ``fault['point']``'s function in this process (call only on the faulty rank)."""
    from parallel3d import comm
    from parallel3d.checkpoint import step_dir
    from parallel3d.checkpoint_io import state
    from parallel3d.data.batches import DistributedBatchIterator
    from parallel3d.eval import Evaluator
    from parallel3d.pipeline.engine import PipelineEngine
    from parallel3d.pipeline.p2p import PipelineP2P
    from parallel3d.pipeline.step_run import StepRun
    from parallel3d.trainer import Trainer
    from parallel3d.zero import ZeroOptimizer

    k, point = int(fault["step"]), fault["point"]
    seen: dict[str, Any] = {"trainer": None, "in_step": False, "fired": False}  # this process's view of the run

    def fire() -> None:
        seen["fired"] = True
        _misbehave(fault)

    def armed() -> bool:
        trainer = seen["trainer"]
        return not seen["fired"] and trainer is not None and trainer.step + 1 == k

    def in_step(*_: Any, **__: Any) -> bool:  # inside step k's pipeline step or optimizer step
        return seen["in_step"] and armed()

    def track(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        @functools.wraps(real)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen["in_step"] = True
            try:
                return real(*args, **kwargs)
            finally:
                seen["in_step"] = False

        setattr(owner, name, wrapper)

    real_init = Trainer.__init__

    @functools.wraps(real_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        seen["trainer"] = self

    Trainer.__init__ = init
    track(PipelineEngine, "run_step")
    track(ZeroOptimizer, "step")
    if point == "data":
        _wrap(DistributedBatchIterator, "__next__",
              lambda it, *a, **kw: armed() and it is seen["trainer"].batches, fire)
    elif point == "forward":
        _wrap(StepRun, "forward", in_step, fire)
    elif point == "backward":
        _wrap(StepRun, "backward", in_step, fire)
    elif point == "p2p":
        _wrap(PipelineP2P, "post", in_step, fire)
    elif point in ("reduce_scatter", "all_gather"):
        for name in (f"{point}_tensor" if point == "reduce_scatter" else "all_gather_into_tensor", f"{point}_exchange"):
            _wrap(comm, name, in_step, fire)
    elif point == "optimizer":
        _wrap(ZeroOptimizer, "step", lambda *a, **kw: armed(), fire)
    elif point == "save":  # the rank's data write, inside DCP's protocol; its directory is <step_dir(k)>.tmp/<state>
        tmp = os.path.basename(step_dir("", k)) + ".tmp"
        _wrap(state._FileWriter, "write_data",
              lambda w, *a, **kw: not seen["fired"] and os.path.basename(os.path.dirname(str(w.path))) == tmp, fire)
    elif point == "eval":
        _wrap(Evaluator, "evaluate", lambda ev, step, *a, **kw: not seen["fired"] and step == k, fire)
    else:
        raise ValueError(f"unknown point {point!r} (one of {POINTS})")


def main() -> None:
    spec = os.environ.get(ENV)
    if spec:
        fault = json.loads(spec)
        if int(os.environ.get("RANK", "0")) == int(fault["rank"]):
            install(fault)
    from parallel3d.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()
