"""``scripts/sim_zbv_cores.py``: ZB-V's allowed extra work against interleaved 1F1B, per core count.

The break-even is where the two simulated steps are equal (checked by simulating both there); on
fewer cores than ranks the cores are busy almost all the step whatever the schedule, so ZB-V's
smaller bubble buys less and its break-even is lower than with a core per rank, and the step of
either is near the total work over the cores (its lower bound).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from sim_zbv_cores import break_even, step  # noqa: E402

from parallel3d.pipeline.schedules import build_schedule  # noqa: E402


@pytest.mark.parametrize("p,m,cores", [(4, 16, None), (4, 16, 2), (2, 8, None)])
def test_break_even_makes_the_two_steps_equal(p: int, m: int, cores: int | None) -> None:
    x = break_even(p, m, cores, 0.45)
    assert step("zbv", p, m, cores, x, 0.45) == pytest.approx(step("interleaved_1f1b", p, m, cores, 1.0, 0.45),
                                                               rel=1e-6)
    assert x > 1.0  # at equal work ZB-V's step is the shorter: it may cost something more


def test_a_bubble_buys_less_where_ranks_share_cores() -> None:
    shared, own = break_even(4, 16, 2, 0.45), break_even(4, 16, None, 0.45)
    assert shared < own
    for name in ("zbv", "interleaved_1f1b"):
        work = sum(0.5 if a.kind == "F" else 1.0 if a.kind == "B" else 0.0 for acts in
                   build_schedule(name, 4, 16, 2).values() for a in acts)  # a split B + its W: the whole backward
        assert work / 2 <= step(name, 4, 16, 2, 1.0, 0.45) <= 1.05 * work / 2  # the step is about the work over 2 cores
