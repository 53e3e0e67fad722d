"""ParallelState on real gloo ranks: each group's members seen from every rank equal the Topology's,
one-rank groups are never created, and kinds with the same ranks share one process group.

(Kept apart from test_topology, whose megatron-core import would slow every spawned rank.)
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import GROUP_KINDS, LayoutError, Topology
from tests.harness import run_on_ranks


def test_single_process_state_needs_no_distributed():
    ps = ParallelState.single_process()
    assert [ps.size(d) for d in ("tp", "cp", "ep", "dp", "pp", "etp", "edp")] == [1] * 7
    assert ps.is_first_stage and ps.is_last_stage and ps.group("tp") is None
    assert ps.next_stage_rank is None and ps.ranks("world") == [0]
    with pytest.raises(LayoutError, match="unknown group kind"):
        ps.group("data")


# ---- real process groups ---------------------------------------------------------------------
def _check_groups(rank, world_size, layout):
    topo = Topology(**layout)
    made = []
    real_new_group = dist.new_group

    def recording_new_group(*args, **kwargs):  # records which lists were asked for; creates them as usual
        made.append(list(kwargs["ranks"]))
        return real_new_group(*args, **kwargs)

    before = set(c10d._world.pg_map)
    dist.new_group = recording_new_group
    try:
        ps = ParallelState(topo)
    finally:
        dist.new_group = real_new_group
    mine = len(set(c10d._world.pg_map) - before)
    assert ps.coords == topo.coords(rank)
    members, alone, shared = {}, [], []
    for kind in GROUP_KINDS:  # the same order on every rank: each collective has all its members
        if len(ps.ranks(kind)) <= 1:
            alone.append((kind, ps.group(kind) is None))
            continue
        # Sum of one-hot rank vectors over the group reveals exactly who is in it.
        t = torch.zeros(world_size)
        t[rank] = 1.0
        dist.all_reduce(t, group=ps.group(kind))
        members[kind] = [i for i, v in enumerate(t.tolist()) if v == 1.0]
    for a, b in itertools.combinations(members, 2):
        shared.append((a, b, ps.group(a) is ps.group(b)))
    if ps.next_stage_rank is not None:  # pipeline neighbours agree with a real send/recv
        dist.send(torch.tensor([float(rank)]), dst=ps.next_stage_rank)
    if ps.prev_stage_rank is not None:
        buf = torch.zeros(1)
        dist.recv(buf, src=ps.prev_stage_rank)
        assert int(buf.item()) == ps.prev_stage_rank
    ps.destroy()
    return {"made": made, "mine": mine, "members": members, "alone": alone, "shared": shared}


@pytest.mark.parametrize("layout", [
    dict(tp=2, cp=2, dp=2, ep=2),  # the expert groups coincide with dense ones: one communicator each
    dict(tp=2, dp=2, pp=2, ep=4, etp=1, order="pp-dp-tp-cp-ep"),
], ids=["tp2-cp2-dp2-ep2", "tp2-dp2-pp2-ep4-etp1"])
def test_eight_rank_groups_are_the_right_ranks(layout):
    topo = Topology(**layout)
    results = run_on_ranks(_check_groups, 8, layout)
    # Every rank asked for each distinct multi-rank list once, in GROUP_KINDS order, and nothing else.
    expected = []
    for kind in GROUP_KINDS:
        expected += [g for g in topo.groups(kind) if len(g) > 1 and g not in expected]
    for rank, got in enumerate(results):
        assert got["made"] == expected
        assert got["mine"] == sum(rank in g for g in expected)  # process groups that exist on this rank
        assert got["members"] == {k: topo.group_of(k, rank) for k in GROUP_KINDS
                                  if len(topo.group_of(k, rank)) > 1}
        assert all(is_none for _, is_none in got["alone"])
        for a, b, same in got["shared"]:
            assert same == (topo.group_of(a, rank) == topo.group_of(b, rank)), (a, b)
    if topo.pp == 1:  # kinds of one-rank groups get no process group at all
        assert {k for k, _ in results[0]["alone"]} >= {"pp", "embedding"}
    assert any(same for _, _, same in results[0]["shared"])  # e.g. etp == tp: one communicator


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
