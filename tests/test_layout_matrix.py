"""Every layout is the same model: the generated layout matrix against one process.

Each case (``tests/layout_matrix.py``: drawn from the config schema's choices, kept
only if the validator accepts it) trains through the real ``Trainer`` on its ranks and
must give the single-process loss and grad-norm curve within 1e-5 relative (fp32,
dropout on). CI runs ``layout_matrix.ci_sample()`` (a greedy cover of ``CI_MUST_COVER``: pp=3
and pp=4 with dp > 1 and ZeRO-2, every schedule, ZeRO 0-3, offload, Llama at pp >= 3, ...); the
whole matrix runs with
``pytest tests/test_layout_matrix.py --layout-matrix=all`` or, as a table,
``python scripts/check_layouts.py --all``.
"""

from __future__ import annotations

import pytest

from models.moe_config import MoEConfig
from parallel3d import config as cfg
from parallel3d.config import job_from_dict, resolve
from parallel3d.moe.options import DISPATCHERS
from parallel3d.pipeline.options import SPLIT_DRAIN_SCHEDULES, SPLIT_DRAIN_VALUES, drain_is_split
from tests import layout_matrix as lm
from tests import layout_run as lr

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        which = metafunc.config.getoption("--layout-matrix")
        cases = lm.all_cases() if which == "all" else lm.ci_sample()
        metafunc.parametrize("case", cases, ids=[c.name for c in cases])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("matrix_corpus"))


@pytest.fixture(scope="module")
def references() -> dict:
    return {}


def test_ci_sample_covers_what_once_hid_every_failure():
    cases = lm.ci_sample()
    for label, where in lm.CI_MUST_COVER.items():
        assert any(where(c) for c in cases), label
    assert lm.STEPS >= 4
    # Reproducible by id: drawing again gives the same layouts.
    assert tuple(lm.case_by_id(c.case_id) for c in cases) == cases


def test_ci_sample_runs_every_schedule_zero_stage_offload_mode_and_model_at_pp3_for_4_steps():
    """What issue 23 asks of CI, from the config schema's own lists (not from CI_MUST_COVER)."""
    cases = lm.ci_sample()
    assert {c.parallel["schedule"] for c in cases} == set(cfg.SCHEDULES)
    assert {c.parallel["zero_stage"] for c in cases} == set(cfg.ZERO_STAGES)
    assert {c.parallel["offload"] for c in cases} == set(cfg.OFFLOAD_MODES)
    assert {c.model for c in cases if c.parallel["pp"] >= 3 and c.model in lm.MODELS} == set(lm.MODELS)
    assert lm.STEPS >= 4 and lm.EVAL_EVERY < lm.STEPS


def test_pipeline_draws_reach_every_split_drain_value_and_both_drains_of_each_schedule():
    """``parallel.split_drain`` is drawn (the dense draw leaves it at auto): every value the option accepts,
    and, resolved by the engine's own rule, a split and a plain drain of each schedule it applies to, on 3 or
    4 uneven stages; reproducible by id."""
    cases = [lm.generate_case(lm.PIPE_BASE + k) for k in range(lm.PIPE_CASES)]
    assert {repr(c.parallel["split_drain"]) for c in cases} == {repr(v) for v in SPLIT_DRAIN_VALUES}
    drains = {(c.parallel["schedule"], drain_is_split(c.parallel["schedule"], c.parallel["split_drain"],
                                                      c.train["recompute"])) for c in cases}
    assert drains == {(s, split) for s in SPLIT_DRAIN_SCHEDULES for split in (True, False)}
    assert all(c.parallel["pp"] in (3, 4) and c.parallel["pp_layers"] is not None for c in cases)
    assert [lm.generate_case(c.case_id) for c in cases] == cases


def test_every_id_from_moe_base_on_stays_a_moe_draw():
    """The reshard pairs' and the train fuzz's MoE layouts are drawn at ids above ``MOE_BASE``; the pipeline
    draws live below it (ids 40000 + k once turned the reshard matrix's MoE pairs into dense ones)."""
    from tests import reshard_matrix as rm
    from tests import train_fuzz as tf

    for base in (lm.MOE_BASE, tf.MOE_LAYOUT_BASE, rm.MOE_PAIR_BASE, rm.MOE_COVER_BASE):
        assert lm.generate_case(base).model in lm.MOE_MODELS, base
    assert lm.generate_case(lm.PIPE_BASE).model in lm.MODELS and lm.PIPE_BASE + lm.PIPE_CASES <= lm.MOE_BASE


def test_generator_asks_the_validator():
    # A case the validator refuses is never drawn: every generated case resolves.
    for case in lm.ci_sample():
        assert lm.is_valid(case) and case.world_size <= lm.MAX_WORLD


def test_reference_noise_floor_is_far_below_the_tolerance(tmp_path, cache_dir, references):
    """One process, another summation order (one sample per microbatch): the curve must move far
    less than RTOL, or a layout failing RTOL would say nothing about the layout. Checked per model
    at its largest global batch (the most microbatches, the most reordering); the references
    computed here are the ones the cases below compare with."""
    first_case_of = {}
    for case in lm.ci_sample():
        if case.capacity is None:  # capacity references run the case's own microbatches
            first_case_of.setdefault(case.reference_key(), case)
    largest = {model: max(g for m, g, _ in first_case_of if m == model) for model, *_ in first_case_of}
    for key, case in sorted(first_case_of.items()):
        if key not in references:
            references[key] = lr.train_reference(lm.reference_values(case, str(tmp_path / f"ref-{key}"), cache_dir), True)
        model, global_batch, document_mask = key
        if global_batch != largest[model]:
            continue
        values = lm.job_values(model, {}, {"global_batch_size": global_batch, "micro_batch_size": 1},
                               str(tmp_path / f"{model}-{global_batch}-{document_mask}-1"), cache_dir, document_mask)
        for (step, *got), (_, *ref) in zip(lr.train_reference(values, quiet=True), references[key]):
            for what, a, b in zip(("loss", "grad_norm", "eval_loss"), got, ref):
                if b is not None:
                    assert abs(a - b) <= lm.RTOL / 10 * abs(b), (model, global_batch, step, what, a, b)


def test_layout_matches_single_process(case, tmp_path, cache_dir, references):
    result = lr.run_case(case, str(tmp_path), cache_dir, references)
    assert result.ok, f"{case.name}: " + "; ".join(result.problems())
    assert len(result.curve) == lm.STEPS


def test_moe_draws_reach_every_dispatcher_and_a_document_mask():
    """The whole matrix's MoE draws run every ``model.moe.dispatcher`` (from the options module) and
    ``data.document_mask`` on and off: until session 44 none ran the all-gather dispatcher or a document mask.
    The drawn dispatcher reaches the layout's resolved job; its single-process reference keeps the model's own."""
    cases = [lm.generate_case(lm.MOE_BASE + k) for k in range(lm.MOE_CASES)]
    drawn = {resolve(job_from_dict(c.values("out", "cache")), c.world_size).model.moe.dispatcher for c in cases}
    assert drawn == set(DISPATCHERS)
    assert {c.document_mask for c in cases} == {False, True}
    for case in cases:
        reference = resolve(job_from_dict(lm.reference_values(case, "out", "cache")), 1).model.moe
        assert reference.dispatcher == MoEConfig.dispatcher
