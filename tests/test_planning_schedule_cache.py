"""The search's schedule cache (issue 26, validation speed): one cache answers every argument that changes
a schedule with ``build_schedule``'s own schedule, and builds each distinct one once."""

from __future__ import annotations

from parallel3d.pipeline.schedules import build_schedule
from parallel3d.planning.schedule_cache import ScheduleCache

# Each entry differs from the first in one argument build_schedule takes, and builds a different schedule.
VARIANTS = [
    (("1f1b", 4, 8, 1), {}),
    (("zb_h1", 4, 8, 1), {}),
    (("1f1b", 2, 8, 1), {}),
    (("1f1b", 4, 12, 1), {}),
    (("interleaved_1f1b", 4, 8, 2), {}),
    (("interleaved_1f1b", 4, 8, 2), {"coalesced_p2p": True}),
    (("zb_h1", 4, 8, 1), {"w_lags": (0, 0, 1, 2)}),
    (("1f1b", 4, 8, 1), {"split_drain": True}),
    (("zbv", 4, 8, 2), {}),
]


def test_one_cache_gives_build_schedules_schedule_for_every_argument():
    cache = ScheduleCache()
    for args, kwargs in VARIANTS:
        assert cache.build(*args, **kwargs) == build_schedule(*args, **kwargs), (args, kwargs)
    assert len(cache) == len(VARIANTS) and cache.hits == 0  # all distinct: each built once
    for args, kwargs in VARIANTS:  # asked again: answered from the cache, the same schedule
        assert cache.build(*args, **kwargs) == build_schedule(*args, **kwargs), (args, kwargs)
    assert len(cache) == len(VARIANTS) and cache.hits == len(VARIANTS)


def test_the_variants_really_differ():
    # Else the test above could pass with an argument missing from the key.
    built = [build_schedule(*args, **kwargs) for args, kwargs in VARIANTS]
    assert all(a != b for i, a in enumerate(built) for b in built[i + 1:])
