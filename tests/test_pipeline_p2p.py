"""Point-to-point transfers (gloo, and gloo emulating NCCL) and tied-embedding gradient sync."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel3d import comm
from parallel3d.parallel_state import ParallelState
from parallel3d.param_meta import set_meta
from parallel3d.pipeline.p2p import MessageSpec, PipelineP2P, ReceiveBuffers
from parallel3d.pipeline.schedules import Action
from parallel3d.pipeline.tied import sync_tied_embedding_grads
from parallel3d.topology import Topology
from tests.harness import run_on_ranks

SPEC = MessageSpec((2, 3, 4), torch.float32)


def _payload(rank: int, tag: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(SPEC.shape) * (rank + 1) + 100 * tag


def _exchange(rank, world, emulate_nccl):
    """Stage 0 sends two activations and receives one gradient in one batch; stage 1 mirrors it."""
    pstate = ParallelState(Topology(tp=1, pp=2, dp=world // 2), emulate_nccl=emulate_nccl)
    p2p = PipelineP2P(pstate, SPEC)
    if pstate.coord("pp") == 0:
        got = p2p.exchange([(Action("SEND_ACT", 0), _payload(rank, 0)), (Action("SEND_ACT", 1), _payload(rank, 1))],
                           [Action("RECV_GRAD", 0)])
        out = {"grad0": got[Action("RECV_GRAD", 0)], "peer": pstate.next_stage_rank}
    else:
        prev = pstate.prev_stage_rank
        got = p2p.exchange([(Action("SEND_GRAD", 0), -_payload(rank, 0))],
                           [Action("RECV_ACT", 0), Action("RECV_ACT", 1)])
        out = {"act0": got[Action("RECV_ACT", 0)], "act1": got[Action("RECV_ACT", 1)], "peer": prev}
    p2p.wait_sends()
    out["bytes"] = pstate.comm_stats.bytes[("pp", "send")]
    out["direct"] = p2p.posts_directly
    return out


@pytest.mark.parametrize("world,emulate_nccl", [(2, False), (4, False), (2, True), (4, True)])
def test_batched_exchange_delivers_in_order_and_counts_bytes(world, emulate_nccl):
    results = run_on_ranks(_exchange, world, emulate_nccl)
    topo = Topology(tp=1, pp=2, dp=world // 2)
    for rank, r in enumerate(results):
        peer = r["peer"]
        assert r["direct"] == (not emulate_nccl)  # plain gloo takes the op-by-op path, NCCL's keeps batches
        if topo.coords(rank).pp == 0:
            assert torch.equal(r["grad0"], -_payload(peer, 0))
            assert r["bytes"] == 2 * 24 * 4
        else:
            assert torch.equal(r["act0"], _payload(peer, 0)) and torch.equal(r["act1"], _payload(peer, 1))
            assert r["bytes"] == 24 * 4


def _batch_traffic(p2p, pstate, rank, release: bool) -> dict:
    """Three rounds of a batch of two sends and two receives each way plus a receive posted ahead, then
    one last exchange; ``release``: free the sent buffers after each round. Returns what arrived, by action."""
    send, recv = ("SEND_ACT", "RECV_GRAD") if pstate.coord("pp") == 0 else ("SEND_GRAD", "RECV_ACT")
    got = {}
    for r in range(3):
        mbs = (2 * r, 2 * r + 1)
        got.update(p2p.exchange([(Action(send, mb), _payload(rank, mb)) for mb in mbs],
                                [Action(recv, mb) for mb in mbs], ahead=[Action(recv, 2 * r + 2)]))
        if release:
            p2p.release_sent(wait_for_activations=True)
    got.update(p2p.exchange([(Action(send, 6), _payload(rank, 6))], [Action(recv, 6)]))
    p2p.wait_sends()
    return got


def _many_batches(rank, world, direct):
    """Interleaved-like traffic on pp=2 (x dp): per round a batch of two sends and two receives each way
    plus a receive posted ahead; returns every receive, by action, and whether batches went op by op."""
    pstate = ParallelState(Topology(tp=1, pp=2, dp=world // 2))
    p2p = PipelineP2P(pstate, SPEC, direct_gloo=direct)
    got = _batch_traffic(p2p, pstate, rank, release=True)
    peer = pstate.next_stage_rank if pstate.coord("pp") == 0 else pstate.prev_stage_rank
    return {f"{a.kind}{a.microbatch}": t.clone() for a, t in got.items()}, p2p.posts_directly, peer


@pytest.mark.parametrize("world", [2, 4])
def test_op_by_op_gloo_path_delivers_what_the_batched_path_does(world):
    """The reference is each peer's payload; both paths (gloo's backend op by op, and
    ``dist.batch_isend_irecv``) must deliver it to the right receive, FIFO per peer, across ranks of dp."""
    for direct in (True, False):
        for rank, (received, used_direct, peer) in enumerate(run_on_ranks(_many_batches, world, direct)):
            assert used_direct == direct
            recv = "RECV_GRAD" if Topology(tp=1, pp=2, dp=world // 2).coords(rank).pp == 0 else "RECV_ACT"
            assert sorted(received) == sorted(f"{recv}{mb}" for mb in range(7)), received.keys()
            for mb in range(7):
                assert torch.equal(received[f"{recv}{mb}"], _payload(peer, mb)), (direct, rank, mb)


def _unanswered_receive(rank, world, direct):
    """Stage 1 waits for an activation stage 0 never sends: the error names the rank, its stage and the action."""
    pstate = ParallelState(Topology(tp=1, pp=2, dp=1), timeout_s=2)
    p2p = PipelineP2P(pstate, SPEC, direct_gloo=direct)
    if pstate.coord("pp") == 0:
        return None
    try:
        p2p.exchange([], [Action("RECV_ACT", 3)])
    except RuntimeError as exc:
        return str(exc)
    return "received"


@pytest.mark.parametrize("direct", [True, False], ids=["op-by-op", "batched"])
def test_a_receive_that_times_out_names_rank_stage_and_action(direct):
    message = run_on_ranks(_unanswered_receive, 2, direct, timeout=60)[1]
    assert message.startswith("rank 1 (pipeline stage 1): p2p [\"Action(kind='RECV_ACT', microbatch=3, chunk=0)\"] "
                              "failed:"), message


def test_peers_follow_the_interleaved_layout():
    # pp=2, tp=2: stage 1's chunk 0 feeds stage 0's chunk 1 (wrap-around), same tp coordinate.
    topo = Topology(tp=2, pp=2, dp=1)
    last = ParallelState.without_groups(topo, topo.rank_of(tp=1, pp=1))
    p2p = PipelineP2P(last, SPEC, num_virtual_stages=2)
    assert p2p.peer(Action("SEND_ACT", 0, 0)) == topo.rank_of(tp=1, pp=0)
    assert p2p.peer(Action("RECV_ACT", 0, 0)) == topo.rank_of(tp=1, pp=0)
    assert p2p.peer(Action("RECV_GRAD", 0, 0)) == topo.rank_of(tp=1, pp=0)
    with pytest.raises(ValueError, match="has no neighbour"):
        p2p.peer(Action("SEND_ACT", 0, 1))  # the very last chunk


def test_message_spec_and_shape_checks():
    spec = MessageSpec.from_config(micro_batch_size=2, seq_len=8, hidden_size=16, dtype=torch.bfloat16,
                                   tp_size=2, sequence_parallel=True)
    assert spec.shape == (2, 4, 16) and spec.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="train.seq_len=7 is not divisible by parallel.tp=2"):
        MessageSpec.from_config(micro_batch_size=2, seq_len=7, hidden_size=16, dtype=torch.float32,
                                tp_size=2, sequence_parallel=True)
    pstate = ParallelState.without_groups(Topology(tp=1, pp=2, dp=1), 0)
    with pytest.raises(ValueError, match=r"sends shape \(2, 3, 5\)"):
        PipelineP2P(pstate, SPEC).exchange([(Action("SEND_ACT", 0), torch.zeros(2, 3, 5))], [])


# ---- a batch is one unit, whatever the backend returns (single process, scripted backend) ------
class _ScriptedWork:
    def __init__(self) -> None:
        self.done = False

    def wait(self) -> None:
        self.done = True

    def is_completed(self) -> bool:
        return self.done


class _ScriptedBackend:
    """Stands in for ``comm.batch_isend_irecv``: gloo-style (one Work per op) or NCCL-style (one per batch)."""

    def __init__(self, per_op: bool) -> None:
        self.per_op = per_op
        self.batches: list[tuple[list, list[_ScriptedWork]]] = []

    def __call__(self, ops, pstate, kind="pp"):
        works = [_ScriptedWork() for _ in ops] if self.per_op else [_ScriptedWork()]
        self.batches.append((ops, works))
        return works


class _Op:  # dist.P2POp needs a process group; the scripted backend does not
    def __init__(self, op, tensor, peer, group=None) -> None:
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group


@pytest.mark.parametrize("per_op", [True, False], ids=["gloo-style", "nccl-style"])
def test_a_batch_is_one_unit(monkeypatch, per_op):
    backend = _ScriptedBackend(per_op)
    monkeypatch.setattr(comm, "batch_isend_irecv", backend)
    monkeypatch.setattr(dist, "P2POp", _Op)
    pstate = ParallelState(Topology(tp=1, pp=2, dp=1), rank=0, distributed=False, backend="gloo", device="cpu")
    p2p = PipelineP2P(pstate, SPEC)
    sa0, sa1, rg0, rg1, rg2 = (Action("SEND_ACT", 0), Action("SEND_ACT", 1), Action("RECV_GRAD", 0),
                               Action("RECV_GRAD", 1), Action("RECV_GRAD", 2))
    # A send alone: not waited for, and not released before the backend reports it done.
    p2p.exchange([(sa0, _payload(0, 0))], [])
    assert p2p.release_sent() == []
    for work in backend.batches[0][1]:
        work.done = True
    assert p2p.release_sent() == [sa0]
    # A send and a receive in one batch, two receives ahead (a batch each): the receive is handed out
    # only once every Work of its batch, the send's included, has completed.
    got = p2p.exchange([(sa1, _payload(0, 1))], [rg0], ahead=[rg1, rg2])
    assert list(got) == [rg0] and tuple(got[rg0].shape) == SPEC.shape
    assert [len(ops) for ops, _ in backend.batches[1:]] == [2, 1, 1]
    assert all(work.done for work in backend.batches[1][1])
    assert p2p.release_sent() == [sa1]
    assert not any(work.done for _, works in backend.batches[2:] for work in works)  # still ahead
    assert list(p2p.exchange([], [rg1])) == [rg1] and len(backend.batches) == 4  # posted earlier: no new batch
    with pytest.raises(RuntimeError, match="receives posted but never used"):
        p2p.wait_sends()


class _End(nn.Module):
    def __init__(self, value: float, tied: bool) -> None:
        super().__init__()
        self.word = nn.Parameter(torch.zeros(3, 2))
        self.other = nn.Parameter(torch.zeros(2))
        if tied:
            set_meta(self.word, tied_embedding=True)
        self.word.grad = torch.full((3, 2), value)
        self.other.grad = torch.full((2,), value)


def _tied(rank, world, tp, pp):
    pstate = ParallelState(Topology(tp=tp, pp=pp, dp=world // (tp * pp)))
    end = pstate.is_first_stage or pstate.is_last_stage
    module = _End(float(rank + 1), tied=end)
    synced = sync_tied_embedding_grads([module], pstate)
    return synced, module.word.grad.clone(), module.other.grad.clone(), pstate.ranks("embedding")


@pytest.mark.parametrize("tp,pp", [(1, 4), (2, 2), (1, 1)])
def test_tied_grads_summed_over_embedding_group(tp, pp):
    world = 4 if tp * pp > 1 else 2
    results = run_on_ranks(_tied, world, tp, pp)
    for rank, (synced, word, other, group) in enumerate(results):
        assert torch.equal(other, torch.full((2,), float(rank + 1)))  # untied parameters untouched
        if pp > 1 and rank in group:
            assert synced == 1
            assert torch.equal(word, torch.full((3, 2), float(sum(r + 1 for r in group))))
        else:
            assert synced == 0 and torch.equal(word, torch.full((3, 2), float(rank + 1)))


def test_receive_buffers_reused_only_once_nothing_uses_them():
    """A buffer comes back only when no tensor shares its storage: not while a received
    activation is saved by a live autograd graph, nor while a view of it lives."""
    pool = ReceiveBuffers(SPEC, torch.device("cpu"))
    first = pool.acquire()
    first.fill_(1.0)
    x = pool.hand_out(first).requires_grad_(True)  # a received activation, input of the stage graph
    w = torch.randn(SPEC.shape, requires_grad=True)
    loss = (x * w).sum()  # autograd saves x for w's gradient
    del x
    second = pool.acquire()
    assert second is not first and pool.allocated == 2
    pool.hand_out(second)  # dropped at once: free again
    assert pool.acquire() is second
    loss.backward()
    assert torch.equal(w.grad, torch.ones(SPEC.shape))
    assert pool.acquire() is not first  # the graph (its AccumulateGrad holds x) is still alive
    del loss  # the graph and its references to x go, as the engine drops a chunk's output after W
    view = first[0]
    assert pool.acquire() is not first  # a view keeps the storage busy
    del view
    assert pool.acquire() is first and pool.allocated == 4


def _traced(rank, world, direct):
    """``_many_batches``' traffic on pp=2 with ``PipelineP2P.trace`` on: what arrived and the stamps."""
    pstate = ParallelState(Topology(tp=1, pp=2, dp=1))
    p2p = PipelineP2P(pstate, SPEC, direct_gloo=direct)
    p2p.trace = []
    got = _batch_traffic(p2p, pstate, rank, release=False)
    return {a.microbatch: t.clone() for a, t in got.items()}, p2p.trace, 1 - rank


@pytest.mark.parametrize("direct", [True, False], ids=["op-by-op", "batched"])
def test_trace_stamps_every_post_and_wait_without_changing_what_arrives(direct):
    """Every op's post and every receive's wait is stamped once, with its batch's number (ops posted
    together share one), on one clock across ranks; the messages arrive as untraced; and the
    benchmark's pairing of the stamps finds every message."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_pipeline_bubble import in_run_latencies

    results = run_on_ranks(_traced, 2, direct)
    for rank, (received, trace, peer) in enumerate(results):
        assert sorted(received) == list(range(7))
        for mb in range(7):
            assert torch.equal(received[mb], _payload(peer, mb))
        posts = {a: (n, began, end) for kind, a, _, began, end, n in trace if kind != "wait"}
        waits = {a: (n, began, end) for kind, a, _, began, end, n in trace if kind == "wait"}
        recv = "RECV_GRAD" if rank == 0 else "RECV_ACT"
        assert sorted(a.microbatch for a in waits) == list(range(7)) and all(a.kind == recv for a in waits)
        assert len(posts) == len([x for x in trace if x[0] != "wait"]) == 14  # each op stamped once
        for a, (n, entered, woke) in waits.items():
            assert n == posts[a][0] and posts[a][1] <= posts[a][2] <= entered <= woke
        # the first exchange's two sends and two receives went out as one batch, its receive ahead alone
        send = "SEND_ACT" if rank == 0 else "SEND_GRAD"
        first = {posts[Action(k, mb)][0] for k in (send, recv) for mb in (0, 1)}
        assert len(first) == 1 and posts[Action(recv, 2)][0] not in first
    latencies, posting, delivery = in_run_latencies({rank: trace for rank, (_, trace, _) in enumerate(results)})
    assert posting > 0 and all(x >= 0 for x in latencies) and all(x >= 0 for x in delivery.values())
    waited = sum(1 for _, trace, _ in results for x in trace if x[0] == "wait")
    assert waited == 14
