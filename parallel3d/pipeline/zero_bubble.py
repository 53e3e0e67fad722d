"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

A backward is split into ``B`` (the input gradient, which the previous stage waits
for) and ``W`` (the weight gradients, which nobody waits for; see
``backward_split``). ``zb_h1`` is 1F1B's order of ``F`` and ``B`` with the ``W``s
placed so that no stage holds more microbatches than 1F1B's first stage does
(``p``: a microbatch is held from its ``F`` until its ``W``), i.e. 1F1B's peak
activation memory counted in microbatches:

- stage ``s`` runs 1F1B's ``p - 1 - s`` warm-up forwards, then steady ``F B``
  pairs, then the cool-down ``B``s;
- its ``W``s trail its ``B``s by a lag ``d_s <= s`` microbatches in the steady state (one
  ``W`` after each pair once ``d_s`` ``B``s are done: ``p - 1 - s`` warm-up + 1 + ``d_s``
  <= ``p`` in flight at most), one ``W`` after each cool-down ``B``, and the rest at the
  end. The paper's lag is ``d_s = s``; ``zb_h1_lags`` shortens it where bytes say so (below).

Memory, in bytes (``pending_at_forwards``; ``tests/test_zb_memory.py``): at each of its
``F``s stage ``s`` holds at most 1F1B's ``p - s`` forwards whose ``B`` is pending, each a
microbatch's saved activations ``A_s``, plus at most ``d_s`` microbatches whose ``W`` is pending,
each exactly what its deferring linears' weight GEMMs read, ``W_s`` = their inputs + output
gradients (``deferred_grads``; nothing else survives ``B``); right after a steady ``B`` one of
the former has become one of the latter. The paper's "1F1B's peak" takes ``W_s <= A_s`` and
equal stages: then every stage holds at most ``p * A`` like 1F1B's first stage. Neither is
given: a transformer layer saves about its linears' inputs and outputs, so ``W_s`` is close to
``A_s`` (gpt, hidden 128: 2.00 vs 2.01 MiB per two layers), but the last stage's ``W_s`` also
holds the head's input and the logits' gradient (vocab-wide), so with ``d = p - 1`` its
``(p - 1) W_s + A_s`` topped stage 0's ``p A_0`` (p = 4, m = 8, gpt_tiny hidden 128, vocab
1024: 10.33 MiB vs 8.13). ``zb_h1_lags`` therefore takes, per stage, the longest lag whose peak
(after any ``F`` or ``B``) stays within 1F1B's peak ``max_s min(p - s, m) A_s``, from the
per-microbatch bytes (``planning.zb_lags`` reads them off the model shape): at p = 4 that
lag is 2 on the last stage (2.64 + 2 x 2.5625 = 7.77 MiB), at p = 2 it is 0. Computing the
head's weight gradient in ``B`` instead (no vocab-wide wait) would not do: 2.64 + 3 x 2.0 =
8.64 MiB, still above 8.13. Where even lag 0 tops it (``W_s`` above ``A_s``, e.g. full
recompute, where ``A_s`` is the chunk input alone) the lag is 0, the least a split holds.

What a shorter lag costs: the last stage's trailing ``W``s are what let it run ahead of its
upstream early and fill the end, so each microbatch of lag taken off it lengthens the step by
about one ``W`` (simulated, p = 4, m = 8, F : B : W = 1 : 1 : 0.5, the last stage 1.3x: bubble
0.281 at lags 0 1 2 3, 0.296 at 0 1 2 2, 1F1B 0.358; at p = 2, 0.154 at 0 1, 0.174 at 0 0,
1F1B 0.193); no other placement of the last stage's ``W``s within two waiting does better
(exhaustive search, same costs). Every lag keeps zb_h1's bubble below 1F1B's (all lags at
p <= 4, m = 8, F : B : W = 1 : 1 : 1, 0.5 and 0.9; ``tests/test_zb_memory.py``), and no lag
changes a gradient: each stage's ``W``s still run in microbatch order (``tests/test_zero_bubble.py``).

So the ``B`` chain of the cool-down runs upstream at the cost of ``B`` alone while
the later stages' deferred ``W``s fill what 1F1B leaves idle: with ``F = B = W``
the bubble is ``(p-1)/(3m+p-1)`` against 1F1B's ``3(p-1)/(3m+3(p-1))``
(p=4, m=8: 0.111 vs 0.273). Correctness (each action once, receives before use,
no deadlock, also under NCCL batches) is checked by ``schedules.validate_schedule``
like every other schedule.

``zbv`` (ZB-V; Qi et al. 2024, "Pipeline Parallelism with Controllable Memory") runs two
chunks per stage in a V (``placement``: stage ``s`` holds model chunks ``s`` and
``2p - 1 - s``), so the first and the last chunk, and the two chunks at the turn, share a
stage, and with ``W`` filling the gaps its bubble approaches zero at 1F1B's peak memory
(at most ``2p`` microbatch-chunks of half a stage each in flight: ``p`` microbatches'
worth, 1F1B's first stage). ``zbv_order`` builds it by list scheduling on a machine with
fixed relative costs (``ZBV_BUILD_COSTS``: F = 1, B = 1.2, W = 0.6; messages free), all stages at
once: whenever a stage is free
it runs, among the computations whose inputs are ready, a ``B`` before an ``F`` before a
``W`` (``B`` unblocks the stage upstream, nobody waits for ``W``); among ``B``s and ``W``s
the oldest microbatch first, among ``F``s the chunk nearest the loss first (so the first
microbatch reaches the loss early), then the oldest; an ``F`` only while the stage holds
fewer than ``2p`` microbatch-chunks. When nothing is ready, the stage that can start
soonest goes next. Simulated at F = B = W: bubble 0.094 at p = 4, m = 8, against interleaved
1F1B's 0.158 at v = 2.

Why W cheaper than F and B when building: a W is only the weight-gradient GEMMs, while B carries
the input GEMMs plus attention's and the norms' backward; measured in-process on one gpt_tiny
layer (CPU, thread CPU time of forward, B, W), F : B : W is about 1 : 1 : 0.5 at hidden 128 and
1 : 1 : 0.9 at hidden 256. An order built at F = B = W = 1 assumes a W fills a whole F-sized gap;
run with cheaper Ws, its stages wait on the V's turn and the order was 1.06-1.2x interleaved
1F1B's step in the simulator at the measured costs (and 1.15-1.21x measured). Built at 1 : 1.2 :
0.6 it is at or below interleaved's at the measured costs, at F = B = W, and with message time
(``tests/test_zero_bubble.py``). With few microbatches (m < 2p) the order built at F = B = W
can still be the better one, so ``zbv_schedule`` keeps the least-regret order of the two. The
ratios only pick the order; every rank builds the same one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from parallel3d.pipeline.actions import Action, Schedule, splits_backward
from parallel3d.pipeline.placement import ChunkPlacement
from parallel3d.pipeline.simulate import simulate

Compute = tuple[str, int, int]  # (kind, microbatch, chunk)

__all__ = ["holding_after", "pending_at_forwards", "zb_h1_lags", "zb_h1_order", "zbv_order", "zbv_schedule"]


def zb_h1_order(stage: int, p: int, m: int, lag: int | None = None) -> list[Compute]:
    """Stage ``stage``'s ZB-H1 computation order for ``p`` stages and ``m`` microbatches.

    ``lag`` (default ``stage``, at most ``stage``): how many microbatches its steady-state ``W``s trail
    its ``B``s, i.e. how many wait for ``W`` at its forwards (``zb_h1_lags`` lowers it where bytes say so).
    """
    lag = stage if lag is None else lag
    if not 0 <= lag <= stage:
        raise ValueError(f"zb_h1_order: lag={lag!r} must be in 0..{stage} on stage {stage}")
    warmup = min(p - 1 - stage, m)
    order: list[Compute] = [("F", i, 0) for i in range(warmup)]
    next_w = 0
    for j in range(m - warmup):  # steady state: F, B, and the W that trails by `lag` microbatches
        order += [("F", warmup + j, 0), ("B", j, 0)]
        if j >= lag:
            order.append(("W", next_w, 0))
            next_w += 1
    for j in range(m - warmup, m):  # cool-down: each B, then one deferred W while the next B is on its way
        order.append(("B", j, 0))
        if next_w <= j:
            order.append(("W", next_w, 0))
            next_w += 1
    order += [("W", i, 0) for i in range(next_w, m)]
    return order


def holding_after(kinds: Iterable[str]) -> Iterator[tuple[str, int, int]]:
    """After each computation of one stage-chunk's order (``kinds``: its ``F``/``B``/``W`` in order):
    ``(kind, microbatches whose B is pending, microbatches whose B ran and W is pending)``. Without
    ``W``s (1F1B) the second count is meaningless: callers that mix both read it only for split orders."""
    forward = backward = weight = 0
    for kind in kinds:
        forward += kind == "F"
        backward += kind == "B"
        weight += kind == "W"
        yield kind, forward - backward, backward - weight


def _peak_bytes(order: list[Compute], held: float, waiting: float) -> float:
    """Most bytes ``order`` holds after any of its ``F``s or ``B``s (where the engine records its peak):
    ``held`` per microbatch whose ``B`` is pending, ``waiting`` per one whose ``W`` is."""
    return max((b * held + w * waiting for kind, b, w in holding_after(k for k, _, _ in order) if kind != "W"),
               default=0.0)


def zb_h1_lags(p: int, m: int, held: Sequence[float], waiting: Sequence[float]) -> tuple[int, ...]:
    """Per stage, the longest ``W`` lag (``zb_h1_order``) whose peak bytes stay within 1F1B's peak.

    ``held[s]``: bytes one microbatch keeps on stage ``s`` from its ``F`` to its ``B`` (``A_s``);
    ``waiting[s]``: from its ``B`` to its ``W`` (``W_s``). 1F1B's peak is the most any of its stages
    holds, ``max_s min(p - s, m) * A_s``. Invariant: every stage's zb_h1 peak is at most that, except
    where even lag 0 exceeds it (``W_s`` above ``A_s`` by more than the slack, e.g. full recompute),
    where the lag is 0 (the least a split backward holds). The longest lag keeps the most ``W``s for
    the cool-down (module doc); the simulator prices what a shorter one costs.
    """
    if len(held) != p or len(waiting) != p:
        raise ValueError(f"zb_h1_lags: need {p} bytes per stage, got held={list(held)}, waiting={list(waiting)}")
    budget = max(min(p - s, m) * held[s] for s in range(p))
    return tuple(next((d for d in range(s, -1, -1)
                       if _peak_bytes(zb_h1_order(s, p, m, d), held[s], waiting[s]) <= budget), 0)
                 for s in range(p))


def pending_at_forwards(actions: list[Action], chunk: int = 0) -> list[tuple[int, int]]:
    """At each ``F`` of ``chunk`` on one stage (after it; where the engine records its activation
    peak): ``(microbatches whose B is pending, microbatches whose B ran and W is pending)``.

    Invariant (``split`` schedules): a microbatch counts in exactly one of the two from its
    ``F`` to its ``W``; for 1F1B (no ``W``) the second is always 0.
    """
    splits = splits_backward(actions)
    kinds = (a.kind for a in actions if a.chunk == chunk and a.is_compute)
    return [(b, w if splits else 0) for kind, b, w in holding_after(kinds) if kind == "F"]


_KIND_RANK = {"B": 0, "F": 1, "W": 2}
ZBV_BUILD_COSTS = (1.0, 1.2, 0.6)  # relative F, B, W the order is built for (module doc: why)
ZBV_COST_MODELS = (ZBV_BUILD_COSTS, (1.0, 1.0, 1.0))  # zbv_schedule keeps the least-regret order of these


def zbv_order(p: int, m: int, *, forward_only: bool = False,
              costs: tuple[float, float, float] = ZBV_BUILD_COSTS) -> list[tuple[int, Compute]]:
    """ZB-V's computations (local chunks 0 and 1 of the V placement) as ``(stage, computation)`` in the
    order the machine with relative ``costs`` (F, B, W) starts them (by start time, then stage); see
    the module doc.

    ``forward_only``: the ``F``s alone, scheduled the same way with nothing held (evaluation).
    """
    if len(costs) != 3 or not all(c > 0 for c in costs):
        raise ValueError(f"zbv_order: costs={costs!r} must be three positive numbers (F, B, W)")
    cost = dict(zip("FBW", costs))
    place = ChunkPlacement(p, 2, "v")
    last = place.total - 1
    kinds = "F" if forward_only else "FBW"
    limit = place.total * m if forward_only else 2 * p
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, model chunk) -> end time
    next_mb = {(kind, k): 0 for kind in "FBW" for k in range(place.total)}  # each kind in microbatch order
    order: list[tuple[int, Compute]] = []
    clock, in_flight = [0.0] * p, [0] * p

    def ready_time(s: int, kind: str, i: int, k: int) -> float | None:
        """When (kind, i, model chunk k) on stage s has its inputs, or None if not yet known."""
        if kind == "F":
            return 0.0 if k == 0 else done.get(("F", i, k - 1))
        if kind == "B":
            return done.get(("F", i, k)) if k == last else done.get(("B", i, k + 1))
        return done.get(("B", i, k))

    for _ in range(len(kinds) * m * place.total):
        best: tuple | None = None  # (start, rank key, stage, kind, microbatch, local chunk)
        for s in range(p):
            options = []
            for c, k in enumerate(place.chunks_of(s)):
                for kind in kinds:
                    i = next_mb[(kind, k)]
                    if i == m or (kind == "F" and in_flight[s] >= limit):
                        continue
                    t = ready_time(s, kind, i, k)
                    if t is not None:
                        key = (_KIND_RANK[kind], -k, i) if kind == "F" else (_KIND_RANK[kind], i, -k)
                        options.append((max(t, clock[s]), key, s, kind, i, c))
            if options:
                start = min(o[0] for o in options)
                pick = min(o for o in options if o[0] == start)
                best = pick if best is None or (pick[0], pick[2]) < (best[0], best[2]) else best
        if best is None:
            raise RuntimeError(f"zbv_orders({p}, {m}): no stage can progress (memory limit {limit})")
        start, _, s, kind, i, c = best
        k = place.model_chunk(s, c)
        clock[s] = start + cost[kind]
        done[(kind, i, k)] = clock[s]
        next_mb[(kind, k)] += 1
        in_flight[s] += {"F": 1, "W": -1}.get(kind, 0)
        order.append((s, (kind, i, c)))
    return order


# ---- ZB-V's messages -----------------------------------------------------------------------------
def _lowered(place: ChunkPlacement, order: list[tuple[int, Compute]]) -> Schedule:
    """Per-stage action lists from computations in one global order (e.g. a simulated start order).

    Each computation is appended to its stage, then the send it feeds, and the matching
    receive is appended to the receiving stage at the same point: every stage posts its
    receives in its peers' send order (messages match first in, first out) and as early as
    the global order allows, so the batches ``comm_plan`` forms progress under NCCL's
    semantics (torch's pipelining lowers its schedules the same way).
    """
    schedule = Schedule({s: [] for s in range(place.num_stages)}, placement=place)
    last = place.total - 1
    for stage, (kind, mb, chunk) in order:
        schedule[stage].append(Action(kind, mb, chunk))
        vs = place.model_chunk(stage, chunk)
        to = vs + 1 if kind == "F" and vs < last else vs - 1 if kind == "B" and vs > 0 else None
        if to is None or place.stage_of(to) == stage:
            continue
        peer, peer_chunk = place.stage_and_chunk(to)
        schedule[stage].append(Action("SEND_ACT" if kind == "F" else "SEND_GRAD", mb, chunk))
        schedule[peer].append(Action("RECV_ACT" if kind == "F" else "RECV_GRAD", mb, peer_chunk))
    return schedule


def _peer_stage(a: Action, stage: int, place: ChunkPlacement) -> int:
    vs = place.model_chunk(stage, a.chunk)
    return place.stage_of(vs + 1 if a.kind in ("SEND_ACT", "RECV_GRAD") else vs - 1)


def _deferred_receives(schedule: Schedule) -> Schedule:
    """``_lowered``'s schedule with each receive moved as late as deadlock freedom allows.

    A receive moves down to the computation that reads it, keeping the order of receives
    from each peer (first in, first out), but never past a send to the same peer: between
    any two stages, sends and receives keep the order of the global (simulated) one, in
    which every send meets its receive. So two stages never both send first and wait
    for each other's receive, which rendezvous sends in FIFO batches (NCCL) would turn into
    a deadlock; ``check_coalesced_progress`` confirms it for the built schedule. Posted
    late, a receive no longer holds up its stage before the computation that reads it.
    """
    place = schedule.placement
    out = Schedule(placement=place)
    for stage, actions in schedule.items():
        held: dict[int, list[Action]] = {}  # peer -> its receives not posted yet, in order
        new: list[Action] = []

        def flush(peer: int, upto: Action | None = None) -> None:
            pending = held.get(peer, [])
            k = len(pending) if upto is None else pending.index(upto) + 1
            new.extend(pending[:k])
            del pending[:k]

        for a in actions:
            if a.kind in ("RECV_ACT", "RECV_GRAD"):
                held.setdefault(_peer_stage(a, stage, place), []).append(a)
                continue
            if a.kind in ("SEND_ACT", "SEND_GRAD"):
                flush(_peer_stage(a, stage, place))
            else:
                need = Action("RECV_ACT" if a.kind == "F" else "RECV_GRAD", a.microbatch, a.chunk)
                for peer, pending in held.items():
                    if need in pending:
                        flush(peer, need)
            new.append(a)
        out[stage] = new
    return out


def zbv_schedule(p: int, m: int, *, forward_only: bool = False) -> Schedule:
    """ZB-V with its messages (``zbv_order`` lowered, receives deferred); validated by the caller.

    Of the orders built at each of ``ZBV_COST_MODELS``, the one whose simulated step is furthest
    from the best order's under its worst model is dropped (least regret; ties: the first, built
    at ``ZBV_BUILD_COSTS``): cheaper-W costs are what we measure, but with few microbatches
    (m < 2p) the order built at F = B = W can be the better one even there, and vice versa.
    """
    place = ChunkPlacement(p, 2, "v")
    if forward_only:
        return _deferred_receives(_lowered(place, zbv_order(p, m, forward_only=True)))
    candidates = [_deferred_receives(_lowered(place, zbv_order(p, m, costs=c))) for c in ZBV_COST_MODELS]
    steps = [[simulate(cand, f, b + w, wgrad_time=w).makespan for f, b, w in ZBV_COST_MODELS]
             for cand in candidates]
    best = [min(col) for col in zip(*steps)]
    regret = [max(t / b for t, b in zip(row, best)) for row in steps]
    return candidates[regret.index(min(regret))]
