"""Time a schedule on an idealised machine, draw the result, and prove progress under NCCL.

``simulate`` runs every stage's action list in order, all stages in parallel: a
computation takes its given time, a send costs the sender nothing and arrives
``p2p_time`` later, a receive waits for its message. It raises ``ScheduleError``
on a deadlock or on a receive that does not match the oldest message pending
between two stages, which is how ``validate_schedule`` proves a schedule safe. Those rules live
in ``ScheduleReplay`` alone; ``simulate_shared`` drives the same rules on fewer cores than stages.

``check_coalesced_progress`` replays the batches the engine posts
(``actions.comm_plan``) under a stricter model, NCCL's: a batch completes as a
unit, a rank's batches run in FIFO order, sends are rendezvous.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from parallel3d.pipeline.actions import (
    COMPUTE_KINDS,
    SEND_KINDS,
    Action,
    CostFn,
    Schedule,
    ScheduleError,
    comm_plan,
    placement_of,
    schedule_shape,
    split_backwards,
)


class TimedAction(NamedTuple):
    """One action's span. A named tuple: built per simulated action, several times faster than a frozen dataclass."""

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
    _by_action: dict[tuple[int, Action], TimedAction] | None = field(default=None, repr=False, compare=False)

    @property
    def by_action(self) -> dict[tuple[int, Action], TimedAction]:
        """Each (stage, action)'s span, indexed on first use (pricing never reads it)."""
        if self._by_action is None:
            self._by_action = {(t.stage, t.action): t for t in self.actions}
        return self._by_action

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


class ScheduleReplay:
    """The dependency rules of a schedule, shared by every simulator (``simulate``, ``simulate_shared``).

    Holds each stage's position in its action list, each channel's messages in flight (FIFO per
    (from, to) pair) and who is blocked on which channel; the driver owns the clock. A computation's
    duration is ``cost``; a send enqueues its message (``send``); a receive takes the oldest pending
    message if it matches (``receive``); ``finish`` raises on what is left undone.
    """

    def __init__(self, schedule: Schedule, fwd_time: CostFn, bwd_time: CostFn, p2p_time: CostFn = 0,
                 wgrad_time: CostFn | None = None,
                 action_time: Callable[[int, Action], float] | None = None) -> None:
        self.fwd, self.bwd = _as_cost(fwd_time, "fwd_time"), _as_cost(bwd_time, "bwd_time")
        self.lat = _as_cost(p2p_time, "p2p_time")
        self.wgt = (lambda st, c: self.bwd(st, c) / 2) if wgrad_time is None else _as_cost(wgrad_time, "wgrad_time")
        self.action_time = action_time
        self.schedule = schedule
        self.p, _, v = schedule_shape(schedule)
        self.place = placement_of(schedule)
        # Per (stage, local chunk): its model chunk, the stages of the next and the previous one (once, not per message)
        self.hops = [[(k, self.place.stage_of(k + 1), self.place.stage_of(k - 1))
                      for k in (self.place.model_chunk(s, c) for c in range(v))] for s in range(self.p)]
        self.split = {s: split_backwards(acts) for s, acts in schedule.items()}  # per stage: (mb, chunk) with a W
        self.pos = [0] * self.p
        self.channels: dict[tuple[int, int], deque] = {}
        self.waiting: dict[tuple[int, int], int] = {}  # channel (from, to) -> the stage blocked on it

    def next_action(self, s: int) -> Action | None:
        """Stage ``s``'s next action (``pos[s]`` moves on only when the driver says it is done)."""
        return self.schedule[s][self.pos[s]] if self.pos[s] < len(self.schedule[s]) else None

    def advance(self, s: int) -> None:
        """The driver's word that stage ``s``'s current action is done: its next one becomes current."""
        self.pos[s] += 1

    def cost(self, s: int, a: Action) -> float:
        """A computation's duration: a split ``B`` (one whose ``W`` is listed) is the whole backward less its ``W``."""
        if self.action_time is not None:
            return self.action_time(s, a)
        if a.kind == "F":
            return self.fwd(s, a.chunk)
        if a.kind == "W":
            return self.wgt(s, a.chunk)
        return self.bwd(s, a.chunk) - (self.wgt(s, a.chunk) if (a.microbatch, a.chunk) in self.split[s] else 0.0)

    def send(self, s: int, a: Action, now: float) -> int | None:
        """Post ``a``'s message at ``now`` (it arrives one latency later); the stage it wakes, if any."""
        vs, after, before = self.hops[s][a.chunk]
        peer = after if a.kind == "SEND_ACT" else before
        message = (_message(a.kind, a.microbatch, vs), now + self.lat(s, a.chunk))
        self.channels.setdefault((s, peer), deque()).append(message)
        return self.waiting.pop((s, peer), None)

    def receive(self, s: int, a: Action) -> float | None:
        """Take ``a``'s message: its arrival time, or None (``s`` now blocks on the channel) if unsent."""
        vs, after, before = self.hops[s][a.chunk]
        src_vs, peer = (vs - 1, before) if a.kind == "RECV_ACT" else (vs + 1, after)
        queue = self.channels.get((peer, s))
        if not queue:
            self.waiting[(peer, s)] = s
            return None
        message, arrival = queue[0]
        expected = _message(a.kind, a.microbatch, src_vs)
        if message != expected:
            raise ScheduleError(
                f"stage {s} posts {a} expecting {expected} from stage {peer}, "
                f"but the oldest pending message on that channel is {message}"
            )
        queue.popleft()
        return arrival

    def finish(self) -> None:
        """Raise ``ScheduleError`` on a stage stuck before its end or a message never received."""
        stuck = {s: str(self.schedule[s][self.pos[s]]) for s in range(self.p) if self.pos[s] < len(self.schedule[s])}
        if stuck:
            raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
        leftover = {k: [m for m, _ in q] for k, q in self.channels.items() if q}
        if leftover:
            raise ScheduleError(f"sends never received (channel (from, to) -> messages): {leftover}")


def make_timeline(p: int, timed: list[TimedAction], busy: list[float], ends: list[float]) -> Timeline:
    """The ``Timeline`` of a finished run: ``ends``, each stage's last action's end."""
    return Timeline(p, timed, busy, max(ends) if ends else 0.0)


def simulate(schedule: Schedule, fwd_time: CostFn, bwd_time: CostFn, p2p_time: CostFn = 0,
             wgrad_time: CostFn | None = None,
             action_time: Callable[[int, Action], float] | None = None) -> Timeline:
    """Run the schedule on an idealised machine: stages in parallel, actions of a stage in order.

    A computation takes ``fwd_time(stage, chunk)`` / ``bwd_time(stage, chunk)``
    (``bwd_time`` is a whole backward); a backward the schedule splits (its ``W`` is listed):
    ``W`` takes ``wgrad_time`` (default: half of ``bwd_time``) and ``B`` the rest, so
    split and unsplit schedules do the same work; a send
    costs its stage nothing and its message arrives ``p2p_time`` later; a receive waits
    for its message. Raises ``ScheduleError`` on a deadlock or a receive that does not
    match the oldest pending send between the two stages.

    ``action_time(stage, action)``, where given, is each computation's own duration instead
    (a replay of measured durations, which differ from microbatch to microbatch).
    """
    run = ScheduleReplay(schedule, fwd_time, bwd_time, p2p_time, wgrad_time, action_time)
    p = run.p
    clock = [0.0] * p
    busy = [0.0] * p
    timed: list[TimedAction] = []
    runnable = deque(range(p))
    while runnable:  # each stage runs ahead on its own clock until it blocks on an unsent message
        s = runnable.popleft()
        while (a := run.next_action(s)) is not None:
            start = clock[s]
            if a.kind in COMPUTE_KINDS:
                cost = run.cost(s, a)
                clock[s] += cost
                busy[s] += cost
            elif a.kind in SEND_KINDS:
                woken = run.send(s, a, clock[s])
                if woken is not None:
                    runnable.append(woken)
            else:
                arrival = run.receive(s, a)
                if arrival is None:
                    break
                clock[s] = max(clock[s], arrival)
            timed.append(TimedAction(s, a, start, clock[s]))
            run.advance(s)
    run.finish()
    return make_timeline(p, timed, busy, clock)


def format_timeline(timeline: Timeline, *, columns: int = 80) -> str:
    """A Gantt chart: one row per stage, ``F``/``B``/``W`` where it computes, ``.`` where it idles."""
    scale = columns / timeline.makespan if timeline.makespan > 0 else 1.0
    rows = [["."] * columns for _ in range(timeline.num_stages)]
    for t in timeline.actions:
        if not t.action.is_compute:
            continue
        for col in range(int(round(t.start * scale)), min(columns, int(round(t.end * scale)))):
            rows[t.stage][col] = t.action.kind
    lines = [f"stage {s}: " + "".join(r) for s, r in enumerate(rows)]
    lines.append(f"makespan={timeline.makespan:g} bubble={timeline.bubble_fraction:.3f}")
    return "\n".join(lines)


# ---- progress under batch (NCCL) semantics ---------------------------------------------------
@dataclass
class _Unit:
    """What completes as one: a posted batch (NCCL), or one op of it (gloo)."""

    stage: int
    actions: tuple[Action, ...]
    ops: list[int] = field(default_factory=list)  # indices into _BatchRun.partner
    remaining: int = 0
    complete: bool = False


class _BatchRun:
    """One stage program per stage, replayed until nothing can progress (see ``check_coalesced_progress``).

    A program is a list of ``("post", unit)`` and ``("wait", units)`` items, built from
    ``comm_plan`` exactly as ``PipelineEngine`` posts and waits.
    """

    def __init__(self, schedule: Schedule, prefetch: int, coalesced: bool, wait_sent_activations: bool) -> None:
        self.p, _, v = schedule_shape(schedule)
        self.place = placement_of(schedule)
        # Per (stage, local chunk): its model chunk, the stages of the next and the previous one (once, not per message)
        self.hops = [[(k, self.place.stage_of(k + 1), self.place.stage_of(k - 1))
                      for k in (self.place.model_chunk(s, c) for c in range(v))] for s in range(self.p)]
        self.coalesced = coalesced
        self.units: list[_Unit] = []
        self.programs = {s: self._program(s, schedule[s], prefetch, wait_sent_activations) for s in range(self.p)}
        self.op_unit: list[int] = []
        self.partner: list[int] = []
        self._match()

    def _program(self, s: int, actions: list[Action], prefetch: int, wait_sent: bool) -> list[tuple[str, Any]]:
        prog: list[tuple[str, Any]] = []
        holder: dict[Action, list[int]] = {}  # posted action -> the units its batch consists of
        unsent: list[int] = []  # units holding activation sends not yet waited for

        def post(batch: tuple[Action, ...]) -> None:
            groups = [batch] if self.coalesced else [(a,) for a in batch]
            ids = []
            for group in groups:
                self.units.append(_Unit(s, group))
                ids.append(len(self.units) - 1)
                prog.append(("post", ids[-1]))
            for a in batch:  # using one receive of a batch waits for all of the batch (p2p.py)
                holder[a] = ids
            if any(a.kind == "SEND_ACT" for a in batch):
                unsent.extend(ids)

        for step in comm_plan(actions, prefetch):
            if step.batch:
                post(step.batch)
            for a in step.ahead:
                post((a,))
            needed = sorted({u for a in step.needs for u in holder[a]})
            if needed:
                prog.append(("wait", needed))
            if wait_sent and step.compute is not None and step.compute.kind == "F" and unsent:
                prog.append(("wait", sorted(set(unsent))))  # the engine's wait after a forward
                unsent.clear()
        prog.append(("wait", sorted({u for ids in holder.values() for u in ids})))  # wait_sends
        return prog

    def _match(self) -> None:
        """Pair the k-th send on each channel (from, to) with the k-th receive posted on it."""
        open_ends: dict[tuple[int, int, int, bool], int] = {}
        counts: dict[tuple[int, int, bool], int] = {}
        message: list[tuple[str, int, int]] = []
        for s, prog in self.programs.items():
            for _, u in (item for item in prog if item[0] == "post"):
                for a in self.units[u].actions:
                    vs = self.place.model_chunk(s, a.chunk)
                    sending = a.kind.startswith("SEND")
                    other_vs = vs + 1 if a.kind in ("SEND_ACT", "RECV_GRAD") else vs - 1
                    peer = self.place.stage_of(other_vs)
                    channel = (s, peer) if sending else (peer, s)
                    k = counts.get((*channel, sending), 0)
                    counts[(*channel, sending)] = k + 1
                    op = len(self.op_unit)
                    self.op_unit.append(u)
                    self.partner.append(-1)
                    message.append(_message(a.kind, a.microbatch, vs if sending else other_vs))
                    self.units[u].ops.append(op)
                    self.units[u].remaining += 1
                    other = open_ends.pop((*channel, k, not sending), None)
                    if other is None:
                        open_ends[(*channel, k, sending)] = op
                        continue
                    if message[other] != message[op]:
                        sent, received = (op, other) if sending else (other, op)
                        raise ScheduleError(
                            f"message {k} on channel (from, to) {channel} is sent as {message[sent]} "
                            f"but received as {message[received]}"
                        )
                    self.partner[op], self.partner[other] = other, op
        if open_ends:
            raise ScheduleError(f"p2p ops without a partner (from, to, ordinal, is_send): {sorted(open_ends)}")

    def run(self) -> dict[int, list[list[str]]]:
        """Progress every stage as far as it goes; return stuck stages -> the batches they wait for."""
        live = [False] * len(self.op_unit)  # the op's unit has started (and the op is posted)
        fifo: dict[int, list[int]] = {s: [] for s in range(self.p)}
        head = {s: 0 for s in range(self.p)}  # fifo[s][:head[s]] have completed
        pc = {s: 0 for s in range(self.p)}
        start: deque[int] = deque()
        advance: deque[int] = deque(range(self.p))

        def finished(u: int) -> None:
            self.units[u].complete = True
            s = self.units[u].stage
            advance.append(s)
            while head[s] < len(fifo[s]) and self.units[fifo[s][head[s]]].complete:
                head[s] += 1
            if self.coalesced and head[s] < len(fifo[s]):
                start.append(fifo[s][head[s]])  # FIFO: the next batch starts now

        while start or advance:
            while start:
                u = start.popleft()
                for op in self.units[u].ops:
                    q = self.partner[op]
                    live[op] = True
                    if live[q]:  # rendezvous: both sides started, the message moves
                        for w in (u, self.op_unit[q]):
                            self.units[w].remaining -= 1
                            if self.units[w].remaining == 0:
                                finished(w)
            if advance:
                s = advance.popleft()
                prog = self.programs[s]
                while pc[s] < len(prog):
                    kind, arg = prog[pc[s]]
                    if kind == "post":
                        fifo[s].append(arg)
                        if not self.coalesced or fifo[s][head[s]] == arg:
                            start.append(arg)
                    elif not all(self.units[u].complete for u in arg):
                        break
                    pc[s] += 1
        return {
            s: [[str(a) for a in self.units[u].actions] for u in prog[pc[s]][1] if not self.units[u].complete]
            for s, prog in self.programs.items()
            if pc[s] < len(prog)
        }


def check_coalesced_progress(
    schedule: Schedule,
    *,
    prefetch: int = 0,
    coalesced: bool = True,
    wait_sent_activations: bool | None = None,
) -> None:
    """Prove that every stage finishes when its communication runs as the engine posts it.

    The engine posts each stage's communication as ``comm_plan(actions, prefetch)`` says.
    Under NCCL semantics (``coalesced=True``), verified in torch's ProcessGroupNCCL: a batch
    is one unit that completes only when every op in it has; a rank's batches on a group run
    in FIFO order (a batch starts once the rank's earlier ones completed); a send is
    rendezvous (it moves only when the matching receive's batch has started too); a
    computation waits for the batches holding its receives. With ``coalesced=False`` (gloo)
    each op progresses on its own once posted, with no FIFO order, but using a receive still
    waits for its whole batch. ``wait_sent_activations`` (default: single-chunk schedules,
    like the engine) adds the engine's wait, after each forward, for the batches holding
    earlier activation sends.

    Every condition is a conjunction, so an execution with fewer waits or earlier posts cannot
    deadlock where this one progresses. Raises ``ScheduleError`` on a deadlock, naming each
    stuck stage and the batches it waits for, or on a receive posted out of order.
    """
    _, _, v = schedule_shape(schedule)
    if wait_sent_activations is None:
        wait_sent_activations = v == 1
    stuck = _BatchRun(schedule, prefetch, coalesced, wait_sent_activations).run()
    if stuck:
        mode = "NCCL (one unit per batch, FIFO batches)" if coalesced else "gloo (per-op progress)"
        raise ScheduleError(
            f"deadlock under {mode} semantics with prefetch={prefetch}: stage -> the batches it waits for, "
            f"which can never complete: {stuck}"
        )
