"""The checks of the schedule contract stated in ``parallel3d.pipeline.schedules`` (re-exported there).

``validate_schedule`` raises ``ScheduleError`` on any breach: order and message rules per stage
(``_check_order``), progress under simulation and, on request, under NCCL batch semantics, and a
bound on the microbatches in flight (``peak_in_flight``). Invariant: a schedule ``build_schedule``
returns has passed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from parallel3d.pipeline.actions import Action, Schedule, ScheduleError, schedule_shape, split_backwards
from parallel3d.pipeline.placement import ChunkPlacement
from parallel3d.pipeline.simulate import check_coalesced_progress, simulate

__all__ = ["peak_in_flight", "validate_schedule"]


def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most microbatch-chunks whose forward ran and whose backward has not.

    A split backward's microbatch-chunk is in flight until its ``W`` (its graph, or W's tensors, live
    until then); an unsplit one's until its ``B``.
    """
    peaks = {}
    for stage, actions in schedule.items():
        live = peak = 0
        split = split_backwards(actions)
        for a in actions:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == "W" or (a.kind == "B" and (a.microbatch, a.chunk) not in split):
                live -= 1
        peaks[stage] = peak
    return peaks


@dataclass(frozen=True)
class _Where:
    """Names an action's place in error messages (formatted only when an error is raised)."""

    stage: int
    pos: int
    action: Action

    def __str__(self) -> str:
        return f"stage {self.stage}, position {self.pos} ({self.action})"


def _check_order(stage: int, actions: list[Action], place: ChunkPlacement, m: int,
                 forward_only: bool = False) -> None:
    seen: dict[tuple[str, int, int], int] = {}
    v, last = place.num_chunks, place.total - 1
    for pos, a in enumerate(actions):
        where = _Where(stage, pos, a)
        if a.chunk >= v or a.microbatch >= m:
            raise ScheduleError(f"{where}: chunk must be < {v} and microbatch < {m}")
        key = (a.kind, a.microbatch, a.chunk)
        if forward_only and a.kind in ("B", "W", "SEND_GRAD", "RECV_GRAD"):
            raise ScheduleError(f"{where}: a forward-only schedule has no backward or gradient messages")
        if key in seen:
            raise ScheduleError(f"{where}: repeats the action at position {seen[key]}")
        seen[key] = pos
        vs = place.model_chunk(stage, a.chunk)
        before, after = place.local_previous(stage, a.chunk), place.local_next(stage, a.chunk)
        if a.kind in ("RECV_ACT", "SEND_GRAD") and vs == 0:
            raise ScheduleError(f"{where}: the first model chunk has no upstream neighbour")
        if a.kind in ("SEND_ACT", "RECV_GRAD") and vs == last:
            raise ScheduleError(f"{where}: the last model chunk has no downstream neighbour")
        if (a.kind in ("RECV_ACT", "SEND_GRAD") and before is not None) or \
                (a.kind in ("SEND_ACT", "RECV_GRAD") and after is not None):
            raise ScheduleError(f"{where}: the neighbouring model chunk sits on this stage (no message)")
        needs: tuple[str, int] | None = {  # (kind, local chunk) of an earlier action of this microbatch
            "F": None if vs == 0 else ("F", before) if before is not None else ("RECV_ACT", a.chunk),
            "B": ("F", a.chunk),
            "W": ("B", a.chunk),
            "SEND_ACT": ("F", a.chunk),
            "SEND_GRAD": ("B", a.chunk),
        }.get(a.kind)
        if needs and (needs[0], a.microbatch, needs[1]) not in seen:
            what = {"B": "backward before its forward", "W": "weight gradient (W) before its input-gradient backward (B)"}
            raise ScheduleError(f"{where}: " + what.get(a.kind, f"needs an earlier {needs[0]} for the same microbatch"
                                                              f" and chunk {needs[1]}"))
        if a.kind == "B" and vs < last:
            grad = ("B", a.microbatch, after) if after is not None else ("RECV_GRAD", a.microbatch, a.chunk)
            if grad not in seen:
                raise ScheduleError(f"{where}: needs an earlier {grad[0]} for the same microbatch and chunk {grad[2]}")
    for kind in ("F",) if forward_only else ("F", "B"):
        for chunk in range(v):
            missing = [i for i in range(m) if (kind, i, chunk) not in seen]
            if missing:
                raise ScheduleError(f"stage {stage}, chunk {chunk}: no {kind} for microbatches {missing}")
    for chunk in range(v):  # a chunk's split backwards: from its first split B on, every B (contract)
        backwards = sorted((pos, mb) for (k, mb, c), pos in seen.items() if k == "B" and c == chunk)
        split = [i for i, (_, mb) in enumerate(backwards) if ("W", mb, chunk) in seen]
        missing = [mb for _, mb in backwards[split[0]:] if ("W", mb, chunk) not in seen] if split else []
        if missing:
            raise ScheduleError(f"stage {stage}, chunk {chunk}: no W for microbatches {missing}")
    for kind, needed_by in (("RECV_ACT", "F"), ("RECV_GRAD", "B")):
        for (k, mb, chunk) in seen:
            if k == kind and (needed_by, mb, chunk) not in seen:
                raise ScheduleError(f"stage {stage}: {kind}{mb} chunk {chunk} is received but never used")


def validate_schedule(
    schedule: Schedule,
    *,
    num_microbatches: int | None = None,
    num_virtual_stages: int | None = None,
    max_in_flight: Callable[[int], int] | None = None,
    coalesced_p2p: bool = False,
    forward_only: bool = False,
) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` meets the module contract (``forward_only``: no ``B``).

    With ``coalesced_p2p`` it must also progress under NCCL batch semantics
    (``check_coalesced_progress`` with the engine's defaults for such backends).
    """
    p, m_seen, v_seen = schedule_shape(schedule)
    if sorted(schedule) != list(range(p)):
        raise ScheduleError(f"schedule stages must be 0..{p - 1}, got {sorted(schedule)}")
    m = m_seen if num_microbatches is None else num_microbatches
    v = v_seen if num_virtual_stages is None else num_virtual_stages
    place = getattr(schedule, "placement", None) or ChunkPlacement(p, v)
    if (place.num_stages, place.num_chunks) != (p, v):
        raise ScheduleError(f"the schedule's placement {place} does not match its {p} stages x {v} chunks")
    for stage, actions in schedule.items():
        _check_order(stage, actions, place, m, forward_only)
    simulate(schedule, 1.0, 2.0)  # raises on a deadlock or a mismatched send/receive
    if coalesced_p2p:
        check_coalesced_progress(schedule)
    if max_in_flight is not None:
        for stage, peak in peak_in_flight(schedule).items():
            if peak > max_in_flight(stage):
                raise ScheduleError(
                    f"stage {stage} holds {peak} microbatches in flight, more than the allowed {max_in_flight(stage)}"
                )
