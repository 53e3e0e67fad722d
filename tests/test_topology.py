"""Topology invariants on many shapes (pure Python) and real process groups on 8 gloo ranks."""

import itertools

import pytest
import torch
import torch.distributed as dist

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Coords, LayoutError, Topology
from tests.harness import run_on_ranks

SHAPES = [
    (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (3, 5, 1), (3, 5, 2), (4, 2, 3),
    (8, 4, 2), (1, 7, 3), (5, 1, 4), (2, 3, 7), (6, 1, 1), (1, 1, 9), (4, 4, 4), (3, 3, 3),
    (8, 16, 8), (2, 8, 1), (7, 2, 2), (1, 3, 5), (5, 5, 5), (8, 1, 16),
]
ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))]


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
@pytest.mark.parametrize("order", ORDERS)
def test_invariants(tp, pp, dp, order):
    topo = Topology(tp, pp, dp, order=order)
    world = topo.world_size
    assert world == tp * pp * dp
    ranks = set(range(world))
    # coords and rank_of are inverse, and coordinates cover the whole grid once.
    seen = set()
    for r in range(world):
        c = topo.coords(r)
        assert topo.rank_of(tp=c.tp, dp=c.dp, pp=c.pp) == r
        seen.add((c.tp, c.dp, c.pp))
    assert len(seen) == world
    expected_sizes = {"tp": tp, "dp": dp, "pp": pp, "model": tp * pp}
    for kind, size in expected_sizes.items():
        groups = topo.groups(kind)
        assert all(len(g) == size for g in groups), kind
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(ranks), f"{kind} groups do not partition the ranks"
        for g in groups:
            for r in g:
                assert topo.group_of(kind, r) == g
    # Members of a group differ exactly in the group's own coordinates.
    for g in topo.groups("tp"):
        cs = [topo.coords(r) for r in g]
        assert len({(c.dp, c.pp) for c in cs}) == 1 and sorted(c.tp for c in cs) == list(range(tp))
    for g in topo.groups("pp"):
        cs = [topo.coords(r) for r in g]
        assert len({(c.tp, c.dp) for c in cs}) == 1 and sorted(c.pp for c in cs) == list(range(pp))
    for g in topo.groups("dp"):
        cs = [topo.coords(r) for r in g]
        assert len({(c.tp, c.pp) for c in cs}) == 1 and sorted(c.dp for c in cs) == list(range(dp))
    # Embedding groups: the two ends of each pipeline (one rank when pp == 1).
    emb = topo.groups("embedding")
    assert len(emb) == tp * dp
    for g in emb:
        stages = sorted(topo.coords(r).pp for r in g)
        assert stages == sorted({0, pp - 1})
    # Neighbours walk each pipeline in order.
    for r in range(world):
        c = topo.coords(r)
        nxt, prv = topo.next_stage_rank(r), topo.prev_stage_rank(r)
        assert (nxt is None) == (c.pp == pp - 1) == topo.is_last_stage(r)
        assert (prv is None) == (c.pp == 0) == topo.is_first_stage(r)
        if nxt is not None:
            assert topo.coords(nxt) == Coords(tp=c.tp, dp=c.dp, pp=c.pp + 1)
            assert topo.prev_stage_rank(nxt) == r


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
def test_default_order_tp_groups_are_consecutive(tp, pp, dp):
    topo = Topology(tp, pp, dp)
    for g in topo.groups("tp"):
        assert g == list(range(g[0], g[0] + tp))
    # Pipeline stages are furthest apart: stage s starts at s * tp * dp.
    for r in range(topo.world_size):
        assert topo.coords(r).pp == r // (tp * dp)


def test_rank_formula_matches_order_string():
    topo = Topology(tp=2, pp=3, dp=4, order="dp-pp-tp")
    # dp fastest, then pp, then tp slowest.
    assert topo.rank_of(tp=1, dp=3, pp=2) == 3 + 4 * (2 + 3 * 1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp=0, pp=1, dp=1), "tp must be >= 1"),
        (dict(tp=1, pp=-2, dp=1), "pp must be >= 1"),
        (dict(tp=1, pp=1, dp=1.5), "dp must be an integer"),
        (dict(tp=1, pp=1, dp=1, order="tp-dp-xx"), "unknown dimension 'xx'"),
        (dict(tp=1, pp=1, dp=1, order="tp-tp-pp"), "appears more than once"),
        (dict(tp=1, pp=1, dp=1, order="tp-dp"), "missing dimension 'pp'"),
    ],
)
def test_bad_shapes_fail_with_clear_message(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        Topology(**kwargs)


def test_world_size_and_model_checks():
    topo = Topology(tp=2, pp=2, dp=2)
    with pytest.raises(LayoutError, match=r"tp\*pp\*dp = 2\*2\*2 = 8 but the job has world_size=6"):
        topo.check_world_size(6)
    with pytest.raises(LayoutError, match="num_heads=6 is not divisible by tp=4"):
        Topology(tp=4).check_model(num_layers=4, num_heads=6)
    with pytest.raises(LayoutError, match="num_kv_heads=2 is not divisible by tp=4"):
        Topology(tp=4).check_model(num_layers=4, num_heads=8, num_kv_heads=2)
    with pytest.raises(LayoutError, match="num_layers=3 is fewer than pipeline chunks"):
        Topology(pp=4).check_model(num_layers=3, num_heads=4)
    with pytest.raises(LayoutError, match="hidden_size=100 is not divisible by num_heads=3"):
        Topology().check_model(num_layers=3, num_heads=3, hidden_size=100)
    with pytest.raises(LayoutError, match="rank 8 out of range"):
        topo.coords(8)


def test_single_process_state_needs_no_distributed():
    ps = ParallelState.single_process()
    assert (ps.tp_size, ps.pp_size, ps.dp_size) == (1, 1, 1)
    assert ps.is_first_stage and ps.is_last_stage and ps.tp_group is None
    assert ps.next_stage_rank is None


def _check_groups(rank, world_size, tp, pp, dp, order):
    topo = Topology(tp, pp, dp, order=order)
    ps = ParallelState(topo)
    assert ps.coords == topo.coords(rank)
    out = {}
    for kind in ("tp", "dp", "pp", "model", "embedding"):
        members = ps.ranks(kind)
        if not members:
            continue
        # Sum of one-hot rank vectors over the group reveals exactly who is in it.
        t = torch.zeros(world_size)
        t[rank] = 1.0
        dist.all_reduce(t, group=ps.group(kind))
        out[kind] = [i for i, v in enumerate(t.tolist()) if v == 1.0]
        assert out[kind] == members, (kind, out[kind], members)
    # Pipeline neighbours agree with a real send/recv along the pipeline.
    if ps.next_stage_rank is not None:
        dist.send(torch.tensor([float(rank)]), dst=ps.next_stage_rank)
    if ps.prev_stage_rank is not None:
        buf = torch.zeros(1)
        dist.recv(buf, src=ps.prev_stage_rank)
        assert int(buf.item()) == ps.prev_stage_rank
    ps.destroy()
    return out


@pytest.mark.parametrize("order", ["tp-dp-pp", "pp-tp-dp"])
def test_eight_rank_groups_are_the_right_ranks(order):
    results = run_on_ranks(_check_groups, 8, 2, 2, 2, order)
    topo = Topology(2, 2, 2, order=order)
    for rank, groups in enumerate(results):
        for kind, members in groups.items():
            assert members == topo.group_of(kind, rank)
    assert {tuple(g) for g in topo.groups("tp")} == {tuple(results[r]["tp"]) for r in range(8)}


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def test_harness_reports_failing_rank():
    with pytest.raises(RuntimeError, match=r"failed on rank 1:(.|\n)*boom on purpose"):
        run_on_ranks(_raise_on_rank_one, 2, timeout=60)


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        import time

        time.sleep(60)


def test_harness_kills_ranks_after_timeout():
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish"):
        run_on_ranks(_hang_on_rank_zero, 2, timeout=3)
