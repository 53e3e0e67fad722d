"""The comm layer: size-1 no-ops, ring byte accounting, errors that name rank and op, and the one
world reduction every all-rank agreement (metrics, summary, stop, checkpoint commit) uses."""

import os
import signal
import warnings

import pytest
import torch

from parallel3d import comm, metrics, summary
from parallel3d.checkpoint import CheckpointManager
from parallel3d.parallel_state import ParallelState
from parallel3d.preemption import StopPolicy
from parallel3d.topology import Topology
from tests.harness import run_on_ranks


def test_single_process_collectives_are_noops():
    ps = ParallelState.single_process()
    t = torch.arange(4.0)
    assert comm.all_reduce(t, ps, "tp") is None
    assert comm.AsyncSumAllReduce(ps, "tp")(t) is None
    assert torch.equal(t, torch.arange(4.0))
    out = torch.empty(4)
    comm.all_gather_into_tensor(out, t, ps, "dp")
    assert torch.equal(out, t)
    assert ps.comm_stats.total() == 0


def _collectives(rank, world_size):
    ps = ParallelState(Topology(tp=2, pp=1, dp=2))
    n = 2
    x = torch.full((6,), float(rank))
    comm.all_reduce(x, ps, "tp")
    tp_peers = ps.ranks("tp")
    assert torch.allclose(x, torch.full((6,), float(sum(tp_peers))))
    full = torch.arange(8.0) + rank
    shard = torch.empty(4)
    comm.reduce_scatter_tensor(shard, full, ps, "dp")
    dp_peers = ps.ranks("dp")
    expected = sum(torch.arange(8.0) + r for r in dp_peers)
    idx = dp_peers.index(rank)
    assert torch.allclose(shard, expected[idx * 4 : (idx + 1) * 4])
    gathered = torch.empty(8)
    comm.all_gather_into_tensor(gathered, shard, ps, "dp")
    assert torch.allclose(gathered, expected)
    nbytes = 6 * 4
    assert ps.comm_stats.bytes[("tp", "all_reduce")] == 2 * nbytes * (n - 1) // n
    # reduce-scatter + all-gather of N bytes cost what one all-reduce of N costs.
    rs_ag = ps.comm_stats.bytes[("dp", "reduce_scatter")] + ps.comm_stats.bytes[("dp", "all_gather")]
    assert rs_ag == 2 * 8 * 4 * (n - 1) // n
    # The prepared launch (ZeRO's buckets): the same sum and the same bytes as ``all_reduce``.
    y = torch.full((6,), rank + 0.5)
    work = comm.AsyncSumAllReduce(ps, "tp")(y)
    work.wait()
    assert torch.equal(y, torch.full((6,), sum(r + 0.5 for r in tp_peers)))
    assert ps.comm_stats.bytes[("tp", "all_reduce")] == 2 * (2 * nbytes * (n - 1) // n)
    return True


def test_collectives_on_four_ranks():
    assert all(run_on_ranks(_collectives, 4))


def _missing_peer(rank, world_size):
    ps = ParallelState(Topology(tp=1, pp=1, dp=2), timeout_s=2)
    if rank == 1:
        return "skipped"
    try:
        comm.all_reduce(torch.ones(3), ps, "dp")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_collective_timeout_names_rank_and_op():
    msgs = run_on_ranks(_missing_peer, 2, timeout=60)
    assert msgs[1] == "skipped"
    assert msgs[0].startswith("rank 0: all_reduce on the dp group [0, 1] failed"), msgs[0]


class _Work:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1

    def is_completed(self) -> bool:
        return self.waits > 0


def test_coalesced_work_waits_each_op_once_and_streams_keep_fifo_order():
    ops = [_Work(), _Work()]
    batch = comm.CoalescedWork(ops)
    assert not batch.is_completed()
    batch.wait()
    batch.wait()  # a second wait on a gloo p2p Work would block until the timeout
    assert [w.waits for w in ops] == [1, 1] and batch.is_completed()
    # NCCL runs a group's batches in order: posting the next one first waits for the previous.
    streams = comm.EmulatedP2PStreams()
    first, other_group = comm.CoalescedWork([_Work()]), comm.CoalescedWork([_Work()])
    streams.posted("pp", first)
    streams.posted("dp", other_group)
    streams.before_post("pp")
    assert first.is_completed() and not other_group.is_completed()


def test_batch_isend_irecv_of_nothing_posts_nothing():
    assert comm.batch_isend_irecv([], ParallelState.single_process()) == []


def _agreements(rank, world_size, layout, root):
    """Every all-rank agreement, on a layout with a dimension (cp) that tp/pp/dp groups alone miss."""
    ps = ParallelState(Topology(**layout))
    out = {"slots": summary.per_rank_values(10.0 * rank, ps)}
    reduced = metrics.reduce_over_world({"v": float(rank)}, ps)["v"]
    out["reduced"] = (reduced.max, reduced.min, reduced.sum, reduced.mean)
    policy = StopPolicy(ps, [], None)
    if rank == world_size - 1:
        policy.received = signal.SIGTERM
    out["stop"] = policy.should_stop(0.1)

    def write(tmp):
        if rank == 2:
            raise OSError("disk full on purpose")
        open(os.path.join(tmp, f"rank{rank}"), "w").close()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = CheckpointManager(root, ps)
        out["saved"] = manager.save(1, write, {})
    ps.destroy()
    return out


@pytest.mark.parametrize("layout", [dict(tp=2, cp=2, dp=2), dict(cp=2, pp=2, ep=2, etp=1, dp=2)],
                         ids=["tp2-cp2-dp2", "cp2-pp2-dp2-ep2"])
def test_world_agreements_cover_every_rank(layout, tmp_path):
    results = run_on_ranks(_agreements, 8, layout, str(tmp_path))
    for rank, out in enumerate(results):
        assert out["slots"] == [10.0 * r for r in range(8)]
        assert out["reduced"] == (7.0, 0.0, 28.0, 3.5)
        expected_stop = "received SIGTERM" if rank == 7 else "SIGTERM received on another rank"
        assert out["stop"] == expected_stop
        assert out["saved"] is False  # rank 2's failed write vetoes the commit everywhere
    assert not os.path.exists(tmp_path / "step_00000001")
