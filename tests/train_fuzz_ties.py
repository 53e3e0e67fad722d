"""The train fuzz's rule for an MoE case in half precision that misses its tolerance through a top-k near tie.

Half precision rounds a layout's router scores differently from one process's (cp's all-to-all, etp's partial
sums), so a token whose k-th and (k+1)-th expert scores are closer than that rounding can pick another expert:
one moved token shifts the step's gradients by more than the rounding's floor (case 431: 1 flip of 1,536 routed
tokens, step-1 grad norm 1.62e-5 against 1.6e-5 allowed; docs/testing.md, "Fresh draws, session 43").

Invariant: such a miss is accepted (``TrainResult.near_tie`` says so, never silently) only when ALL hold:
(a) the two runs' routing (``tests/routing_flips.compare``, the layout against its same-precision single
process) flips at least one token up to the last failing step, and every flip there is a near tie: its margin
within the score rounding the unflipped tokens show; (b) the same layout in fp32 meets the fp32 rule against
its own single process (``train_fuzz.run``: RTOL, then its noise floor); (c) the same-precision single process
routed as the layout (``routing_flips``' ``forced``: every token to the layout's experts) meets the case's own
per-step tolerance against the layout: the flips explain the whole miss. A wrong term fails (b) (fp32 carries it
as well), (c) (a term wrong in the half-precision path only: fp32 agrees, and the flips a moved score brings are
as narrow as the rounding it inflates) or (a) (no flip to blame, or a flip wider than the rounding); the verdict
names each condition that failed. Anything else (dense, fp32, an error, different skipped steps) is judged as
before.
"""

from __future__ import annotations

import dataclasses
import os
import re

from tests import layout_matrix as lm
from tests import routing_flips as rf
from tests import train_fuzz as tf

_STEP = re.compile(r"\bstep (\d+)\b")


def applies(case: tf.TrainCase, result: tf.TrainResult) -> bool:
    """An MoE case in half precision whose curve missed (not an error, not a skip mismatch)."""
    return ("moe" in case.model_values() and case.precision != "fp32" and not result.ok
            and result.same.error is None and result.skipped == result.reference_skipped)


def failing_steps(result: tf.TrainResult) -> list[int]:
    """The steps named by the result's problems (each problem line names its step: ``layout_run.CaseResult``)."""
    return sorted({int(m) for p in result.problems() for m in _STEP.findall(p)})


def routing_problems(case: tf.TrainCase, result: tf.TrainResult, upto: int, work_dir: str, cache_dir: str,
                     timeout: float, references: dict) -> tuple[str, list[str]]:
    """Conditions (a) and (c): a summary of the flips up to step ``upto`` and, for each that fails, why.
    The single process's routing record is kept in ``references`` (``train_fuzz.run``'s cache) by its reference key."""
    from tests.harness import run_on_ranks

    out = os.path.join(work_dir, case.name + "-routing")
    layout = rf.merged(run_on_ranks(rf.record_on_rank, case.world_size, case.values(out, cache_dir), False,
                                    timeout=timeout))
    key = ("routing", *case.reference_key())
    if key not in references:
        references[key] = rf.merged([rf.record_on_rank(0, 1, lm.reference_values(case, out + "-one", cache_dir))])
    one = references[key]
    routing = rf.compare(layout[1], one[1], layout[2], one[2])
    # The routing keys count the trainer's steps from 0 (``run.step``), the curve from 1: map them in order.
    curve_steps = [c[0] for c in layout[0]]
    if len(routing) != len(curve_steps):
        raise ValueError(f"{len(routing)} routed steps for a curve of steps {curve_steps}")
    summary, problems = routing_verdict([dataclasses.replace(s, step=c) for s, c in zip(routing, curve_steps)], upto)
    replay = rf.record_on_rank(0, 1, lm.reference_values(case, out + "-replay", cache_dir), forced=layout[2])[0]
    return summary, problems + replay_problems(result, replay)


def replay_problems(result: tf.TrainResult, replay: list) -> list[str]:
    """Condition (c): the layout's curve against ``replay`` (the single process routed as the layout) at the
    result's own per-step tolerance, on the steps the result compared."""
    steps = {c[0] for c in result.same.curve}
    check = dataclasses.replace(result.same, reference=[c for c in replay if c[0] in steps], worst={})
    return [f"(c) routed as the layout, the single process still differs: {p}" for p in check.problems()]


def routing_verdict(routing: list[rf.StepRouting], upto: int) -> tuple[str, list[str]]:
    """Condition (a) on ``routing`` (curve steps): a summary of the flips up to ``upto`` and, if it fails, why."""
    steps = [s for s in routing if s.step <= upto]
    flips = [(s, f) for s in steps for f in s.flips]
    summary = (f"{len(flips)} flips of {sum(s.tokens for s in steps)} routed tokens up to step {upto}, widest margin "
               f"{max((f.margin for _, f in flips), default=0.0):.1e}, score rounding "
               f"{max((s.rounding for s in steps), default=0.0):.1e}")
    if not flips:
        return summary, [f"(a) no top-k flip up to step {upto}: the miss is not a near tie"]
    wide = [f"step {s.step} token {f.key[1:]} margin {f.margin:.1e} > rounding {s.rounding:.1e}"
            for s, f in flips if f.margin > s.rounding]
    return summary, [f"(a) flips wider than the rounding: {'; '.join(wide[:5])}"] if wide else []


def rejudge(case: tf.TrainCase, result: tf.TrainResult, work_dir: str, cache_dir: str, references: dict, *,
            timeout: float = 300.0) -> tf.TrainResult:
    """``result`` accepted as a near tie when (a) and (b) hold (module doc); otherwise ``result`` with the
    failed conditions in ``tie_problems``."""
    if not applies(case, result):
        return result
    upto = max(failing_steps(result))
    summary, problems = routing_problems(case, result, upto, work_dir, cache_dir, timeout, references)
    fp32 = tf.run(case.in_fp32(), work_dir, cache_dir, references, timeout=timeout)
    if not fp32.ok:
        problems.append(f"(b) the layout in fp32 misses its single process: {'; '.join(fp32.problems())[:500]}")
    if problems:
        return dataclasses.replace(result, tie_problems=[f"not a near tie ({summary})", *problems])
    worst = fp32.same.worst.get("grad_norm", 0.0)
    return dataclasses.replace(result, near_tie=f"accepted as a top-k near tie: {summary}; "
                                                f"the layout in fp32 agrees (worst grad norm {worst:.1e}), and so does the single "
                                                f"process routed as the layout")


def run(case: tf.TrainCase, work_dir: str, cache_dir: str, references: dict, *, timeout: float = 300.0) -> tf.TrainResult:
    """``train_fuzz.run`` and, for a half-precision MoE miss, the near-tie rule."""
    result = tf.run(case, work_dir, cache_dir, references, timeout=timeout)
    return rejudge(case, result, work_dir, cache_dir, references, timeout=timeout)
