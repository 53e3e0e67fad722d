"""Pipeline schedules as plain data, checked by simulation, with a printable view.

A schedule is ``dict[stage, list[Action]]``: for every pipeline stage, the exact
order in which that stage runs its computations (``F``, ``B``) and its
point-to-point communications (``SEND_ACT``/``RECV_ACT`` forward,
``SEND_GRAD``/``RECV_GRAD`` backward). ``chunk`` is the virtual stage held by the
stage: with ``v`` virtual stages, stage ``s`` holds model chunks
``s, s + p, ..., s + (v-1) p`` (Narayanan et al. 2021), so activations leave the
last stage's chunk ``c`` for the first stage's chunk ``c + 1``.

Contract every built schedule satisfies (``validate_schedule`` checks it):

- each microbatch is forwarded and backwarded exactly once per (stage, chunk),
  and a backward comes after its forward;
- a receive comes before the computation that needs it, a send after the
  computation that produced it; every send has exactly one matching receive;
- for each ordered pair of stages, receives are posted in the order the sends
  were (untagged point-to-point on gloo and NCCL matches first-in first-out);
- executed with sends that never block and receives that wait for their send,
  all stages finish: no deadlock. This is checked by running ``simulate``, not
  argued.
- ``1f1b``: stage ``s`` never holds more than ``p - s`` microbatches whose
  forward is done and backward is not (``gpipe``: all ``m``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Union

COMPUTE_KINDS = ("F", "B")
COMM_KINDS = ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")
ACTION_KINDS = COMPUTE_KINDS + COMM_KINDS
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b")

Schedule = dict[int, list["Action"]]
CostFn = Union[float, int, Callable[[int, int], float]]


class ScheduleError(ValueError):
    """A schedule that breaks the contract in the module docstring."""


@dataclass(frozen=True)
class Action:
    """One step of one stage: ``kind`` on ``microbatch`` for model chunk ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ScheduleError(f"Action.kind={self.kind!r} is not one of {ACTION_KINDS}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ScheduleError(f"{self!r}: microbatch and chunk must be >= 0")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def label(self, show_chunk: bool = False) -> str:
        short = {"SEND_ACT": "sa", "RECV_ACT": "ra", "SEND_GRAD": "sg", "RECV_GRAD": "rg"}.get(self.kind, self.kind)
        return f"{short}{self.microbatch}" + (f"c{self.chunk}" if show_chunk else "")


# ---- virtual-stage layout ------------------------------------------------------------
def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    """Position of (stage, chunk) along the model: chunk c of stage s is model chunk s + c*p."""
    return chunk * num_stages + stage


def stage_and_chunk(virtual: int, num_stages: int) -> tuple[int, int]:
    return virtual % num_stages, virtual // num_stages


def schedule_shape(schedule: Schedule) -> tuple[int, int, int]:
    """(num_stages, num_microbatches, num_virtual_stages) read off a schedule."""
    if not schedule:
        raise ScheduleError("empty schedule")
    actions = [a for acts in schedule.values() for a in acts]
    if not actions:
        raise ScheduleError("schedule has no actions")
    return len(schedule), 1 + max(a.microbatch for a in actions), 1 + max(a.chunk for a in actions)


# ---- building ----------------------------------------------------------------------
def _check_args(name: str, p: int, m: int, v: int) -> None:
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"parallel.pp_schedule={name!r} is not one of {SCHEDULE_NAMES}")
    for key, value in (("num_stages", p), ("num_microbatches", m), ("num_virtual_stages", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")
    if name != "interleaved_1f1b" and v != 1:
        raise ValueError(
            f"schedule {name!r} has no virtual stages (num_virtual_stages={v}); use 'interleaved_1f1b'"
        )
    if name == "interleaved_1f1b" and v > 1 and p == 1:
        raise ValueError("interleaved_1f1b with num_virtual_stages > 1 needs num_stages >= 2 (a chunk cannot send to itself)")
    if name == "interleaved_1f1b" and v > 1 and m % p:
        raise ValueError(
            f"interleaved_1f1b needs num_microbatches divisible by num_stages: "
            f"num_microbatches={m}, num_stages={p}"
        )


def _with_comms(stage: int, p: int, v: int, compute: list[tuple[str, int, int]]) -> list[Action]:
    """Wrap each computation in the receive it needs and the send it feeds."""
    last = p * v - 1
    out: list[Action] = []
    for kind, mb, chunk in compute:
        vs = virtual_stage(stage, chunk, p)
        if kind == "F":
            if vs > 0:
                out.append(Action("RECV_ACT", mb, chunk))
            out.append(Action("F", mb, chunk))
            if vs < last:
                out.append(Action("SEND_ACT", mb, chunk))
        else:
            if vs < last:
                out.append(Action("RECV_GRAD", mb, chunk))
            out.append(Action("B", mb, chunk))
            if vs > 0:
                out.append(Action("SEND_GRAD", mb, chunk))
    return out


def _gpipe(stage: int, p: int, m: int) -> list[tuple[str, int, int]]:
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def _one_f_one_b(stage: int, p: int, m: int) -> list[tuple[str, int, int]]:
    warmup = min(p - stage - 1, m)
    order = [("F", i, 0) for i in range(warmup)]  # warm-up: fill the pipe below us
    for i in range(m - warmup):  # steady state: one forward, then the oldest backward
        order += [("F", warmup + i, 0), ("B", i, 0)]
    order += [("B", i, 0) for i in range(m - warmup, m)]  # cool-down: drain
    return order


def _interleaved(stage: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Narayanan et al. 2021: microbatches advance in groups of p through the v chunks."""

    def fwd(k: int) -> tuple[int, int]:  # (microbatch, chunk) of this stage's k-th forward
        return (k // (p * v)) * p + k % p, (k // p) % v

    def bwd(k: int) -> tuple[int, int]:
        return (k // (p * v)) * p + k % p, v - 1 - (k // p) % v

    total = m * v
    # Later stages start backwards sooner; every stage first fills all its chunks once.
    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    order = [("F", *fwd(k)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", *fwd(warmup + k)), ("B", *bwd(k))]
    order += [("B", *bwd(k)) for k in range(total - warmup, total)]
    return order


def build_schedule(name: str, num_stages: int, num_microbatches: int, num_virtual_stages: int = 1) -> Schedule:
    """One action list per stage for schedule ``name``; validated before it is returned."""
    p, m, v = num_stages, num_microbatches, num_virtual_stages
    _check_args(name, p, m, v)
    if name == "interleaved_1f1b" and v == 1:
        name = "1f1b"  # one chunk per stage: interleaving degenerates to plain 1F1B
    schedule: Schedule = {}
    for s in range(p):
        if name == "gpipe":
            compute = _gpipe(s, p, m)
        elif name == "1f1b":
            compute = _one_f_one_b(s, p, m)
        else:
            compute = _interleaved(s, p, m, v)
        schedule[s] = _with_comms(s, p, v, compute)
    limit = (lambda s: p - s) if name == "1f1b" else None
    validate_schedule(schedule, num_microbatches=m, num_virtual_stages=v, max_in_flight=limit)
    return schedule


# ---- validation ---------------------------------------------------------------------
def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most microbatch-chunks whose forward ran and whose backward has not."""
    peaks = {}
    for stage, actions in schedule.items():
        live = peak = 0
        for a in actions:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == "B":
                live -= 1
        peaks[stage] = peak
    return peaks


def _check_order(stage: int, actions: list[Action], p: int, m: int, v: int) -> None:
    seen: dict[tuple[str, int, int], int] = {}
    last = p * v - 1
    for pos, a in enumerate(actions):
        where = f"stage {stage}, position {pos} ({a})"
        if a.chunk >= v or a.microbatch >= m:
            raise ScheduleError(f"{where}: chunk must be < {v} and microbatch < {m}")
        key = (a.kind, a.microbatch, a.chunk)
        if key in seen:
            raise ScheduleError(f"{where}: repeats the action at position {seen[key]}")
        seen[key] = pos
        vs = virtual_stage(stage, a.chunk, p)
        needs = {
            "F": "RECV_ACT" if vs > 0 else None,
            "B": "RECV_GRAD" if vs < last else None,
            "SEND_ACT": "F",
            "SEND_GRAD": "B",
        }.get(a.kind)
        if a.kind == "B" and ("F", a.microbatch, a.chunk) not in seen:
            raise ScheduleError(f"{where}: backward before its forward")
        if needs and (needs, a.microbatch, a.chunk) not in seen:
            raise ScheduleError(f"{where}: needs an earlier {needs} for the same microbatch and chunk")
        if a.kind in ("RECV_ACT", "SEND_GRAD") and vs == 0:
            raise ScheduleError(f"{where}: the first model chunk has no upstream neighbour")
        if a.kind in ("SEND_ACT", "RECV_GRAD") and vs == last:
            raise ScheduleError(f"{where}: the last model chunk has no downstream neighbour")
    for kind in COMPUTE_KINDS:
        for chunk in range(v):
            missing = [i for i in range(m) if (kind, i, chunk) not in seen]
            if missing:
                raise ScheduleError(f"stage {stage}, chunk {chunk}: no {kind} for microbatches {missing}")
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
) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` meets the module contract."""
    p, m_seen, v_seen = schedule_shape(schedule)
    if sorted(schedule) != list(range(p)):
        raise ScheduleError(f"schedule stages must be 0..{p - 1}, got {sorted(schedule)}")
    m = m_seen if num_microbatches is None else num_microbatches
    v = v_seen if num_virtual_stages is None else num_virtual_stages
    for stage, actions in schedule.items():
        _check_order(stage, actions, p, m, v)
    simulate(schedule, 1.0, 2.0)  # raises on a deadlock or a mismatched send/receive
    if max_in_flight is not None:
        for stage, peak in peak_in_flight(schedule).items():
            if peak > max_in_flight(stage):
                raise ScheduleError(
                    f"stage {stage} holds {peak} microbatches in flight, more than the allowed {max_in_flight(stage)}"
                )


# ---- simulation ---------------------------------------------------------------------
@dataclass(frozen=True)
class TimedAction:
    stage: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """When each action of a simulated (or measured) step started and ended."""

    num_stages: int
    actions: list[TimedAction]
    busy: list[float]  # per stage: time spent in F and B
    makespan: float
    by_action: dict[tuple[int, Action], TimedAction] = field(default_factory=dict, repr=False)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step, averaged over stages."""
        if self.makespan <= 0:
            return 0.0
        return sum(1.0 - b / self.makespan for b in self.busy) / self.num_stages

    def start(self, stage: int, action: Action) -> float:
        return self.by_action[(stage, action)].start

    def end(self, stage: int, action: Action) -> float:
        return self.by_action[(stage, action)].end


def _as_cost(cost: CostFn, name: str) -> Callable[[int, int], float]:
    if callable(cost):
        return cost
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or cost < 0:
        raise ValueError(f"{name}={cost!r} must be a number >= 0 or a callable (stage, chunk) -> float")
    return lambda stage, chunk: float(cost)


def _message(kind: str, microbatch: int, from_virtual: int) -> tuple[str, int, int]:
    return ("act" if kind.endswith("ACT") else "grad", microbatch, from_virtual)


def simulate(schedule: Schedule, fwd_time: CostFn, bwd_time: CostFn, p2p_time: CostFn = 0) -> Timeline:
    """Run the schedule on an idealised machine: stages in parallel, actions of a stage in order.

    A computation takes ``fwd_time(stage, chunk)`` / ``bwd_time(stage, chunk)``; a send
    costs its stage nothing and its message arrives ``p2p_time`` later; a receive waits
    for its message. Raises ``ScheduleError`` on a deadlock or a receive that does not
    match the oldest pending send between the two stages.
    """
    fwd, bwd, lat = _as_cost(fwd_time, "fwd_time"), _as_cost(bwd_time, "bwd_time"), _as_cost(p2p_time, "p2p_time")
    p, _, v = schedule_shape(schedule)
    clock = [0.0] * p
    busy = [0.0] * p
    pos = [0] * p
    channels: dict[tuple[int, int], deque] = {}
    timed: list[TimedAction] = []
    while True:
        progressed = False
        for s in range(p):
            actions = schedule[s]
            while pos[s] < len(actions):
                a = actions[pos[s]]
                vs = virtual_stage(s, a.chunk, p)
                start = clock[s]
                if a.is_compute:
                    cost = (fwd if a.kind == "F" else bwd)(s, a.chunk)
                    clock[s] += cost
                    busy[s] += cost
                elif a.kind.startswith("SEND"):
                    peer, _ = stage_and_chunk(vs + 1 if a.kind == "SEND_ACT" else vs - 1, p)
                    channels.setdefault((s, peer), deque()).append(
                        (_message(a.kind, a.microbatch, vs), clock[s] + lat(s, a.chunk))
                    )
                else:
                    src_vs = vs - 1 if a.kind == "RECV_ACT" else vs + 1
                    peer, _ = stage_and_chunk(src_vs, p)
                    queue = channels.get((peer, s))
                    if not queue:
                        break  # blocked until the peer sends
                    message, arrival = queue[0]
                    expected = _message(a.kind, a.microbatch, src_vs)
                    if message != expected:
                        raise ScheduleError(
                            f"stage {s} posts {a} expecting {expected} from stage {peer}, "
                            f"but the oldest pending message on that channel is {message}"
                        )
                    queue.popleft()
                    clock[s] = max(clock[s], arrival)
                timed.append(TimedAction(s, a, start, clock[s]))
                pos[s] += 1
                progressed = True
        if all(pos[s] == len(schedule[s]) for s in range(p)):
            break
        if not progressed:
            stuck = {s: str(schedule[s][pos[s]]) for s in range(p) if pos[s] < len(schedule[s])}
            raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
    leftover = {k: [m for m, _ in q] for k, q in channels.items() if q}
    if leftover:
        raise ScheduleError(f"sends never received (channel (from, to) -> messages): {leftover}")
    makespan = max(clock) if clock else 0.0
    timeline = Timeline(p, timed, busy, makespan)
    timeline.by_action = {(t.stage, t.action): t for t in timed}
    return timeline


# ---- printable views ------------------------------------------------------------------
def format_schedule(schedule: Schedule, *, show_comms: bool = False) -> str:
    """One row per stage, e.g. ``stage 1: F0 F1 B0 F2 B1 B2`` (chunk shown as ``c1`` if v > 1)."""
    _, _, v = schedule_shape(schedule)
    rows = []
    for stage in sorted(schedule):
        labels = [a.label(v > 1) for a in schedule[stage] if show_comms or a.is_compute]
        rows.append(f"stage {stage}: " + " ".join(labels))
    return "\n".join(rows)


def format_timeline(timeline: Timeline, *, columns: int = 80) -> str:
    """A Gantt chart: one row per stage, ``F``/``B`` where it computes, ``.`` where it idles."""
    scale = columns / timeline.makespan if timeline.makespan > 0 else 1.0
    rows = [["."] * columns for _ in range(timeline.num_stages)]
    for t in timeline.actions:
        if not t.action.is_compute:
            continue
        for col in range(int(round(t.start * scale)), min(columns, int(round(t.end * scale)))):
            rows[t.stage][col] = t.action.kind if t.action.kind == "B" else "F"
    lines = [f"stage {s}: " + "".join(r) for s, r in enumerate(rows)]
    lines.append(f"makespan={timeline.makespan:g} bubble={timeline.bubble_fraction:.3f}")
    return "\n".join(lines)
