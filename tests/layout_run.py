"""Running one layout-matrix case and comparing it with the single-process run (``layout_matrix`` draws them).

``run_case`` trains a drawn ``LayoutCase`` on its gloo ranks through the real ``Trainer`` and its (cached)
single-process reference, and returns a ``CaseResult``: the two curves of (step, loss, grad norm, eval loss),
equal when every step's three numbers agree within ``layout_matrix.RTOL`` (relative;
per step ``CaseResult.rtol_by_step`` where ``tests/noise_floor.py`` re-judged it at a drawn shape's noise floor).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Iterator

from parallel3d.config import job_from_dict, resolve
from tests.layout_matrix import RTOL, LayoutCase, reference_values


# ---- running and comparing ---------------------------------------------------------------


@dataclass
class CaseResult:
    case: LayoutCase
    curve: list[tuple[int, float, float, float | None]]  # (step, loss, grad_norm, eval_loss or None)
    reference: list[tuple[int, float, float, float | None]]
    seconds: float = 0.0
    error: str | None = None
    worst: dict[str, float] = field(default_factory=dict)
    # step -> relative tolerance where it is not RTOL (tests/noise_floor.py: a drawn shape's own noise floor)
    rtol_by_step: dict[int, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems()

    def problems(self) -> list[str]:
        if self.error is not None:
            return [self.error]
        steps = [c[0] for c in self.curve]
        if steps != [c[0] for c in self.reference]:
            return [f"steps {steps} != reference {[c[0] for c in self.reference]}"]
        evals = [c[0] for c in self.curve if c[3] is not None]
        if evals != [c[0] for c in self.reference if c[3] is not None] or not evals:
            return [f"evaluated at steps {evals} != reference {[c[0] for c in self.reference if c[3] is not None]}"]
        out = []
        for (step, loss, gnorm, ev), (_, rloss, rgnorm, rev) in zip(self.curve, self.reference):
            pairs = [("loss", loss, rloss), ("grad_norm", gnorm, rgnorm)]
            if rev is not None:
                pairs.append(("eval_loss", ev, rev))
            rtol = self.rtol_by_step.get(step, RTOL)
            for what, got, ref in pairs:
                rel = abs(got - ref) / abs(ref) if ref else abs(got)
                self.worst[what] = max(self.worst.get(what, 0.0), rel)
                if not math.isfinite(got) or rel > rtol:
                    out.append(f"step {step} {what} {got!r} vs reference {ref!r} (rel {rel:.2e} > {rtol:.1e})")
        return out


def curve_of(records: list[dict]) -> list[tuple[int, float, float, float | None]]:
    return [(r["step"], float(r["loss"]), float(r["grad_norm"]),
             None if r.get("eval_loss") is None else float(r["eval_loss"])) for r in records]


@contextlib.contextmanager
def silenced(quiet: bool) -> Iterator[None]:
    if not quiet:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


def train_records_on_rank(rank: int, world: int, values: dict, quiet: bool = False,
                          emulate_nccl: bool = False) -> list[dict]:
    """``run_on_ranks`` target: the real Trainer on this rank; its step records on the logging rank."""
    from parallel3d.parallel_state import ParallelState
    from parallel3d.trainer import train

    rj = resolve(job_from_dict(values), world)
    with silenced(quiet):
        return train(rj, ParallelState(rj.topology, emulate_nccl=emulate_nccl)).records


def train_case_on_rank(rank: int, world: int, values: dict, quiet: bool = False,
                       emulate_nccl: bool = False) -> list[tuple[int, float, float, float | None]]:
    """``run_on_ranks`` target: the real Trainer on this rank; the curve on the logging rank."""
    return curve_of(train_records_on_rank(rank, world, values, quiet, emulate_nccl))


def reference_records(values: dict, quiet: bool = False) -> list[dict]:
    """The single-process run's step records."""
    from parallel3d.parallel_state import ParallelState
    from parallel3d.trainer import train

    rj = resolve(job_from_dict(values), 1)
    with silenced(quiet):
        return train(rj, ParallelState.single_process()).records


def train_reference(values: dict, quiet: bool = False) -> list[tuple[int, float, float, float | None]]:
    return curve_of(reference_records(values, quiet))


def run_case(case: LayoutCase, work_dir: str, cache_dir: str, references: dict, *, timeout: float = 300.0,
             quiet: bool = False) -> CaseResult:
    """Train ``case`` on its ranks and compare with its (cached) single-process reference.

    ``work_dir`` must be fresh (runs start with ``train.resume=none``)."""
    import time

    from tests.harness import run_on_ranks

    key = case.reference_key()
    if key not in references:
        ref_dir = os.path.join(work_dir, "ref-" + "-".join(map(str, key)))  # one directory per reference
        references[key] = train_reference(reference_values(case, ref_dir, cache_dir), quiet)
    out = os.path.join(work_dir, case.name)
    start = time.perf_counter()
    try:
        per_rank = run_on_ranks(train_case_on_rank, case.world_size, case.values(out, cache_dir), quiet,
                                case.emulate_nccl, timeout=timeout)
        curve = next(c for c in per_rank if c)
        return CaseResult(case, curve, references[key], time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - reported per case, the matrix goes on
        return CaseResult(case, [], references[key], time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
