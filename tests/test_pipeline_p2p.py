"""Point-to-point transfers and tied-embedding gradient sync on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel3d.parallel_state import ParallelState
from parallel3d.param_meta import set_meta
from parallel3d.pipeline.p2p import MessageSpec, PipelineP2P
from parallel3d.pipeline.schedules import Action
from parallel3d.pipeline.tied import sync_tied_embedding_grads
from parallel3d.topology import Topology
from tests.harness import run_on_ranks

SPEC = MessageSpec((2, 3, 4), torch.float32)


def _payload(rank: int, tag: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(SPEC.shape) * (rank + 1) + 100 * tag


def _exchange(rank, world):
    """Stage 0 sends two activations and receives one gradient in one batch; stage 1 mirrors it."""
    pstate = ParallelState(Topology(1, 2, world // 2))
    p2p = PipelineP2P(pstate, SPEC)
    if pstate.pp_rank == 0:
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
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_batched_exchange_delivers_in_order_and_counts_bytes(world):
    results = run_on_ranks(_exchange, world)
    topo = Topology(1, 2, world // 2)
    for rank, r in enumerate(results):
        peer = r["peer"]
        if topo.coords(rank).pp == 0:
            assert torch.equal(r["grad0"], -_payload(peer, 0))
            assert r["bytes"] == 2 * 24 * 4
        else:
            assert torch.equal(r["act0"], _payload(peer, 0)) and torch.equal(r["act1"], _payload(peer, 1))
            assert r["bytes"] == 24 * 4


def test_peers_follow_the_interleaved_layout():
    # pp=2, tp=2: stage 1's chunk 0 feeds stage 0's chunk 1 (wrap-around), same tp coordinate.
    topo = Topology(2, 2, 1)
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
    with pytest.raises(ValueError, match="data.seq_len=7 is not divisible by parallel.tp=2"):
        MessageSpec.from_config(micro_batch_size=2, seq_len=7, hidden_size=16, dtype=torch.float32,
                                tp_size=2, sequence_parallel=True)
    pstate = ParallelState.without_groups(Topology(1, 2, 1), 0)
    with pytest.raises(ValueError, match=r"sends shape \(2, 3, 5\)"):
        PipelineP2P(pstate, SPEC).exchange([(Action("SEND_ACT", 0), torch.zeros(2, 3, 5))], [])


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
    pstate = ParallelState(Topology(tp, pp, world // (tp * pp)))
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
