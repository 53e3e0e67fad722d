"""Built pipeline schedules, and the pipelines priced on them, kept for one search (issue 26: validation speed).

Invariant: ``ScheduleCache.build(...)`` returns what ``build_schedule(...)`` returns for the same
arguments, unvalidated: the planner only prices them, a third of a search's time went to re-checking
the generators' output (``validate_schedule``, session 45 profile of ``validate("held_out")``: 26 of 77 s),
and every schedule that runs is built validated by the engine and the dry run (the generators are checked
over generated (p, m, v) in ``tests/test_schedule*.py``); a priced simulation still raises on a deadlock. The key is every argument ``build_schedule`` takes (schedule, stages, microbatches, virtual
stages, ``coalesced_p2p``, zb_h1's ``w_lags``, the split drain), so two calls share a schedule only
where ``build_schedule`` would build the same one. The cached schedule is shared: callers read it
(simulate, count moments) and never change it. One cache belongs to one search (``planner.plan``,
``validation.completed_layout``): a plain dict on the object, dropped with it, never module state.
``priced`` memoizes a simulated pipeline by a key of every value the simulation reads (``simulate_pipeline``:
schedule arguments, per-chunk times, P2P time), so a hit returns what the simulation would.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence, TypeVar

from parallel3d.pipeline.actions import Schedule
from parallel3d.pipeline.schedules import build_schedule

__all__ = ["ScheduleCache"]

T = TypeVar("T")
ScheduleKey = tuple[str, int, int, int, bool, "tuple[int, ...] | None", bool]


class ScheduleCache:
    """``build_schedule`` with memory: each distinct schedule is built once (unvalidated: module doc)."""

    def __init__(self) -> None:
        self._built: dict[ScheduleKey, Schedule] = {}
        self._priced: dict[Hashable, Any] = {}
        self.hits = 0  # calls answered from the dict (what the cache saved)

    @classmethod
    def of(cls, schedules: "ScheduleCache | None") -> "ScheduleCache":
        """The caller's cache, or a new one for this call alone (callers that price one layout pass none)."""
        return schedules if schedules is not None else cls()

    def __len__(self) -> int:
        return len(self._built)

    def build(self, name: str, num_stages: int, num_microbatches: int, num_virtual_stages: int = 1, *,
              coalesced_p2p: bool = False, w_lags: Sequence[int] | None = None,
              split_drain: bool = False) -> Schedule:
        """``build_schedule`` with these arguments (see there), built on the first call only."""
        key = (name, num_stages, num_microbatches, num_virtual_stages, coalesced_p2p,
               None if w_lags is None else tuple(w_lags), split_drain)
        if key in self._built:
            self.hits += 1
        else:
            self._built[key] = build_schedule(name, num_stages, num_microbatches, num_virtual_stages,
                                              coalesced_p2p=coalesced_p2p, w_lags=w_lags, split_drain=split_drain,
                                              validate=False)
        return self._built[key]

    def priced(self, key: Hashable, price: Callable[[], T]) -> T:
        """``price()``, computed on the first call with ``key`` only: a simulated pipeline of this search, keyed
        by every value it reads (``pipeline_price.simulate_pipeline``). The result is shared: read, never changed."""
        if key in self._priced:
            self.hits += 1
        else:
            self._priced[key] = price()
        return self._priced[key]
