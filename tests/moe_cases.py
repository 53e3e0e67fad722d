"""Generated MoE test cases and the expert-grid process groups the distributed tests use.

``random_options(rng, ...)`` draws a layer configuration (expert count, top-k, score function,
normalisation, group-limited routing, bias, shared experts, losses) compatible with the
given ep / etp; ``dead_experts`` makes some experts unreachable (routing skew: experts with
zero tokens). ``ExpertGrid`` builds the groups of an ``etp x ep x edp`` grid (etp fastest)
plus the token groups (blocks of ``span`` consecutive ranks split one micro-batch).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import torch
import torch.distributed as dist

from parallel3d.moe import MoELayer, MoEOptions

PREFIX = "layers.1.mlp"
HIDDEN = 8


def random_options(rng: random.Random, *, ep: int = 1, etp: int = 1, **forced) -> MoEOptions:
    num_experts = ep * rng.choice([1, 2, 3]) if ep > 1 else rng.choice([2, 3, 4, 6])
    num_experts = max(num_experts, 2)
    top_k = rng.randint(1, min(3, num_experts - 1))
    groups = 1
    if num_experts % 2 == 0 and num_experts >= 4 and rng.random() < 0.4:
        groups = 2
    values = dict(
        num_experts=num_experts, top_k=top_k, ffn_hidden=etp * rng.choice([2, 3, 4]),
        score_function=rng.choice(["softmax", "sigmoid"]), normalize_topk=rng.random() < 0.6,
        scaling_factor=rng.choice([1.0, 1.0, 2.5]), num_groups=groups,
        topk_groups=groups if groups == 1 else max(1, -(-top_k // (num_experts // groups))),
        bias_update_rate=rng.choice([0.0, 0.01]), aux_loss_coeff=rng.choice([0.0, 0.1]),
        aux_loss_scope=rng.choice(["micro_batch", "sequence"]), z_loss_coeff=rng.choice([0.0, 0.01]),
        num_shared_experts=rng.choice([0, 0, 1]),
    )
    values["shared_expert_gate"] = values["num_shared_experts"] > 0 and rng.random() < 0.5
    values.update(forced)
    return MoEOptions(**values)


def dead_experts(rng: random.Random, o: MoEOptions) -> list[int]:
    """Experts no token will choose (at most ``E - top_k`` of them, outside group-limited routing)."""
    if o.num_groups > 1:
        return []
    room = o.num_experts - o.top_k
    return sorted(rng.sample(range(o.num_experts), rng.randint(0, min(room, 2))))


def build_layer(o: MoEOptions, *, dead: list[int], dtype: torch.dtype = torch.float32, **groups) -> MoELayer:
    """Layer with init std 0.3 (values of order one) and the ``dead`` experts' router rows pushed away."""
    layer = MoELayer(o, HIDDEN, global_name=PREFIX, seed=11, init_std=0.3, output_std=0.2, dtype=dtype, **groups)
    with torch.no_grad():
        for e in dead:
            layer.router.weight[e] = -1.0  # inputs have a positive mean: these logits are far below the rest
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(torch.linspace(-0.01, 0.01, o.num_experts))
    return layer


def inputs(seed: int, b: int, s: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [b, s, h] with a positive mean, cotangent [b, s, h])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, HIDDEN, generator=g, dtype=torch.float64) + 1.0
    cot = torch.randn(b, s, HIDDEN, generator=g, dtype=torch.float64)
    return x.to(dtype), cot.to(dtype)


def by_global_name(layer: MoELayer) -> dict[str, torch.nn.Parameter]:
    return {p.global_name: p for p in layer.parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-norm error relative to the reference's max-norm (0 for two zero tensors)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    return err / scale if scale > 0 else err


@dataclass
class ExpertGrid:
    """This rank's groups in an ``etp x ep x edp`` grid (etp fastest) and its token group."""

    rank: int
    etp: int
    ep: int
    edp: int
    span: int
    groups: dict

    @property
    def etp_rank(self) -> int:
        return self.rank % self.etp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.etp % self.ep

    @property
    def micro_batch(self) -> int:
        return self.rank // self.span

    @property
    def token_rank(self) -> int:
        return self.rank % self.span

    @classmethod
    def build(cls, rank: int, world: int, etp: int, ep: int, span: int) -> "ExpertGrid":
        """Create every group (same order on every rank) and keep this rank's."""
        edp = world // (etp * ep)
        assert etp * ep * edp == world and world % span == 0
        coords = [(r % etp, r // etp % ep, r // (etp * ep)) for r in range(world)]
        mine: dict = {}
        specs = {
            "etp": lambda c: (c[1], c[2]), "ep": lambda c: (c[0], c[2]), "edp": lambda c: (c[0], c[1]),
        }
        for kind, key in specs.items():
            for k in sorted({key(c) for c in coords}):
                ranks = [r for r in range(world) if key(coords[r]) == k]
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    mine[kind] = group
        for start in range(0, world, span):
            ranks = list(range(start, start + span))
            group = dist.new_group(ranks) if span > 1 else None
            if rank in ranks:
                mine["token"] = group
        mine["world"] = dist.group.WORLD
        return cls(rank, etp, ep, edp, span, mine)


def with_options(o: MoEOptions, **changes) -> MoEOptions:
    return replace(o, **changes)


@contextmanager
def poisoned_empty() -> Iterator[None]:
    """Fresh tensors (``torch.empty`` and every op's uninitialised output) are filled with NaN."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        assert torch.isnan(torch.empty(4)).all()
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.utils.deterministic.fill_uninitialized_memory = saved[1]
