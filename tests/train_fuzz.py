"""Drawn layouts trained with drawn options (precision, clipping, decay, warm-up, ...) equal one process.

The layout matrix (``tests/layout_matrix.py``) and the shape fuzz check the layouts in fp32 with the default
optimizer options. Here ``generate(case_id)`` draws a layout-matrix layout (``layout_matrix.generate_case``:
tp, pp with every schedule, dp, cp with cp_comm, ep on an MoE model, ZeRO 0-3, offload) together with the
training options users run: ``train.precision`` (fp32 / bf16 / fp16, from the schema's ``PRECISIONS``),
``optimizer.clip_grad`` (off, ``SMALL_CLIP`` which clips at every step, 1.0), weight decay, warm-up, lr, the
evaluation cadence, dropout, the gradients' reduction dtype (``parallel.grad_reduce_dtype``: fp32 or the
precision), ``parallel.overlap_param_gather``, ``parallel.split_drain`` where it applies (session 44), and for
fp16 the initial loss scale (``LOSS_SCALES``: 2^20 overflows in 4 steps).
Every draw comes from an RNG seeded by ``TRAIN_SEED`` and the id alone: a case is reproduced by its id.

Invariant, per case (``run``):
- the layout's curve (loss, grad norm, eval loss per step) matches ONE process with the SAME options and
  precision; fp32 within ``layout_matrix.RTOL`` (a miss judged again at its noise floor, ``noise_floor.judge``);
- bf16 / fp16 within ``noise_floor.tolerance(floor)`` per step, where ``floor`` is the half-precision single
  process's own distance from the fp32 single process up to that step (its whole rounding error, measured per
  case; fp16: at the default scale, which overflows nowhere here: a power-of-two scale rounds nothing).
  Re-batching the half-precision reference (fp32's floor) is no floor here: bf16 rounds each micro-batch's
  matmuls alike whatever the batching (step 1: 2e-6), while tp rounds its partial sums (step 1: 1.6e-4);
- an MoE case in half precision that misses passes only as a top-k near tie (``tests/train_fuzz_ties.py``:
  every flip up to its failing step within the score rounding, and the layout in fp32 agreeing), said so;
- the layout stays within the same per-step tolerance of the fp32 single process (a broken cast, or fp16
  scaling not undone on some stage, leaves it), up to its first skipped step;
- fp16: the layout skips (overflow, loss scale halved) the steps the single process skips (a skipped step's
  grad norm, inf or nan, is not compared). Overflow is a property of one rank's fp16 values in one
  micro-batch's backward: a weight gradient sums its micro-batch's tokens (at a 2^20 scale one process skips
  step 2 with 8 samples per micro-batch, step 4 with 1), and the backward's seed is loss_scale / micro-batches
  per dp rank, dp times the single process's. So an fp16 reference runs the case's micro-batch size (as a
  capacity-dropping MoE reference does) from dp times the case's scale; without that, dp=2 and dp=4 layouts
  skipped steps 1 (and 2) that one process did not (cases 9, 26; docs/testing.md, "Training options on drawn layouts").
  With cp > 1 no reference scale makes the fp16 values one process's: each cp rank's loss is cp times its
  share (the reduction averages over dp x cp: ``parallel3d/moe_step.py``), so its activation gradients are cp
  times the single process's while its weight gradients sum 1/cp of the tokens. At 2^20, case 33 (cp=2)
  skipped steps [2, 4] against one process's [4]; with the reference at cp x the scale, cases 24 and 57
  skipped [1] vs [1, 2] and [4] vs [2]. So a cp > 1 case runs fp16 at the default scale, which overflows
  nowhere here (its rounding is still judged); overflow with dp (and ep, tp) keeps its drawn scale.
  Likewise fp16 gradient accumulation (``parallel.grad_reduce_dtype=fp16``) over dp > 1: the reference's
  accumulated gradient sums dp times the micro-batches of a rank's (each rank divides by dp before its
  reduction), so at 2^20 case 36 (dp=2) skipped [1] vs one process's [1, 4]. At the overflowing scale with
  dp > 1 the gradients reduce in fp32 (``_one_process_overflows_alike``); fp16 reduction is drawn elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from parallel3d.pipeline.options import AUTO, SPLIT_DRAIN_VALUES, drain_is_split
from parallel3d.zero.options import PRECISIONS, OptimizerOptions
from tests import layout_matrix as lm
from tests import layout_run as lr
from tests import noise_floor as nf

TRAIN_SEED = 20261207
MAX_WORLD = 4  # a drawn case trains three runs (its layout, two references) on 2 cores
LAYOUT_BASE, MOE_LAYOUT_BASE = 1_000, lm.MOE_BASE + 1_000  # layout ids apart from the matrix's (dense: < COVER_BASE)
MOE_SHARE = 0.25
# The matrix models' grad norms are 1.2 - 1.5 over the first steps: 0.1 clips at every step (1.0 at most).
SMALL_CLIP = 0.1
CLIPS = (0.0, SMALL_CLIP, 1.0)
WEIGHT_DECAYS = (0.0, 0.1)
WARMUPS = (0, 1, 2)
LRS = (lm.LR, lm.LR / 3)
EVAL_EVERYS = (0, lm.EVAL_EVERY)  # 0: evaluate at the end only
DROPOUTS = (0.0, 0.1)
DEFAULT_SCALE = int(OptimizerOptions.loss_scale_init)
LOSS_SCALES = (DEFAULT_SCALE, 2**20)  # fp16: the default start (no overflow in 4 steps here), one that overflows
OVERLAP_PARAM_GATHER = (True, False)  # parallel.overlap_param_gather's two values (ZeRO 1/2)
ALL_CASES = 30
MAX_DRAWS = 200


@dataclass(frozen=True)
class TrainCase(lm.LayoutCase):
    """A layout-matrix case with drawn training options (``options``: precision and optimizer/train keys)."""

    options: dict[str, Any] = field(default_factory=dict)

    @property
    def precision(self) -> str:
        return self.options["precision"]

    @property
    def name(self) -> str:
        o = self.options
        bits = [o["precision"], f"clip{o['clip_grad']:g}", f"wd{o['weight_decay']:g}", f"wu{o['warmup_steps']}",
                f"lr{o['lr']:.0e}", f"ev{o['eval_every']}", f"do{o['dropout']:g}"]
        if o["precision"] == "fp16":
            bits.append(f"ls2^{int(o['loss_scale_init']).bit_length() - 1}")
        if o["grad_reduce_dtype"] != "fp32":
            bits.append(f"gr-{o['grad_reduce_dtype']}")
        if not o["overlap_param_gather"]:
            bits.append("no-gather-overlap")
        return super().name + "-" + "-".join(bits)

    def job(self, parallel: dict, train: dict, out_dir: str, cache_dir: str) -> dict[str, Any]:
        values = super().job(parallel, train, out_dir, cache_dir)
        o = self.options
        values["model"] = dict(values["model"], dropout=o["dropout"])
        values["train"].update(precision=o["precision"], eval_every=o["eval_every"])
        values["parallel"] = dict(values["parallel"], grad_reduce_dtype=o["grad_reduce_dtype"],
                                  overlap_param_gather=o["overlap_param_gather"])
        # The backward's seed is loss_scale / (micro-batches per dp rank) (the dp mean is taken by the reduction):
        # a job with fewer dp ranks than the case's starts at a scale that many times larger, so its fp16 values,
        # which decide an overflow, are the case's (a power of two: exact, nothing else changes).
        scale = o["loss_scale_init"] * self.parallel["dp"] // parallel.get("dp", 1)
        values["optimizer"].update(lr=o["lr"], min_lr=o["lr"] / 10, warmup_steps=o["warmup_steps"],
                                   weight_decay=o["weight_decay"], clip_grad=o["clip_grad"],
                                   loss_scale_init=float(scale))
        return values

    def reference_micro_batch_size(self) -> int:
        return self.train["micro_batch_size"] if self.precision == "fp16" else super().reference_micro_batch_size()

    def reference_key(self) -> tuple:
        return (*super().reference_key(), tuple(sorted(self.options.items())), self.reference_micro_batch_size())

    def in_fp32(self) -> "TrainCase":
        """The same case in fp32 (its single process is the half-precision cases' yardstick)."""
        return dataclasses.replace(self, options=dict(self.options, precision="fp32", loss_scale_init=DEFAULT_SCALE,
                                                      grad_reduce_dtype="fp32"))

    def at_default_scale(self) -> "TrainCase":
        """The same case at fp16's default start, which overflows in none of these runs: its single process
        measures the case's fp16 rounding (a power-of-two scale is exact) where the case's own skips steps."""
        return dataclasses.replace(self, options=dict(self.options, loss_scale_init=DEFAULT_SCALE))


def _options(rng: random.Random) -> dict[str, Any]:
    precision = rng.choice(PRECISIONS)
    options = {"precision": precision, "clip_grad": rng.choice(CLIPS), "weight_decay": rng.choice(WEIGHT_DECAYS),
               "warmup_steps": rng.choice(WARMUPS), "lr": rng.choice(LRS), "eval_every": rng.choice(EVAL_EVERYS),
               "dropout": rng.choice(DROPOUTS),
               "loss_scale_init": rng.choice(LOSS_SCALES) if precision == "fp16" else DEFAULT_SCALE}
    # The gradients' reduction dtype (fp32 main grads or the training precision) and ZeRO 1/2's parameter
    # all-gather overlapped with the next forward or not: from a fork of the RNG, so the draws above and after
    # keep their values (every case drawn before these existed keeps its layout and its other options).
    fork = random.Random(repr(rng.getstate()))
    return dict(options, grad_reduce_dtype=fork.choice(sorted({"fp32", precision})),
                overlap_param_gather=fork.choice(OVERLAP_PARAM_GATHER))


def _one_process_overflows_alike(options: dict[str, Any], layout: lm.LayoutCase) -> dict[str, Any]:
    """``options`` where one process can hold the layout's fp16 values, so that its overflows must be the
    layout's (module doc): the default scale with cp > 1; fp32 gradient accumulation at the overflowing scale
    with dp > 1."""
    if layout.parallel.get("cp", 1) > 1:
        options = dict(options, loss_scale_init=DEFAULT_SCALE)
    if options["loss_scale_init"] > DEFAULT_SCALE and layout.parallel["dp"] > 1:
        options = dict(options, grad_reduce_dtype="fp32")
    return options


def _with_split_drain(rng: random.Random, layout: lm.LayoutCase) -> dict[str, Any]:
    """``layout.parallel`` with ``parallel.split_drain`` drawn from all its values where the option applies (where
    ``auto`` splits: 1F1B or interleaved without full recompute), else as drawn (the matrix's dense draw: auto)."""
    p = layout.parallel
    if not drain_is_split(p["schedule"], AUTO, layout.train["recompute"]):
        return p
    return dict(p, split_drain=rng.choice(SPLIT_DRAIN_VALUES))


def _affordable(c: lm.LayoutCase, max_world: int = MAX_WORLD) -> bool:
    """Within the world budget, no capacity drops (their reference is per micro-batch already; near-tie
    routing flips would need a floor of their own) and CI's microbatch budget."""
    return c.world_size <= max_world and c.capacity is None and lm.affordable_for_ci(c, "")


@functools.lru_cache(maxsize=None)
def generate(case_id: int, max_world: int = MAX_WORLD) -> TrainCase:
    """Case ``case_id``: a drawn layout (MoE with odds ``MOE_SHARE``) with drawn options the validator accepts.
    ``max_world`` above ``MAX_WORLD`` (``check_train_fuzz.py --max-world``) widens the layouts' world budget: the
    same id then draws another case wherever its first affordable layout had more ranks than ``MAX_WORLD``."""
    rng = random.Random(f"{TRAIN_SEED}:{case_id}")
    moe = rng.random() < MOE_SHARE
    layout = lm.generate_case((MOE_LAYOUT_BASE if moe else LAYOUT_BASE) + case_id,
                              lambda c: _affordable(c, max_world))
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(lm.LayoutCase)}
    fields["parallel"] = _with_split_drain(random.Random(f"{TRAIN_SEED}:{case_id}:split_drain"), layout)
    for _ in range(MAX_DRAWS):
        case = TrainCase(**dict(fields, case_id=case_id), options=_one_process_overflows_alike(_options(rng), layout))
        if lm.is_valid(case):
            return case
    raise RuntimeError(f"train-fuzz case {case_id}: no valid options in {MAX_DRAWS} draws")


def all_cases() -> list[TrainCase]:
    return [generate(i) for i in range(ALL_CASES)]


@dataclass
class TrainResult:
    """A case against its same-precision single process (``same``) and the fp32 one."""

    same: lr.CaseResult
    fp32_problems: list[str]
    skipped: list[int]  # steps the layout skipped (fp16 overflow)
    reference_skipped: list[int]
    floors: dict[int, float]  # step -> the tolerance's measured floor (empty: fp32 met RTOL)
    # tests/train_fuzz_ties.py: a half-precision MoE miss accepted as a top-k near tie (the verdict), or why not
    near_tie: str = ""
    tie_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        curve_ok = bool(self.near_tie) or (self.same.ok and not self.fp32_problems)
        return curve_ok and self.skipped == self.reference_skipped

    def problems(self) -> list[str]:
        """The curve's misses (listed also when accepted as a near tie: ``near_tie`` says so) and the rest."""
        out = list(self.same.problems()) + [f"vs fp32: {p}" for p in self.fp32_problems]
        if self.skipped != self.reference_skipped:
            out.append(f"skipped steps {self.skipped} != the single process's {self.reference_skipped}")
        return out + self.tie_problems


def _skipped(records: list[dict]) -> list[int]:
    return [r["step"] for r in records if r["skipped"]]


def _finite(records: list[dict], skipped: set[int]) -> list:
    """The curve with the grad norm of ``skipped`` steps (skipped by both runs: compared as skips) as 0: an
    overflow's norm is inf or nan, as its arithmetic happens to go."""
    return [(c[0], c[1], 0.0 if c[0] in skipped else c[2], c[3]) for c in lr.curve_of(records)]


def _reference(case: TrainCase, work_dir: str, cache_dir: str, references: dict) -> list[dict]:
    key = case.reference_key()
    if key not in references:
        out = os.path.join(work_dir, f"ref-{len(references)}")
        references[key] = lr.reference_records(lm.reference_values(case, out, cache_dir), quiet=True)
    return references[key]


def half_precision_floors(half: list, fp32: list, skipped: list[int]) -> dict[int, float]:
    """step -> the half-precision single process's distance from the fp32 one up to that step; from its
    first skipped step on (fp32 skips none) the last floor before it."""
    first_skip = min(skipped, default=None)
    measured = nf.floors([c for c in half if first_skip is None or c[0] < first_skip], fp32)
    last = max(measured.values(), default=0.0)
    return {c[0]: measured.get(c[0], last) for c in half}


def _fp32_problems(curve: list, fp32: list, rtols: dict[int, float], skipped: list[int]) -> list[str]:
    out, first_skip = [], min(skipped, default=None)
    for got, ref in zip(curve, fp32):
        if first_skip is not None and got[0] >= first_skip:
            break
        for what, a, b in zip(("loss", "grad_norm", "eval_loss"), got[1:], ref[1:]):
            if b is not None and abs(a - b) > rtols[got[0]] * abs(b):
                out.append(f"step {got[0]} {what} {a!r} vs fp32 {b!r} (rel {abs(a - b) / abs(b):.2e} > "
                           f"{rtols[got[0]]:.1e})")
    return out


def run(case: TrainCase, work_dir: str, cache_dir: str, references: dict, *, timeout: float = 300.0) -> TrainResult:
    """Train ``case`` on its ranks and judge it against its references (see module doc)."""
    from tests.harness import run_on_ranks

    same = _reference(case, work_dir, cache_dir, references)
    fp32 = same if case.precision == "fp32" else _reference(case.in_fp32(), work_dir, cache_dir, references)
    start = time.perf_counter()
    out = os.path.join(work_dir, case.name)
    try:
        per_rank = run_on_ranks(lr.train_records_on_rank, case.world_size, case.values(out, cache_dir), True,
                                case.emulate_nccl, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - reported per case, the fuzz goes on
        result = lr.CaseResult(case, [], lr.curve_of(same), time.perf_counter() - start,
                               error=f"{type(exc).__name__}: {exc}")
        return TrainResult(result, [], [], _skipped(same), {})
    records = next(r for r in per_rank if r)
    both = set(_skipped(records)) & set(_skipped(same))
    result = lr.CaseResult(case, _finite(records, both), _finite(same, both), time.perf_counter() - start)
    if case.precision == "fp32":
        result, floors = nf.judge(result, os.path.join(work_dir, case.name + "-floor"), cache_dir)
        return TrainResult(result, [], _skipped(records), _skipped(same), floors)
    rounding = same if case.precision == "bf16" else _reference(case.at_default_scale(), work_dir, cache_dir, references)
    floors = half_precision_floors(lr.curve_of(rounding), lr.curve_of(fp32), _skipped(rounding))
    rtols = {step: nf.tolerance(f) for step, f in floors.items()}
    result = dataclasses.replace(result, rtol_by_step=rtols)
    return TrainResult(result, _fp32_problems(result.curve, lr.curve_of(fp32), rtols, _skipped(same)),
                       _skipped(records), _skipped(same), floors)
