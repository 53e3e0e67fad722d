"""Neighbouring pipeline stages' message cost for ``bench_pipeline_group``: the one-way latency of an
activation-sized message (``message_latency``, ``one_way_latency``: what ``simulate``'s ``p2p_time``
stands for) and, for comparison, an exchange's wall time (``message_time``).

Invariant: every rank of the pp ring calls these together and gets the same values.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def _ring_neighbours(pstate) -> tuple[int, int, int, int]:
    """(pp size, this rank's stage, the next stage's rank, the previous stage's rank) on the pp ring."""
    p, s = pstate.size("pp"), pstate.coord("pp")
    return (p, s, pstate.topology.stage_rank(pstate.rank, (s + 1) % p),
            pstate.topology.stage_rank(pstate.rank, (s - 1) % p))


def message_time(pstate, shape: tuple[int, ...], reps: int) -> float:
    """Mean seconds of one activation-sized send/recv exchange between neighbouring stages (pp ring),
    Python posting included: reported for comparison, not fed to ``simulate`` (``message_latency``)."""
    p, s, nxt, prev = _ring_neighbours(pstate)
    out, buf = torch.randn(shape), torch.empty(shape)
    group = pstate.group("pp")
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt, group=group),
                                            dist.P2POp(dist.irecv, buf, prev, group=group)]):
            work.wait()
    return (time.perf_counter() - start) / reps


def message_latency(pstate, shape: tuple[int, ...], reps: int, lead_s: float = 2e-3) -> tuple[float, float]:
    """(latency, posting) of one activation-sized message between neighbouring stages (pp ring):
    ``one_way_latency`` of stamps taken where a send's post begins and returns and where a blocked
    receiver's wait returns.

    The latency, not an exchange's wall time (``message_time``: two posts and two waits), is what
    ``simulate``'s ``p2p_time`` stands for in the benchmark's feed: the executor's posting of sends
    and receives is already in the stage's executor time per computation, and the receiver's
    blocked wait is the measured idle. The receiver posts its receive and blocks first; the sender
    posts ``lead_s`` later, so the message always finds a waiting receiver (as a blocked stage's
    receive does). Both ends stamp ``time.perf_counter`` (one system-wide monotonic clock on
    Linux, as the engine's ``start_time``). Invariant: every rank returns the same values.
    """
    p, s, nxt, prev = _ring_neighbours(pstate)
    out, buf = torch.randn(shape), torch.empty(shape)
    group = pstate.group("pp")
    posted: list[tuple[float, float]] = []  # this rank's sends: when the post began and returned
    woke: list[float] = []  # this rank's receives: when the wait returned
    for _ in range(reps):
        for sender in range(p):  # one link at a time: a rank is never sender and receiver at once
            dist.barrier()
            if s == (sender + 1) % p:
                work = dist.irecv(buf, prev, group=group)
                work.wait()
                woke.append(time.perf_counter())
            elif s == sender:
                time.sleep(lead_s)
                began = time.perf_counter()
                work = dist.isend(out, nxt, group=group)
                posted.append((began, time.perf_counter()))
                work.wait()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (s, posted, woke))
    return one_way_latency(gathered, p)


def one_way_latency(stamps: list[tuple[int, list[tuple[float, float]], list[float]]],
                    p: int) -> tuple[float, float]:
    """(latency, posting) from every stage's ``(stage, [(post began, post returned)], [woke])``;
    stage ``s``'s k-th send is stage ``s + 1``'s (mod ``p``) k-th receive.

    posting: the least time a post took, its cost when not preempted (the executor's time, so no
    part of the message's). latency: the median, over messages, of post began -> receiver woke,
    less the posting, at least 0. Median and least because a post's return stamp is unreliable on a
    busy machine: gloo hands the message on inside the call, the woken receiver may take the
    sender's core, and the sender's post then "returns" after the receiver woke.
    """
    by_stage = {st: (sent, got) for st, sent, got in stamps}
    pairs = [(sent, got) for st in range(p) for sent, got in zip(by_stage[st][0], by_stage[(st + 1) % p][1])]
    posting = min(end - began for (began, end), _ in pairs)
    return max(0.0, statistics.median(got - began for (began, _), got in pairs) - posting), posting
