"""Is an MoE layout's miss of the one-process run a top-k near tie, or a wrong term? Record both runs' routing.

Invariant: ``record_on_rank`` trains a job exactly as ``layout_run.train_case_on_rank`` does, and also returns
every training token's selection scores (the router's scores plus its expert bias, what the top-k is taken of)
and the experts it chose, keyed by layout-independent coordinates ``(step, layer, global sample id, position in
the sequence)`` (the cp share's chunks are mapped back to their global positions with the layer's own
``token_positions``). ``compare`` then finds the tokens whose chosen expert SET differs between two runs
("flips": the experts recorded as chosen, not the scores' top-k, which DeepSeek's expert bias and group-limited
routing shift) and, per flip, its margin: the gap, in each run, between the selection scores of the experts the
two runs disagree on. A near tie is a flip whose margin is within the rounding the two runs' scores show anyway
(``rounding``: the largest score difference over the tokens that did not flip, up to that step); a wrong term
moves the scores themselves (a larger ``rounding``) or flips tokens with a wide margin.

``float64=True`` trains in float64 (``tests/float64_run.py``), where a near tie should no longer flip.
``forced`` (the ``chosen`` experts another run recorded, by ``Key``) makes every router pick those experts instead of
its own top-k (its scores, combine weights and aux loss computed as ever): one run routed as another, so what is
left between them is everything but the selection.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

from tests.float64_run import float64_training

Key = tuple[int, str, int, int]  # (step, layer global name, global sample id, position in the sequence)
Chosen = dict[Key, tuple[int, ...]]  # each routed token's top-k expert ids, in the router's order


@dataclasses.dataclass
class Flip:
    key: Key
    experts: tuple[tuple[int, ...], tuple[int, ...]]  # each run's chosen set
    margin: float  # largest |score(e) - score(f)| in either run, over e, f the experts only one run picked


@dataclasses.dataclass
class StepRouting:
    step: int
    tokens: int
    flips: list[Flip]
    rounding: float  # largest |score difference| over this and earlier steps' tokens that did not flip

    def near_tie(self) -> bool:
        """Every flip's margin is within the rounding the unflipped tokens show (and there is a flip)."""
        return bool(self.flips) and all(f.margin <= self.rounding for f in self.flips)


@contextlib.contextmanager
def _recording(records: dict[Key, torch.Tensor], float64: bool, chosen: Chosen,
               forced: Chosen | None = None) -> Iterator[None]:
    """Patch the block and the MoE layer classes (restored after: rank workers are reused) to fill ``records`` and
    ``chosen``, and (``forced``) to make the routers select those experts (module doc)."""
    from models.blocks import TransformerBlock
    from parallel3d.moe import router as router_module
    from parallel3d.moe.layer import MoELayer
    from parallel3d.moe.router import TopKRouter

    block_forward, layer_forward, router_forward = TransformerBlock.forward, MoELayer.forward, TopKRouter.forward
    where: list = []  # the current (sample ids, step) of the block, then the layer's name and positions

    def block(self, x, run):  # type: ignore[no-untyped-def]
        where[:] = [run.sample_ids, run.step]  # a recompute runs its block again with the same ``run``
        return block_forward(self, x, run)

    def layer(self, x, token_ids=None):  # type: ignore[no-untyped-def]
        if self.training and where and where[0] is not None:
            where[2:] = [self.global_name, self.token_positions(x.shape[1], x.device), x.shape[1]]
        try:
            return layer_forward(self, x, token_ids)
        finally:
            del where[2:]

    def router(self, tokens):  # type: ignore[no-untyped-def]
        if len(where) != 5:
            return router_forward(self, tokens)
        samples, step, name, positions, s = where
        keys = [(int(step), name, int(samples[t // s]), int(positions[t % s])) for t in range(tokens.shape[0])]
        select = router_module.select_experts
        if forced is not None:
            want = torch.tensor([forced[k] for k in keys], dtype=torch.long, device=tokens.device)
            router_module.select_experts = lambda *_: want
        try:
            routing = router_forward(self, tokens)
        finally:
            router_module.select_experts = select
        scores = routing.scores.detach().to(torch.float64)
        if self.expert_bias is not None:  # what select_experts ranks
            scores = scores + self.expert_bias.to(torch.float64)
        scores, indices = scores.cpu(), routing.indices.cpu().tolist()
        for t, key in enumerate(keys):
            records.setdefault(key, scores[t])
            chosen.setdefault(key, tuple(indices[t]))
        return routing

    TransformerBlock.forward, MoELayer.forward, TopKRouter.forward = block, layer, router  # type: ignore[method-assign]
    try:
        with float64_training() if float64 else contextlib.nullcontext():
            yield
    finally:
        TransformerBlock.forward, MoELayer.forward, TopKRouter.forward = (  # type: ignore[method-assign]
            block_forward, layer_forward, router_forward)


def record_on_rank(rank: int, world: int, values: dict, float64: bool = False,
                   forced: Chosen | None = None) -> tuple[list, dict[Key, torch.Tensor], Chosen]:
    """``run_on_ranks`` target (world 1: in this process): this rank's curve (the logging rank's), its training
    tokens' router scores ``[E]`` (float64) and chosen experts by ``Key``; ``forced``: see the module doc."""
    from parallel3d.config import job_from_dict, resolve
    from parallel3d.parallel_state import ParallelState
    from parallel3d.trainer import train
    from tests import layout_run as lr

    rj = resolve(job_from_dict(values), world)
    records: dict[Key, torch.Tensor] = {}
    chosen: Chosen = {}
    with _recording(records, float64, chosen, forced), lr.silenced(True):
        pstate = ParallelState.single_process() if world == 1 else ParallelState(rj.topology)
        curve = lr.curve_of(train(rj, pstate).records)
    return curve, records, chosen


def merged(per_rank: list[tuple[list, dict, Chosen]]) -> tuple[list, dict[Key, torch.Tensor], Chosen]:
    """The logging rank's curve and every rank's records and choices (ranks that share tokens, e.g. tp, agree)."""
    records: dict[Key, torch.Tensor] = {}
    chosen: Chosen = {}
    for _, r, c in per_rank:
        records.update(r)
        chosen.update(c)
    return next(c for c, _, _ in per_rank if c), records, chosen


def compare(a: dict[Key, torch.Tensor], b: dict[Key, torch.Tensor], chosen_a: Chosen,
            chosen_b: Chosen) -> list[StepRouting]:
    """Per step, the flips between runs ``a`` and ``b`` (selection scores; their chosen experts ``chosen_a`` /
    ``chosen_b``; the same tokens: ValueError otherwise) and the rounding."""
    if a.keys() != b.keys() or a.keys() != chosen_a.keys() or a.keys() != chosen_b.keys():
        raise ValueError(f"the runs routed different tokens: {len(a.keys() ^ b.keys())} keys differ")
    out: list[StepRouting] = []
    rounding = 0.0
    for step in sorted({k[0] for k in a}):
        keys = [k for k in a if k[0] == step]
        flips = []
        for key in keys:
            sa, sb = a[key], b[key]
            ea, eb = tuple(sorted(chosen_a[key])), tuple(sorted(chosen_b[key]))
            if ea == eb:
                rounding = max(rounding, (sa - sb).abs().max().item())
                continue
            only = [e for e in ea if e not in eb], [e for e in eb if e not in ea]
            margin = max(abs(s[e] - s[f]).item() for s in (sa, sb) for e in only[0] for f in only[1])
            flips.append(Flip(key, (ea, eb), margin))
        out.append(StepRouting(step, len(keys), flips, rounding))
    return out


def first_flip_step(steps: list[StepRouting]) -> int | None:
    return next((s.step for s in steps if s.flips), None)
