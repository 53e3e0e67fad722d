"""Pipeline schedules as plain data, checked by simulation, with a printable view.

A schedule is ``{stage: [Action, ...]}`` (``actions.Schedule``): for every pipeline
stage, the exact order in which that stage runs its computations (``F``, ``B``, ``W``)
and its point-to-point communications (``SEND_ACT``/``RECV_ACT`` forward,
``SEND_GRAD``/``RECV_GRAD`` backward). ``chunk`` is the stage's local chunk; the
schedule's ``placement`` says which model chunk that is (``placement``): the loop
placement (stage ``s`` holds model chunks ``s, s + p, ..., s + (v-1) p``, Narayanan et
al. 2021: activations leave the last stage's chunk ``c`` for the first stage's chunk
``c + 1``) for every schedule but ``zbv``, whose chunks form a V. Where two
consecutive model chunks sit on one stage (the V's turns), the activation and its
gradient pass inside the stage: no message, and the later chunk's ``F`` (the earlier
chunk's ``B``) needs the other's ``F`` (``B``) of that microbatch before it.

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
- built with ``coalesced_p2p=True`` (for NCCL, or its emulation), all stages also
  finish when the comm actions between two computations go out as one batch that
  completes as a unit, a rank's batches run in FIFO order and sends are rendezvous
  (``check_coalesced_progress``). ``interleaved_1f1b`` then places its
  communication per iteration (Megatron's placement: a warm-up forward, a steady
  forward+backward pair or a cool-down backward, followed by its sends and the next
  iteration's receives in one batch); otherwise every receive sits right before
  the computation that reads it and every send right after the one that produced
  it, which overlaps more but can deadlock under FIFO batches
  (``tests/test_schedules.py`` shows one).
- ``1f1b``: stage ``s`` never holds more than ``p - s`` microbatches whose
  forward is done and backward is not (``gpipe``: all ``m``).
- a split backward (a ``B`` whose ``W`` is listed) is split on every later ``B`` of
  its stage and chunk too: a stage splits its backwards from some point on.
- ``1f1b`` with ``split_drain``: every stage but the first splits the backwards it
  runs after its last forward, each ``W`` right after its ``B`` and the input
  gradient's send (``SEND_GRAD``) between them: the stage upstream gets it one ``W``
  earlier, which shortens the drain (the critical path at the end of the step) by
  about ``(p - 1) W``; the order of ``F``s and ``B``s and the peak in flight are 1F1B's.
- ``interleaved_1f1b`` with ``split_drain``: the same from the backward paired with each
  stage's last forward on, but the model's first chunk's; with ``coalesced_p2p`` each such
  ``W`` opens the next iteration, after the batch of its ``B``'s sends and that iteration's
  receives, which it does not wait for (``comm_plan``).
- ``zb_h1`` (``zero_bubble``): backwards split into ``B`` (input gradient) and
  ``W`` (weight gradients; after its ``B``, no communication); stage ``s`` never
  holds more than ``p`` microbatches whose forward is done and whose ``W`` is
  not (1F1B's peak activation memory, its first stage's; ``w_lags`` from the
  stages' bytes keep it in bytes too); the ``W``s fill the cool-down bubble.
- ``zbv``: two chunks per stage in a V, split backwards; stage ``s`` never holds
  more than ``2p`` microbatch-chunks whose forward is done and whose ``W`` is not
  (1F1B's peak activation memory: each chunk is half a stage).

``build_forward_schedule`` is the forward-only schedule evaluation runs (no ``B``,
no gradient messages): every microbatch through every chunk in the forward order of
the training schedule (plain order; with ``v > 1`` the interleaved order, groups of
``p`` microbatches advancing through the chunks). It meets the same contract (each
``F`` once, matched FIFO messages, no deadlock under simulation and under NCCL
batches).
"""

from __future__ import annotations

from typing import Sequence

from parallel3d.pipeline.actions import (
    ACTION_KINDS,
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    CommStep,
    Schedule,
    ScheduleError,
    comm_plan,
    placement_of,
    schedule_shape,
    stage_and_chunk,
    virtual_stage,
)
from parallel3d.option_checks import check_choice
from parallel3d.pipeline.options import SCHEDULES, SPLIT_DRAIN_SCHEDULES
from parallel3d.pipeline.placement import ChunkPlacement, placement_for
from parallel3d.pipeline.zero_bubble import zb_h1_order, zbv_schedule
from parallel3d.pipeline.simulate import TimedAction, Timeline, check_coalesced_progress, format_timeline, simulate
from parallel3d.pipeline.schedule_checks import peak_in_flight, validate_schedule

# The schedule vocabulary (actions.py), the schedule names (options.py), the simulator (simulate.py) and
# the contract's checks (schedule_checks.py) are re-exported here.
SCHEDULE_NAMES = SCHEDULES
__all__ = [
    "ACTION_KINDS", "COMM_KINDS", "COMPUTE_KINDS", "SCHEDULE_NAMES", "Action", "CommStep", "Schedule",
    "ScheduleError", "TimedAction", "Timeline", "build_forward_schedule", "build_schedule",
    "check_coalesced_progress", "comm_plan",
    "format_schedule", "format_timeline", "peak_in_flight", "placement_of", "schedule_shape", "simulate",
    "stage_and_chunk", "stage_compute_order", "validate_schedule", "virtual_stage",
]

# ---- building ----------------------------------------------------------------------
def _check_args(name: str, p: int, m: int, v: int) -> None:
    check_choice("parallel.schedule", name, SCHEDULES)
    for key, value in (("num_stages", p), ("num_microbatches", m), ("num_virtual_stages", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")
    if name == "zbv" and v != 2:
        raise ValueError(f"schedule 'zbv' runs two chunks per stage: num_virtual_stages must be 2, got {v}")
    if name not in ("interleaved_1f1b", "zbv") and v != 1:
        raise ValueError(
            f"schedule {name!r} has no virtual stages (num_virtual_stages={v}); use 'interleaved_1f1b' or 'zbv'"
        )
    if name == "interleaved_1f1b" and v > 1 and p == 1:
        raise ValueError("interleaved_1f1b with num_virtual_stages > 1 needs num_stages >= 2 (a chunk cannot send to itself)")
    if name == "interleaved_1f1b" and v > 1 and m % p:
        raise ValueError(
            f"interleaved_1f1b needs num_microbatches divisible by num_stages: "
            f"num_microbatches={m}, num_stages={p}"
        )


Compute = tuple[str, int, int]  # (kind, microbatch, chunk)


def _with_comms(stage: int, place: ChunkPlacement, iterations: list[list[Compute]]) -> list[Action]:
    """Wrap each iteration (one or more computations) in the receives it needs and the sends it feeds.

    Receives come in computation order before the iteration, sends after it, so the comm
    actions between two iterations (one batch, see ``actions.comm_plan``) are the previous
    iteration's sends and the next one's receives. A neighbour chunk on this stage gets no message.
    """
    last = place.total - 1
    # Per local chunk: whether its model chunk's predecessor / successor sits on another stage (asked once
    # per chunk, not per action: a planner search builds thousands of schedules).
    chunks = {c for iteration in iterations for _, _, c in iteration}
    remote_prev, remote_next = {}, {}
    for chunk in chunks:
        vs = place.model_chunk(stage, chunk)
        remote_prev[chunk] = vs > 0 and place.stage_of(vs - 1) != stage
        remote_next[chunk] = vs < last and place.stage_of(vs + 1) != stage
    out: list[Action] = []
    for iteration in iterations:
        for kind, mb, chunk in iteration:
            if kind == "F" and remote_prev[chunk]:
                out.append(Action("RECV_ACT", mb, chunk))
            elif kind == "B" and remote_next[chunk]:
                out.append(Action("RECV_GRAD", mb, chunk))
        out += [Action(kind, mb, chunk) for kind, mb, chunk in iteration]
        for kind, mb, chunk in iteration:
            if kind == "F" and remote_next[chunk]:
                out.append(Action("SEND_ACT", mb, chunk))
            elif kind == "B" and remote_prev[chunk]:
                out.append(Action("SEND_GRAD", mb, chunk))
    return out


def _iterations(compute: list[Compute], warmup: int) -> list[list[Compute]]:
    """Megatron's iterations: each warm-up forward alone, then steady (F, B) pairs, then lone backwards. A
    ``W`` (the split drain's) opens the next iteration, so the batch of its ``B``'s sends and the next
    iteration's receives stays one batch, posted before the ``W`` (``comm_plan``: a ``W`` waits for none)."""
    out = [[c] for c in compute[:warmup]]
    i, carried = warmup, []
    while i < len(compute):
        if compute[i][0] == "W":
            carried.append(compute[i])
            i += 1
            continue
        pair = compute[i][0] == "F" and i + 1 < len(compute) and compute[i + 1][0] == "B"
        out.append(carried + compute[i : i + 2] if pair else carried + [compute[i]])
        carried = []
        i += 2 if pair else 1
    return out + ([carried] if carried else [])


def _gpipe(stage: int, p: int, m: int) -> list[Compute]:
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def _one_f_one_b(stage: int, p: int, m: int, split_drain: bool = False) -> list[Compute]:
    """1F1B's order; ``split_drain``: each backward after the stage's last forward is split, its ``W``
    right after its ``B`` (stage 0 excepted: no stage upstream waits for its input gradient)."""
    warmup = min(p - stage - 1, m)
    order = [("F", i, 0) for i in range(warmup)]  # warm-up: fill the pipe below us
    for i in range(m - warmup):  # steady state: one forward, then the oldest backward
        order += [("F", warmup + i, 0), ("B", i, 0)]
    order += [("B", i, 0) for i in range(m - warmup, m)]  # cool-down: drain
    if not split_drain or stage == 0:
        return order
    # The backwards from the one paired with the last forward on: the input gradient goes upstream
    # (its send sits between B and W) a W earlier; W right after B keeps 1F1B's order and peak.
    drain = {("B", i, 0) for i in range(m - warmup - 1, m)}
    return [x for c in order for x in ((c, ("W", c[1], 0)) if c in drain else (c,))]


def _interleaved_warmup(stage: int, p: int, m: int, v: int) -> int:
    # Later stages start backwards sooner; every stage first fills all its chunks once.
    return min((p - stage - 1) * 2 + (v - 1) * p, m * v)


def _interleaved_forward(k: int, p: int, v: int) -> tuple[int, int]:
    """(microbatch, chunk) of a stage's k-th forward in the interleaved order."""
    return (k // (p * v)) * p + k % p, (k // p) % v


def _interleaved(stage: int, p: int, m: int, v: int, split_drain: bool = False) -> list[Compute]:
    """Narayanan et al. 2021: microbatches advance in groups of p through the v chunks. ``split_drain``: as
    1F1B's, each backward from the one paired with the stage's last forward on is split, its ``W`` right
    after its ``B``, but the model's first chunk's (stage 0's chunk 0: no stage upstream waits for it)."""

    def fwd(k: int) -> tuple[int, int]:  # (microbatch, chunk) of this stage's k-th forward
        return _interleaved_forward(k, p, v)

    def bwd(k: int) -> tuple[int, int]:
        return (k // (p * v)) * p + k % p, v - 1 - (k // p) % v

    total = m * v
    warmup = _interleaved_warmup(stage, p, m, v)
    order = [("F", *fwd(k)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", *fwd(warmup + k)), ("B", *bwd(k))]
    order += [("B", *bwd(k)) for k in range(total - warmup, total)]
    if not split_drain:
        return order
    drain = {("B", *bwd(k)) for k in range(max(total - warmup - 1, 0), total)} - {("B", i, 0) for i in range(m)
                                                                               if stage == 0}
    return [x for c in order for x in ((c, ("W", c[1], c[2])) if c in drain else (c,))]


def stage_compute_order(name: str, stage: int, p: int, m: int, v: int = 1, w_lag: int | None = None,
                        split_drain: bool = False) -> list[Compute]:
    """``stage``'s computations ``(kind, microbatch, chunk)`` in the order ``build_schedule`` lowers them
    (arguments checked there), without the other stages or the messages: what the memory estimate walks.
    Every schedule but ``zbv``, whose stages are built together (``zbv_schedule``)."""
    if name == "interleaved_1f1b" and v == 1:
        name = "1f1b"  # one chunk per stage: interleaving degenerates to plain 1F1B
    if name == "gpipe":
        return _gpipe(stage, p, m)
    if name == "zb_h1":
        return zb_h1_order(stage, p, m, w_lag)
    if name == "1f1b":
        return _one_f_one_b(stage, p, m, split_drain)
    if name == "interleaved_1f1b":
        return _interleaved(stage, p, m, v, split_drain)
    raise ValueError(f"stage_compute_order: schedule {name!r} is built for all stages at once (build_schedule)")


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_virtual_stages: int = 1,
    *,
    coalesced_p2p: bool = False,
    w_lags: Sequence[int] | None = None,
    split_drain: bool = False,
    validate: bool = True,
) -> Schedule:
    """One action list per stage for schedule ``name``; validated before it is returned (``validate=False``:
    not, for the planner's pricing alone; what runs, the engine and the dry run, always builds validated).

    ``coalesced_p2p``: the backend runs each p2p batch as one unit, in FIFO order (NCCL; see
    the module contract); only ``interleaved_1f1b`` places its communication differently.
    ``w_lags`` (``zb_h1`` only; default stage ``s`` lags ``s``): per stage, how many microbatches its
    ``W``s trail its ``B``s (``zero_bubble.zb_h1_lags`` picks them from the stages' bytes).
    ``split_drain`` (the schedules in ``options.SPLIT_DRAIN_SCHEDULES``; ``options.drain_is_split`` decides it
    from the config): the backwards after a stage's last forward are split, ``W`` right after ``B``
    (module contract).
    """
    p, m, v = num_stages, num_microbatches, num_virtual_stages
    _check_args(name, p, m, v)
    if w_lags is not None and (name != "zb_h1" or len(w_lags) != p):
        raise ValueError(f"w_lags={w_lags!r}: one lag per stage ({p}), for zb_h1 only (schedule {name!r})")
    if name == "interleaved_1f1b" and v == 1:
        name = "1f1b"  # one chunk per stage: interleaving degenerates to plain 1F1B
    if split_drain and name not in SPLIT_DRAIN_SCHEDULES:
        raise ValueError(f"split_drain=True: only schedules {list(SPLIT_DRAIN_SCHEDULES)} split their drain "
                         f"backwards (schedule {name!r})")
    place = placement_for(name, p, v)
    schedule = zbv_schedule(p, m) if name == "zbv" else Schedule(placement=place)
    for s in range(p if name != "zbv" else 0):
        compute = stage_compute_order(name, s, p, m, v, None if w_lags is None else w_lags[s], split_drain)
        if name == "interleaved_1f1b" and coalesced_p2p:
            iterations = _iterations(compute, _interleaved_warmup(s, p, m, v))
        else:
            iterations = [[c] for c in compute]
        schedule[s] = _with_comms(s, place, iterations)
    if validate:
        limits = {"1f1b": lambda s: p - s, "zb_h1": lambda s: p, "zbv": lambda s: 2 * p}
        validate_schedule(schedule, num_microbatches=m, num_virtual_stages=v, max_in_flight=limits.get(name),
                          coalesced_p2p=coalesced_p2p)
    return schedule


def build_forward_schedule(
    num_stages: int, num_microbatches: int, num_virtual_stages: int = 1, *, coalesced_p2p: bool = False,
    placement: str = "loop",
) -> Schedule:
    """The forward-only schedule (evaluation) on the ``placement`` kind of the training schedule
    (see the module doc); validated before it is returned."""
    p, m, v = num_stages, num_microbatches, num_virtual_stages
    if placement == "v":
        _check_args("zbv", p, m, v)
    else:
        _check_args("interleaved_1f1b" if v > 1 else "gpipe", p, m, v)
    place = ChunkPlacement(p, v, placement)
    schedule = zbv_schedule(p, m, forward_only=True) if placement == "v" else Schedule(placement=place)
    for s in range(p if placement != "v" else 0):
        order = [("F", *_interleaved_forward(k, p, v)) for k in range(m * v)] if v > 1 else [("F", i, 0) for i in range(m)]
        schedule[s] = _with_comms(s, place, [[c] for c in order])
    validate_schedule(schedule, num_microbatches=m, num_virtual_stages=v, coalesced_p2p=coalesced_p2p,
                      forward_only=True)
    return schedule


# ---- printable views ------------------------------------------------------------------
def format_schedule(schedule: Schedule, *, show_comms: bool = False) -> str:
    """One row per stage, e.g. ``stage 1: F0 F1 B0 F2 B1 B2`` (chunk shown as ``c1`` if v > 1)."""
    _, _, v = schedule_shape(schedule)
    rows = []
    for stage in sorted(schedule):
        labels = [a.label(v > 1) for a in schedule[stage] if show_comms or a.is_compute]
        rows.append(f"stage {stage}: " + " ".join(labels))
    return "\n".join(rows)
