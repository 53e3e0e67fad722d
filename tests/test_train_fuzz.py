"""Drawn layouts with drawn training options (bf16 / fp16 / fp32, clipping, decay, warm-up, lr, eval, dropout)
give the single-process curve with the same options (``tests/train_fuzz.py``: the draws and the tolerance rule).

CI runs ``ci_sample()``: the cheapest of ``CI_SCAN`` ids meeting each ``CI_MUST_COVER`` property (a
bf16 tensor-parallel layout with clipping active; an fp16 data-parallel layout at the loss scale
that overflows: it skips step 1, as the single process does; a bf16 / fp16 gradient reduction over dp > 1); the
whole fuzz is ``extended`` (``pytest tests/test_train_fuzz.py --extended``) or, as a table,
``python scripts/check_train_fuzz.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import pytest

from parallel3d.pipeline.options import AUTO, SPLIT_DRAIN_VALUES, drain_is_split
from tests import layout_matrix as lm
from tests import routing_flips as rf
from tests import train_fuzz as tf
from tests import train_fuzz_ties as ties

pytestmark = [pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")]

CI_SCAN = 30
CI_MUST_COVER: dict[str, Callable[[tf.TrainCase], bool]] = {
    "bf16_tp>1_clipping": lambda c: c.precision == "bf16" and c.parallel["tp"] > 1 and c.options["clip_grad"] > 0,
    # dp > 1: the reference starts at dp x the scale (tests/train_fuzz.py), or the skipped steps differ
    "fp16_dp>1_overflowing_scale": lambda c: c.precision == "fp16" and c.parallel["dp"] > 1
    and c.options["loss_scale_init"] == max(tf.LOSS_SCALES),
    # parallel.grad_reduce_dtype in the half precision, reduced over dp > 1 (drawn since session 41)
    "half_precision_grad_reduce_dp>1": lambda c: c.precision != "fp32"
    and c.options["grad_reduce_dtype"] == c.precision and c.parallel["dp"] > 1,
}
# Where a property's scan starts (0 unless named): ids 0-29 draw no half-precision reduction over dp > 1.
CI_SCAN_START = {"half_precision_grad_reduce_dp>1": 90}


@functools.lru_cache(maxsize=1)
def ci_sample() -> tuple[tf.TrainCase, ...]:
    """Per property, the cheapest (``layout_matrix.ci_cost``) case among ``CI_SCAN`` ids from its
    ``CI_SCAN_START`` (0 unless named)."""
    out = []
    for label, where in CI_MUST_COVER.items():
        start = CI_SCAN_START.get(label, 0)
        cases = [tf.generate(i) for i in range(start, start + CI_SCAN)]
        out.append(min((c for c in cases if where(c)), key=lambda c: (lm.ci_cost(c), c.case_id)))
    return tuple(out)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        ci = ci_sample()
        rest = [c for c in tf.all_cases() if c not in ci] if metafunc.config.getoption("--extended") else []
        metafunc.parametrize("case", [*ci, *(pytest.param(c, marks=pytest.mark.extended) for c in rest)],
                             ids=[c.name for c in (*ci, *rest)])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("train_fuzz_corpus"))


@pytest.fixture(scope="module")
def references() -> dict:
    return {}


def test_draws_are_reproducible_by_id_and_cover_every_precision():
    cases = tf.all_cases()
    assert [tf.generate.__wrapped__(c.case_id) for c in ci_sample()] == list(ci_sample())  # drawn again, uncached
    assert {c.precision for c in cases} == set(tf.PRECISIONS)
    assert {c.options["clip_grad"] for c in cases} == set(tf.CLIPS)
    assert any(c.parallel.get("ep", 1) > 1 for c in cases) and any(c.parallel["cp"] > 1 for c in cases)
    # parallel.grad_reduce_dtype: fp32 main grads and the precision's own, for each half precision
    assert {(c.precision, c.options["grad_reduce_dtype"]) for c in cases if c.precision != "fp32"} \
        == {(p, r) for p in tf.PRECISIONS if p != "fp32" for r in ("fp32", p)}
    assert {c.options["overlap_param_gather"] for c in cases if c.parallel["zero_stage"] in (1, 2)
            and c.parallel["dp"] > 1} == set(tf.OVERLAP_PARAM_GATHER)
    # parallel.split_drain: every value where it applies (drawn since session 44; the dense draw left it at auto)
    assert {c.parallel.get("split_drain", AUTO) for c in cases
            if drain_is_split(c.parallel["schedule"], AUTO, c.train["recompute"])} == set(SPLIT_DRAIN_VALUES)
    for c in ci_sample():  # the drawn options reach the job the ranks and the reference train
        for values in (c.values("out", "cache"), lm.reference_values(c, "out", "cache")):
            assert {k: values["parallel"][k] for k in ("grad_reduce_dtype", "overlap_param_gather")} \
                == {k: c.options[k] for k in ("grad_reduce_dtype", "overlap_param_gather")}, c.name
    for c in ci_sample():
        assert lm.is_valid(c), c.name


def test_fp16_overflows_only_where_one_process_holds_the_layouts_values():
    """One process cannot overflow where the layout does with cp > 1 (its activation gradients are cp times one
    process's, its weight gradients 1/cp of the tokens') nor with fp16 gradient accumulation over dp > 1 (one
    process accumulates dp times a rank's micro-batches): tests/train_fuzz.py. So no such case draws the
    overflowing scale; other dp cases still do (the CI sample's fp16 case)."""
    cases = [tf.generate(i) for i in range(tf.ALL_CASES + 40)]
    fp16 = [c for c in cases if c.precision == "fp16"]
    overflowing = [c for c in fp16 if c.options["loss_scale_init"] > tf.DEFAULT_SCALE]
    assert any(c.parallel.get("cp", 1) > 1 for c in fp16) and any(c.options["grad_reduce_dtype"] == "fp16" for c in fp16)
    assert not [c.name for c in overflowing if c.parallel.get("cp", 1) > 1]
    assert not [c.name for c in overflowing if c.parallel["dp"] > 1 and c.options["grad_reduce_dtype"] != "fp32"]
    assert any(c.parallel["dp"] > 1 for c in overflowing)


def test_a_wider_world_budget_draws_larger_layouts_and_leaves_the_rest_as_they_were():
    """``generate(i, max_world)`` (``check_train_fuzz.py --max-world``): the default budget keeps every case within
    ``MAX_WORLD``; a wider one draws larger layouts for some ids, and an id whose wider draw fits the default
    budget is the default's case (the same first affordable draw)."""
    ids = range(600, 612)
    default, wide = [tf.generate(i) for i in ids], [tf.generate(i, 8) for i in ids]
    assert all(c.world_size <= tf.MAX_WORLD for c in default)
    assert all(c.world_size <= 8 for c in wide) and any(c.world_size > tf.MAX_WORLD for c in wide)
    assert [w for w, d in zip(wide, default) if w.world_size <= tf.MAX_WORLD and w != d] == []


def test_half_precision_floor_keeps_the_last_floor_before_a_skipped_step():
    """Steps from the first skipped step on carry the floor measured before it (fp32 skips nothing)."""
    fp32 = [(1, 6.0, 1.0, None), (2, 5.9, 1.1, 5.8), (3, 5.0, 9.0, None)]
    half = [(1, 6.0 * (1 + 1e-4), 1.0, None), (2, 5.9, 1.1 * (1 + 3e-4), 5.8), (3, 5.8, 1.2, None)]
    floors = tf.half_precision_floors(half, fp32, skipped=[3])
    assert floors[1] == pytest.approx(1e-4, rel=1e-6) and floors[2] == pytest.approx(3e-4, rel=1e-6)
    assert floors[3] == floors[2]


@pytest.mark.slow
def test_layout_with_options_matches_single_process(case, tmp_path, cache_dir, references, record_property):
    """Same precision: within RTOL (fp32) or 10 x the measured floor per step (bf16 / fp16); near the fp32 single
    process by the same tolerance; fp16: the same skipped steps. The half-precision reference must really differ
    from the fp32 one (a cast broken everywhere, reference included, would make every layout agree)."""
    result = ties.run(case, str(tmp_path), cache_dir, references)
    record_property("floors", result.floors)
    assert result.ok, f"{case.name} (floors {result.floors}): " + "; ".join(result.problems())
    assert len(result.same.curve) == lm.STEPS
    if case in ci_sample() and case.precision == "fp16":
        assert result.skipped, f"{case.name}: no overflow, so no skipped steps were compared"
    if case.precision != "fp32":
        assert max(result.floors.values()) > lm.RTOL, (case.name, "half precision indistinguishable from fp32")


# tests/train_fuzz_ties.py: case 431 (mixtral, dp 2 x cp 2 a2a+p2p, etp 2, fp16) misses its step-1 floor by 1% through
# one top-k near tie (docs/testing.md, "Fresh draws, session 43"); about 35 s for the rule's five runs.
NEAR_TIE_CASE = 431
WRONG_AUX_FACTOR = 1.1  # a 10% wrong aux-loss coefficient


@dataclasses.dataclass(frozen=True)
class _WrongAuxTerm(tf.TrainCase):
    """The case with its MoE aux loss coefficient changed in the layout's job only (its single process keeps
    the model's): a wrong router term, in fp16 and in the case's fp32 twin (``in_fp32`` keeps the class), or
    (``half_only``) in the half-precision layout only."""

    factor: float = 1.0
    half_only: bool = False

    def values(self, out_dir: str, cache_dir: str) -> dict:
        values = super().values(out_dir, cache_dir)
        if self.half_only and self.precision == "fp32":
            return values
        moe = values["model"]["moe"]
        values["model"] = dict(values["model"], moe=dict(moe, aux_loss_coeff=moe["aux_loss_coeff"] * self.factor))
        return values


@pytest.mark.slow
def test_near_tie_rule_accepts_case_431_and_says_so_and_rejects_a_wrong_router_term(tmp_path, cache_dir):
    """Case 431 misses and is accepted as a near tie, saying so; the same case with a wrong aux-loss term in its
    layout only misses too and must fail, naming (b). One test, so that the wrong case's single-process runs (its
    fp16 and fp32 references and its routing record: the model's own coefficient, the right case's runs) are the
    right case's, not trained again (CI time, session 46: they were two tests of 34 + 39 s)."""
    references: dict = {}
    case = tf.generate(NEAR_TIE_CASE)
    result = ties.run(case, str(tmp_path / "right"), cache_dir, references)
    assert not result.same.ok, "case 431 no longer misses: the rule is not exercised"
    assert result.ok and result.near_tie.startswith("accepted as a top-k near tie"), result.problems()
    assert not result.tie_problems
    wrong = _WrongAuxTerm(**{f.name: getattr(case, f.name) for f in dataclasses.fields(tf.TrainCase)},
                          factor=WRONG_AUX_FACTOR)
    result = ties.run(wrong, str(tmp_path / "wrong"), cache_dir, references)
    assert not result.same.ok and not result.ok and not result.near_tie
    assert any(p.startswith("(b) the layout in fp32 misses") for p in result.tie_problems), result.problems()


@pytest.mark.extended
def test_near_tie_rule_rejects_a_router_term_wrong_in_the_half_precision_layout_only(tmp_path, cache_dir):
    """Review44: the wrong aux term in the fp16 layout only keeps (a) (the step-1 tie) and (b) (its fp32 twin is
    right), and was accepted as a near tie at 4.3 x the step-1 tolerance (grad norm 6.8e-5 off against 1.6e-5; 2%
    off: 1.45 x, accepted too). Routed as the layout, the single process still misses: (c) rejects it."""
    case = tf.generate(NEAR_TIE_CASE)
    wrong = _WrongAuxTerm(**{f.name: getattr(case, f.name) for f in dataclasses.fields(tf.TrainCase)},
                          factor=WRONG_AUX_FACTOR, half_only=True)
    result = ties.run(wrong, str(tmp_path), cache_dir, {})
    assert not result.same.ok and not result.ok and not result.near_tie, result.near_tie
    assert any(p.startswith("(c) routed as the layout") for p in result.tie_problems), result.problems()
    assert not any(p.startswith(("(a)", "(b)")) for p in result.tie_problems), result.tie_problems


def test_forced_routing_replays_a_runs_choices_and_nothing_else(tmp_path, cache_dir):
    """``routing_flips``' ``forced``: a single process forced to its own recorded experts trains bit for bit as
    unforced; forced to move one token to other experts, that token takes them (the rest keep theirs) and the
    curve moves (the forced choice reaches the combine, not only the record)."""
    case = tf.generate(NEAR_TIE_CASE)
    top_k, experts = case.model_values()["moe"]["top_k"], case.model_values()["moe"]["num_experts"]

    def run(name: str, forced: dict | None = None) -> tuple:
        values = lm.reference_values(case, str(tmp_path / name), cache_dir)
        values["train"].update(steps=1, eval_every=1)  # one step shows it (seconds, not a whole curve)
        return rf.record_on_rank(0, 1, values, forced=forced)

    curve, _, chosen = run("free")
    assert run("own", chosen)[0] == curve
    moved = min(chosen)
    other = tuple(e for e in range(experts) if e not in chosen[moved])[:top_k]
    forced_curve, _, forced_chosen = run("moved", chosen | {moved: other})
    assert forced_chosen == chosen | {moved: other}
    assert forced_curve != curve


def test_near_tie_condition_a_needs_a_flip_and_every_flip_within_the_rounding():
    """``routing_verdict`` on built routings: a flip within its step's rounding passes; none, or one wider than
    the rounding (or after the last failing step only), fails (a)."""
    def step(n: int, margins: list[float], rounding: float = 3e-5) -> rf.StepRouting:
        return rf.StepRouting(n, 100, [rf.Flip((n, "layers.0.mlp", 0, i), ((0, 1), (0, 2)), m)
                                       for i, m in enumerate(margins)], rounding)

    assert ties.routing_verdict([step(1, [1.5e-5]), step(2, [9e-5])], upto=1)[1] == []
    assert ties.routing_verdict([step(1, []), step(2, [1e-6])], upto=1)[1][0].startswith("(a) no top-k flip")
    wide = ties.routing_verdict([step(1, [1e-6]), step(2, [2e-5, 4e-5])], upto=2)[1]
    assert len(wide) == 1 and wide[0].startswith("(a) flips wider") and "margin 4.0e-05" in wide[0]
