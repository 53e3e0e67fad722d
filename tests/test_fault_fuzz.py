"""Fault fuzz (``tests/fault_fuzz.py``): a drawn layout, a drawn failing rank, step, point and how, through
torchrun; every promise of principle 4 checked (``Outcome.problems``). CI runs one drawn case of world 2 (an
exception with the bit-identical resume); a rank whose training thread hangs while its process lives is extended;
``--extended`` runs the first ``EXTENDED_CASES`` draws."""

from __future__ import annotations

import pytest

from tests.fault_fuzz import draw_case, first_case, run_case

EXTENDED_CASES = 25


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


def _check(case, tmp_path, cache_dir, resume: bool = True) -> None:
    outcome = run_case(case, str(tmp_path), cache_dir, resume=resume)
    assert outcome.problems() == [], f"{case.name}: {outcome.problems()}\n{outcome.output[-4000:]}"
    print(f"{case.name}: first failure line {outcome.failure_lines[:1]}; ended {outcome.seconds_after_fault:.1f}s "
          f"after the fault (bound {case.bound_s:.0f}s); checkpoints {outcome.checkpoints}")


@pytest.mark.slow
def test_a_drawn_exception_ends_the_job_naming_the_rank_and_the_resume_is_bit_identical(tmp_path, cache_dir):
    _check(first_case(lambda c: c.world == 2 and c.how == "exception" and c.point != "save"), tmp_path, cache_dir)


@pytest.mark.extended
def test_a_drawn_hung_training_thread_is_named_although_its_heartbeat_goes_on(tmp_path, cache_dir):
    """The hung rank's heartbeat thread keeps beating: only its stuck training thread names it. Extended (session
    39, CI time: timeout + torchrun's 30 s grace); CI checks the same naming in one process:
    tests/test_heartbeat.py::test_a_training_thread_stuck_outside_a_collective_is_named_not_the_ranks_waiting_for_it."""
    _check(first_case(lambda c: c.world == 2 and c.how == "hang" and c.point != "save"), tmp_path, cache_dir,
           resume=False)


@pytest.mark.extended
@pytest.mark.parametrize("case_id", range(EXTENDED_CASES))
def test_drawn_fault(case_id, tmp_path, cache_dir):
    _check(draw_case(case_id), tmp_path, cache_dir)
