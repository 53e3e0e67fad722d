"""The one place that does rank arithmetic.

A job of ``world_size = tp * pp * dp`` ranks is a 3-D grid. ``order`` names the
three dimensions from fastest-varying to slowest, so for ``order = "a-b-c"``::

    rank = c_a + size_a * (c_b + size_b * c_c)

With the default ``"tp-dp-pp"`` a tensor-parallel group is ``tp`` consecutive
ranks (one node's NVLink island) and pipeline stages are furthest apart, which
is what Megatron does. Everything else in parallel3d (process groups, pipeline
neighbours, data sharding, planners) asks a ``Topology``; nothing else computes
ranks. It is pure Python: no torch.distributed needed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

DIMENSIONS: tuple[str, ...] = ("tp", "dp", "pp")
GROUP_KINDS: tuple[str, ...] = ("tp", "dp", "pp", "model", "embedding")


class LayoutError(ValueError):
    """A parallel layout that cannot work (raised before any process is spawned)."""


@dataclass(frozen=True)
class Coords:
    """Position of one rank in the grid."""

    tp: int
    dp: int
    pp: int


def _parse_order(order: str) -> tuple[str, ...]:
    if not isinstance(order, str):
        raise LayoutError(f"order must be a string like 'tp-dp-pp', got {order!r}")
    parts = tuple(p.strip() for p in order.split("-"))
    for part in parts:
        if part not in DIMENSIONS:
            raise LayoutError(
                f"order {order!r}: unknown dimension {part!r}; use a permutation of tp, dp, pp "
                f"separated by '-', e.g. 'tp-dp-pp'"
            )
    dupes = sorted({p for p in parts if parts.count(p) > 1})
    if dupes:
        raise LayoutError(f"order {order!r}: dimension {dupes[0]!r} appears more than once")
    missing = [d for d in DIMENSIONS if d not in parts]
    if missing:
        raise LayoutError(f"order {order!r}: missing dimension {missing[0]!r}; it must name tp, dp and pp")
    return parts


@dataclass(frozen=True)
class Topology:
    """A (tp, pp, dp) layout of ranks; see the module docstring for the formula.

    Group kinds: ``tp``, ``dp``, ``pp`` (one pipeline), ``model`` (tp x pp: one
    model replica) and ``embedding`` (first and last stage of each pipeline, for
    tied embeddings; a single rank when pp == 1). The first four partition all
    ranks; ``embedding`` covers only the end stages.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = "tp-dp-pp"
    _dims: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _cache: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(f"{name} must be an integer >= 1, got {value!r}")
            if value < 1:
                raise LayoutError(f"{name} must be >= 1, got {name}={value}")
        object.__setattr__(self, "_dims", _parse_order(self.order))
        object.__setattr__(self, "_cache", {})

    # ---- sizes -----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def size(self, dim: str) -> int:
        if dim not in DIMENSIONS:
            raise LayoutError(f"unknown dimension {dim!r}; expected one of {DIMENSIONS}")
        return getattr(self, dim)

    def check_world_size(self, world_size: int) -> None:
        """Raise if this layout does not use exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            raise LayoutError(
                f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size} "
                f"but the job has world_size={world_size} ranks"
            )

    # ---- coordinates -----------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not (0 <= rank < self.world_size):
            raise LayoutError(f"rank {rank} out of range for world_size={self.world_size}")

    def coords(self, rank: int) -> Coords:
        self._check_rank(rank)
        values: dict[str, int] = {}
        rest = rank
        for dim in self._dims:
            values[dim] = rest % self.size(dim)
            rest //= self.size(dim)
        return Coords(**values)

    def rank_of(self, *, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        given = {"tp": tp, "dp": dp, "pp": pp}
        rank = 0
        for dim in reversed(self._dims):
            c = given[dim]
            if not (0 <= c < self.size(dim)):
                raise LayoutError(f"{dim} coordinate {c} out of range [0, {self.size(dim)})")
            rank = rank * self.size(dim) + c
        return rank

    # ---- groups ----------------------------------------------------------
    def _groups_varying(self, varying: tuple[str, ...]) -> list[list[int]]:
        fixed = [d for d in DIMENSIONS if d not in varying]
        groups = []
        for fixed_vals in itertools.product(*(range(self.size(d)) for d in fixed)):
            base = dict(zip(fixed, fixed_vals))
            members = []
            for var_vals in itertools.product(*(range(self.size(d)) for d in varying)):
                members.append(self.rank_of(**base, **dict(zip(varying, var_vals))))
            groups.append(sorted(members))
        return sorted(groups)

    def groups(self, kind: str) -> list[list[int]]:
        """All groups of ``kind``, each a sorted rank list, in a fixed order (same on every rank)."""
        if kind not in self._cache:
            self._cache[kind] = self._build_groups(kind)
        return [list(g) for g in self._cache[kind]]

    def _build_groups(self, kind: str) -> list[list[int]]:
        if kind in ("tp", "dp", "pp"):
            return self._groups_varying((kind,))
        if kind == "model":
            return self._groups_varying(("tp", "pp"))
        if kind == "embedding":
            out = []
            for pipeline in self.groups("pp"):
                ends = sorted({self.stage_rank(pipeline[0], 0), self.stage_rank(pipeline[0], self.pp - 1)})
                out.append(ends)
            return sorted(out)
        raise LayoutError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The members of ``rank``'s group of ``kind`` ([] for a middle stage's embedding group)."""
        self._check_rank(rank)
        key = ("index", kind)
        if key not in self._cache:
            self._cache[key] = {r: i for i, g in enumerate(self.groups(kind)) for r in g}
        index = self._cache[key].get(rank)
        return [] if index is None else list(self._cache[kind][index])

    # ---- pipeline neighbours ----------------------------------------------
    def stage_of(self, rank: int) -> int:
        return self.coords(rank).pp

    def stage_rank(self, rank: int, stage: int) -> int:
        """The rank holding pipeline ``stage`` in ``rank``'s pipeline."""
        c = self.coords(rank)
        return self.rank_of(tp=c.tp, dp=c.dp, pp=stage)

    def next_stage_rank(self, rank: int) -> int | None:
        stage = self.stage_of(rank)
        return None if stage == self.pp - 1 else self.stage_rank(rank, stage + 1)

    def prev_stage_rank(self, rank: int) -> int | None:
        stage = self.stage_of(rank)
        return None if stage == 0 else self.stage_rank(rank, stage - 1)

    def is_first_stage(self, rank: int) -> bool:
        return self.stage_of(rank) == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.stage_of(rank) == self.pp - 1

    # ---- model fit ---------------------------------------------------------
    def check_model(
        self,
        *,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        hidden_size: int | None = None,
        virtual_stages: int = 1,
    ) -> None:
        """Raise ``LayoutError`` if a model with these sizes cannot be laid out.

        Vocabulary is not checked here: models pad it to a multiple of tp (and log it).
        """
        kv = num_heads if num_kv_heads is None else num_kv_heads
        if hidden_size is not None and hidden_size % num_heads:
            raise LayoutError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        if num_heads % self.tp:
            raise LayoutError(f"num_heads={num_heads} is not divisible by tp={self.tp}")
        if kv % self.tp:
            raise LayoutError(
                f"num_kv_heads={kv} is not divisible by tp={self.tp} "
                f"(each tensor-parallel rank needs whole key/value heads)"
            )
        if num_heads % kv:
            raise LayoutError(f"num_heads={num_heads} is not divisible by num_kv_heads={kv}")
        chunks = self.pp * virtual_stages
        if num_layers < chunks:
            raise LayoutError(
                f"num_layers={num_layers} is fewer than pipeline chunks pp*virtual_stages="
                f"{self.pp}*{virtual_stages}={chunks}; every chunk needs at least one layer"
            )

    def describe(self) -> str:
        """A short human-readable summary, e.g. for logs."""
        return (
            f"Topology(tp={self.tp}, pp={self.pp}, dp={self.dp}, order={self.order!r}, "
            f"world_size={self.world_size})"
        )
