"""Ulysses (``cp_comm=a2a``) moves q, k and v in ONE all-to-all each way, and nothing it need not.

The cost model the benchmark against DeepSpeed's Ulysses rests on: per attention call, forward
and backward each run exactly two all-to-alls over the cp group (q/k/v packed together, then
the output / its gradient), and every one sends the other members exactly their part of this
rank's share of the tensors it moves (q, the kv heads after any GQA replication, the output):
``(n - 1) / n`` of it. Batch 1 runs the all-to-all as point-to-point pieces received in place
(``CPGroup.all_to_all_pieces``), larger batches as one collective (``CPGroup.all_to_all``); both
are counted. A change that sends q, k and v separately, or pads, repeats or re-sends anything,
changes the counts. The same run must still equal torch's float64 attention on the whole
sequence (load-balanced split, GQA replication).
"""

from __future__ import annotations

import pytest
import torch

from parallel3d.context_parallel import CPGroup, context_parallel_attention, split_for_cp
from tests.harness import run_on_ranks


class _CountingGroup(CPGroup):
    """A cp group that records, per all-to-all it runs, the elements that leave this rank."""

    def __init__(self, group: CPGroup) -> None:
        super().__init__(group.group, group.ranks, group.rank, kind=group.kind, stats=group.stats)
        self.sent: list[int] = []

    def all_to_all(self, output, inp):
        self.sent.append(inp.numel() * (self.size - 1) // self.size)  # block j goes to member j
        super().all_to_all(output, inp)

    def all_to_all_pieces(self, sends, recvs):
        assert all(m != self.index for m, _ in list(sends) + list(recvs)), "a piece to or from this rank itself"
        self.sent.append(sum(t.numel() for _, t in sends))
        super().all_to_all_pieces(sends, recvs)


def _run(rank, world, b, s, hq, hk, d):
    group = _CountingGroup(CPGroup(torch.distributed.new_group(list(range(world))), list(range(world)), rank))
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for h in (hq, hk, hk, hq)]
    q, k, v = (split_for_cp(t, world, rank).float().requires_grad_() for t in full[:3])
    dout = split_for_cp(full[3], world, rank).float()
    out = context_parallel_attention(q, k, v, cp_comm="a2a", cp_group=group)
    forward = list(group.sent)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    backward = group.sent[len(forward):]
    # Independent reference: torch's own attention on the whole sequence, float64, then this rank's share.
    ref_in = [t.clone().requires_grad_() for t in full[:3]]
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref_in), is_causal=True,
                                                           enable_gqa=True).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, ref_in, full[3])
    errors = [float((got.double() - split_for_cp(want, world, rank)).abs().max() / want.abs().max())
              for got, want in zip((out, *grads), (ref, *ref_grads))]
    return forward, backward, max(errors)


@pytest.mark.parametrize("b", [1, 2], ids=["pieces", "collective"])
@pytest.mark.parametrize("world,hq,hk,repeats", [(2, 4, 2, 1), (4, 4, 2, 2)], ids=["cp2-split-kv", "cp4-replicated-kv"])
def test_a2a_runs_one_all_to_all_for_qkv_and_one_for_the_output_each_way(world, hq, hk, repeats, b) -> None:
    s, d = 16, 4
    local = b * (s // world) * d * (world - 1) // world  # elements of one head of the share, sent to others
    qkv, o = local * (hq + 2 * hk * repeats), local * hq
    for forward, backward, error in run_on_ranks(_run, world, b, s, hq, hk, d):
        assert forward == [qkv, o], forward
        assert backward == [o, qkv], backward
        assert error < 1e-5, error
