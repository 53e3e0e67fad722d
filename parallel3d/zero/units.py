"""Gather units of ZeRO stage 3: which parameters are gathered and freed together.

Policy (what FSDP users get by wrapping transformer blocks): every element of a
container module (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``;
nested containers are expanded) that holds trainable parameters is one unit, and
so is any module a model marks with ``zero3_unit = True`` (``ZERO3_UNIT``).
Every other trainable parameter of a model chunk belongs to the chunk's *root*
unit, whose hooks sit on the chunk module itself. For parallel3d's models the
units are the transformer blocks (``layers.{i}``) and, when the embedding is not
tied to the head, the embedding and the head (``models.transformer`` marks
them); the root holds the final norm, and the word embedding when it is tied
(the head reads it outside the embedding's forward). A plain ``nn.Sequential``
gets one unit per child with parameters and an empty root.

Contract: a unit's parameters are read only inside the unit's own forward (and
the backward of what that forward computed). A parameter used by two units, or
by a unit and the root (the tied head reads ``embedding.word.weight``), is put
in the root, which stays gathered across the chunk's forward and backward.
Reading parameters anywhere else (weight export, evaluation with plain tensor
ops) must happen inside ``ZeroOptimizer.gathered_params()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
ZERO3_UNIT = "zero3_unit"  # module attribute: True makes the module a gather unit of its own


@dataclass(eq=False)
class GatherUnit:
    """Parameters gathered as one: ``module``'s forward hooks gather and free them.

    Mutable state (owned by ``params_sharded.ShardedParams``): ``gathered`` (all
    buckets whole or arriving), ``in_backward`` (a backward of the unit started and
    not complete), ``pending`` (forwards with grad whose backward has not completed),
    ``grads`` (id(param) -> gradients received beyond the unit's completed backwards)
    and ``closed`` (ids of the parameters whose last-microbatch gradient of the step is in).
    """

    index: int
    chunk: int
    name: str
    module: nn.Module = field(repr=False)
    params: list[nn.Parameter] = field(repr=False)
    is_root: bool
    buckets: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (group, bucket index)
    gathered: bool = False
    in_backward: bool = False
    pending: int = 0
    grads: dict[int, int] = field(default_factory=dict, repr=False)
    closed: set[int] = field(default_factory=set, repr=False)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _container_elements(container: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    out = []
    for name, child in container.named_children():
        if isinstance(child, CONTAINERS):
            out += _container_elements(child, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", child))
    return out


def _unit_modules(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The elements of the containers under ``module`` (not descending into an element)."""
    if isinstance(module, CONTAINERS):
        return _container_elements(module, prefix)
    out = []
    for name, child in module.named_children():
        if getattr(child, ZERO3_UNIT, False):
            out.append((f"{prefix}{name}", child))
        else:
            out += _unit_modules(child, f"{prefix}{name}.")
    return out


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def find_units(modules: list[nn.Module]) -> list[GatherUnit]:
    """The gather units of model chunks ``modules`` (roots first in each chunk, then forward-ish order)."""
    units: list[GatherUnit] = []
    owner: dict[int, int] = {}  # id(param) -> unit index
    for c, chunk in enumerate(modules):
        start = len(units)
        root = GatherUnit(index=start, chunk=c, name=f"chunk{c}", module=chunk, params=[], is_root=True)
        units.append(root)
        candidates = _unit_modules(chunk)
        users: dict[int, int] = {}
        members = []
        for name, m in candidates:
            params = _trainable(m)
            if not params:
                continue
            members.append((name, m, params))
            for p in params:
                users[id(p)] = users.get(id(p), 0) + 1
        for name, m, params in members:
            mine = [p for p in params if users[id(p)] == 1 and id(p) not in owner]
            if mine:
                units.append(GatherUnit(index=len(units), chunk=c, name=f"chunk{c}.{name}", module=m,
                                        params=mine, is_root=False))
                owner.update((id(p), units[-1].index) for p in mine)
        for p in _trainable(chunk):  # the rest, and parameters shared by two units, go to the root
            unit = owner.get(id(p))
            if unit is None:
                root.params.append(p)
                owner[id(p)] = start
            elif unit < start:
                raise ValueError(f"ZeRO stage 3: a parameter of model chunk {c} is also in an earlier chunk; "
                                 f"chunks must not share parameters")
    return units


def unit_index_of(units: list[GatherUnit]) -> dict[int, int]:
    """``id(param) -> unit index`` for ``BufferLayout(unit_of=...)``."""
    return {id(p): u.index for u in units for p in u.params}
