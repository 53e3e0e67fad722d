"""The executor's per-step work outside the schedule's computations (issue 27 §3: an executor as lean
as its simulator). Once the engine is built, a step walks no module tree (each chunk's parameters and
the tied-embedding copies are listed at construction, where a walk per step cost about 0.06 ms each on
a 4-layer GPT chunk, on the step's critical path), and on plain gloo it never polls a batch whose
Works can say they are done only from ``wait()`` (``PipelineP2P.release_sent``), and a receive posted
ahead of need goes out by ``PipelineP2P.post_recv``'s lone-receive path. Gradients stay
those of a step that walks and polls (the reference: the same engine with both restored)."""

from __future__ import annotations

import torch
from torch import nn

from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline import p2p as p2p_module
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.partition import stage_layer_ranges
from parallel3d.pipeline.tied import TiedGradFinalizer, sync_tied_embedding_grads
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.pipeline_toy import HIDDEN, ToyModel, toy_batch

MBS, SEQ, LAYERS, M = 2, 4, 4, 6
WALKS = ("parameters", "named_parameters", "named_modules", "modules", "children", "named_children")


class _Counted:
    """Counts calls of ``owner.name`` while installed (each call still runs the real method)."""

    def __init__(self, owner: object, name: str, counts: dict[str, int]) -> None:
        self.owner, self.name, self.real = owner, name, getattr(owner, name)
        real = self.real

        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)

        setattr(owner, name, counted)

    def remove(self) -> None:
        setattr(self.owner, self.name, self.real)


class _WalkingFinalizer(TiedGradFinalizer):
    """The former finaliser: finds the tied copies by walking the modules every step (the reference)."""

    def finalize(self) -> None:
        sync_tied_embedding_grads(self.modules, self.pstate)


class _Walk:
    """Each chunk's parameters listed anew at every use: the former per-step walk (the reference)."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        self.chunks = chunks

    def __iter__(self):
        return (list(c.parameters()) for c in self.chunks)


def _engine(world: int, pstate: ParallelState, walking: bool) -> tuple[PipelineEngine, nn.Module]:
    ranges = [(0, 2), (2, 4)] if world == 2 else [(0, LAYERS)]
    (r,) = stage_layer_ranges(ranges, world, pstate.coord("pp"))
    chunk = ToyModel(LAYERS, r, tied=True, deferral=pstate.weight_grads)
    sync = _WalkingFinalizer([chunk], pstate) if walking else None
    engine = PipelineEngine([chunk], pstate, schedule="1f1b", num_microbatches=M, micro_batch_size=MBS,
                            seq_len=SEQ, hidden_size=HIDDEN, grad_sync=sync)  # the drain split (default)
    return engine, chunk


def _steps(rank: int, world: int) -> dict:
    pstate = ParallelState(Topology(tp=1, pp=world, dp=1))
    batch = toy_batch(M, MBS, SEQ)
    engine, chunk = _engine(world, pstate, walking=False)
    engine.run_step(batch)  # the first step may set things up
    chunk.zero_grad(set_to_none=True)
    counts: dict[str, int] = {}
    installed = [_Counted(nn.Module, name, counts) for name in WALKS]
    installed.append(_Counted(p2p_module.P2PBatch, "poll", counts))
    installed.append(_Counted(p2p_module.PipelineP2P, "post", counts))
    try:
        engine.run_step(batch)
    finally:
        for c in installed:
            c.remove()
    grads = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    # The reference: a fresh engine whose finaliser walks every step and whose every step lists the
    # chunk's parameters anew, polling as before (the same model, init and batch).
    ref_engine, ref_chunk = _engine(world, pstate, walking=True)
    ref_engine._chunk_params = _Walk(ref_engine.chunks)
    ref_engine.run_step(batch)
    batches = sum(1 for planned in engine.plan if planned.sends or planned.posts)
    return {"stage": pstate.coord("pp"), "split": engine.split_backward, "direct": engine.p2p.posts_directly,
            "counts": counts, "batches": batches, "ahead": sum(len(planned.ahead) for planned in engine.plan),
            "grads": grads,
            "ref": {n: p.grad.clone() for n, p in ref_chunk.named_parameters()}}


def test_a_step_walks_no_module_tree_and_polls_no_gloo_batch_with_the_same_grads():
    ranks = run_on_ranks(_steps, 2)
    assert any(got["split"] for got in ranks)  # the drain split somewhere: a stage lists its undeferred params
    for got in ranks:
        assert got["direct"], got["stage"]  # plain gloo: batches posted op by op
        # A receive posted ahead of need goes out by post_recv's lone-receive path, not post's general one.
        assert got["ahead"] > 0 and got["counts"].pop("post", 0) == got["batches"], got
        assert got["counts"] == {}, f"stage {got['stage']}: {got['counts']}"
        assert got["grads"].keys() == got["ref"].keys()
        for name, g in got["grads"].items():
            assert torch.equal(g, got["ref"][name]), f"stage {got['stage']}: {name}"
