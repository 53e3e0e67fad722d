"""Spent backward graphs (``step_run``'s parking): freed at their ``B`` on the stage holding the model's
first chunk, after the action loop on the others, with the same gradients and receive buffers; a split
``B``'s (zb_h1) too, unless a deferring layer read the chunk's input itself (its ``W`` holds it)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from models.config import ModelConfig
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.pipeline_toy import HIDDEN, ToyModel, toy_batch

MBS, SEQ, LAYERS, M = 2, 4, 6, 6


class _Token:
    """What a marked graph node holds: its finalizer runs when the node is freed."""


class _Marked(torch.autograd.Function):
    """A copy whose graph node carries a ``_Token``; its finalizer logs how many of the stage's backwards
    had run when the node (so the microbatch's graph) was freed."""

    @staticmethod
    def forward(ctx, x, log):  # type: ignore[override]
        token = _Token()
        weakref.finalize(token, lambda: log["freed_after"].append(log["backwards"]))
        ctx.token, ctx.log = token, log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.log["backwards"] += 1
        return grad, None


class _MarkedChunk(nn.Module):
    """A toy chunk whose output (hidden states or loss) passes through ``_Marked``."""

    def __init__(self, chunk: nn.Module, log: dict, copy_input: bool = False) -> None:
        super().__init__()
        self.chunk, self.log, self.copy_input = chunk, log, copy_input

    def forward(self, x, labels=None, *, sample_ids=None, step=0):
        if self.copy_input and x.is_floating_point():  # the first deferring linear reads a copy, not the input
            x = x * 1.0
        return _Marked.apply(self.chunk(x, labels, sample_ids=sample_ids, step=step), self.log)


def _step(rank, world, park: bool, schedule: str = "1f1b", copy_input: bool = False) -> dict:
    pstate = ParallelState(Topology(tp=1, pp=world, dp=1))
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_heads=1, vocab_size=32)
    (r,) = stage_layer_ranges(partition_layers(cfg, world, 1), world, pstate.coord("pp"))
    log: dict = {"backwards": 0, "freed_after": []}
    chunk = _MarkedChunk(ToyModel(LAYERS, r, deferral=pstate.weight_grads), log, copy_input)
    # split_drain=False: the 1f1b case is plain 1F1B, every backward whole (the drain split is the default).
    engine = PipelineEngine([chunk], pstate, schedule=schedule, num_microbatches=M, micro_batch_size=MBS,
                            seq_len=SEQ, hidden_size=HIDDEN, split_drain=False)
    parks = engine.park_spent_graphs
    engine.park_spent_graphs = parks and park  # park=False: every graph freed at its B (the former executor)
    engine.run_step(toy_batch(M, MBS, SEQ))
    return {"stage": pstate.coord("pp"), "parks": parks, "freed_after": list(log["freed_after"]),
            "buffers": engine.p2p.buffers.allocated, "grads": {n: p.grad.clone() for n, p in chunk.named_parameters()}}


def test_spent_graphs_freed_after_the_loop_off_the_first_stage_same_grads_and_buffers():
    world = 3  # stage 0 (first chunk), a middle stage (sends activations and gradients), the last
    parked = run_on_ranks(_step, world, True)
    at_once = run_on_ranks(_step, world, False)
    for p, a in zip(parked, at_once):
        stage = p["stage"]
        assert p["parks"] == (stage > 0)
        # Freed right after each B (the count of backwards run then: 1..M), or all after the last B.
        assert a["freed_after"] == list(range(1, M + 1)), f"stage {stage}: {a['freed_after']}"
        want = [M] * M if stage > 0 else list(range(1, M + 1))
        assert p["freed_after"] == want, f"stage {stage}: {p['freed_after']}"
        for name, grad in a["grads"].items():
            assert torch.equal(p["grads"][name], grad), f"stage {stage}: {name} differs when parking"
        # A parked graph must not hold its input's receive buffer: the pool needs no more buffers.
        assert p["buffers"] == a["buffers"], f"stage {stage}: {p['buffers']} receive buffers vs {a['buffers']}"


@pytest.mark.parametrize("copy_input", [True, False], ids=["parked", "input-in-W"])
def test_split_backward_graphs_parked_unless_w_reads_the_input(copy_input):
    """zb_h1: every B is split. Parked after the loop on stages > 0 (same gradients, no more receive
    buffers), unless the first deferring linear reads the chunk's input itself: then emptying the input
    would change what its W computes, so the graph goes at its B as before (the marked node on top)."""
    world = 3
    parked = run_on_ranks(_step, world, True, "zb_h1", copy_input)
    at_once = run_on_ranks(_step, world, False, "zb_h1", copy_input)
    for p, a in zip(parked, at_once):
        stage = p["stage"]
        assert p["parks"] == (stage > 0)
        for name, grad in a["grads"].items():  # first: emptying an input W still reads changes these
            assert torch.equal(p["grads"][name], grad), f"stage {stage}: {name} differs when parking"
        assert a["freed_after"] == list(range(1, M + 1)), f"stage {stage}: {a['freed_after']}"
        want = [M] * M if stage > 0 and copy_input else list(range(1, M + 1))
        assert p["freed_after"] == want, f"stage {stage}: {p['freed_after']}"
        # Emptied at B, not held by the graph until its W: the input's receive buffer is reused sooner.
        assert p["buffers"] <= a["buffers"], f"stage {stage}: {p['buffers']} receive buffers vs {a['buffers']}"
