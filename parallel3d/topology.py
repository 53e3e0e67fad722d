"""The one place that does rank arithmetic: two grids over the same ranks, from one order string.

Dimensions. ``tp`` (tensor), ``cp`` (context), ``ep`` (expert), ``dp`` (data) and
``pp`` (pipeline) parallel sizes, and ``etp`` (expert tensor parallel, default ``tp``).
Ranks form two grids, both laid out by the same ``order``, fastest-varying first:

- the dense grid (attention, dense MLPs, embeddings): sizes ``tp, cp, ep=1, dp, pp``,
  so ``world_size = tp * cp * dp * pp``;
- the expert grid (MoE experts), folded over the same ranks as megatron-core folds it:
  ``tp -> etp``, ``cp -> 1``, ``ep -> ep``, ``dp -> edp``, ``pp -> pp``, with expert
  data parallel ``edp = world_size / (etp * ep * pp)``.

Rank formula. Let ``d_0, ..., d_4`` be the order's dimensions (dimensions the order
string omits must have size 1 in both grids and are appended; where a size-1
dimension sits changes nothing) and ``n_i`` their sizes in one grid. The rank at
coordinates ``c_i`` (``0 <= c_i < n_i``) is::

    rank = c_0 + n_0 * (c_1 + n_1 * (c_2 + n_2 * (c_3 + n_3 * c_4)))
         = sum_i c_i * s_i,   s_i = n_0 * ... * n_{i-1}   (the stride of d_i)

and a rank's coordinates are ``c_i = (rank // s_i) % n_i``. A group of a kind varies
some dimensions of one grid and fixes the rest: the group of ``rank`` is every rank
whose coordinates on the fixed dimensions equal ``rank``'s. Both grids give the same
``pp`` coordinate to every rank only when the product of the sizes before ``pp`` in
the order is the same in both (then so is the product after it); a fold where it is
not is refused, as megatron-core refuses it.

With the default ``"tp-cp-ep-dp-pp"`` a tensor-parallel group is ``tp`` consecutive
ranks (one node's NVLink island) and pipeline stages are furthest apart, as in
Megatron. Every other module asks a ``Topology``; nothing else computes ranks. Pure
Python: no torch.distributed needed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

ORDER_DIMS: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")  # names an order string may use
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
DENSE_DIMS: tuple[str, ...] = ("tp", "cp", "dp", "pp")
EXPERT_DIMS: tuple[str, ...] = ("etp", "ep", "edp", "pp")
# The expert grid's dimension at each order position (megatron-core's expert rank generator).
EXPERT_AT: dict[str, str | None] = {"tp": "etp", "cp": None, "ep": "ep", "dp": "edp", "pp": "pp"}
# Every dimension of either grid: (grid, the order position it occupies).
DIM_PLACES: dict[str, tuple[str, str]] = {
    **{d: ("dense", d) for d in DENSE_DIMS},
    **{e: ("expert", d) for d, e in EXPERT_AT.items() if e is not None and e != "pp"},
}
GRIDS: tuple[str, ...] = ("dense", "expert")


class LayoutError(ValueError):
    """A parallel layout that cannot work (raised before any process is spawned)."""


@dataclass(frozen=True)
class GroupKind:
    """A kind of group: which grid, which of its dimensions vary inside a group.

    ``ends_only``: keep only the first and last member of each group (one rank when
    the group has one), the tied-embedding pairs of each pipeline.
    """

    grid: str
    dims: tuple[str, ...]
    ends_only: bool = False


# Every group kind, declared once. Dense kinds vary DENSE_DIMS, expert kinds EXPERT_DIMS.
GROUP_KINDS: dict[str, GroupKind] = {
    "tp": GroupKind("dense", ("tp",)),
    "cp": GroupKind("dense", ("cp",)),
    "dp": GroupKind("dense", ("dp",)),  # replicas that read different data
    "pp": GroupKind("dense", ("pp",)),  # one pipeline
    "dp_cp": GroupKind("dense", ("dp", "cp")),  # replicas of a dense parameter: gradients reduce here
    "tp_cp": GroupKind("dense", ("tp", "cp")),
    "model": GroupKind("dense", ("tp", "pp")),  # one copy of every dense parameter (cp ranks replicate it)
    "embedding": GroupKind("dense", ("pp",), ends_only=True),  # first and last stage of each pipeline
    "world": GroupKind("dense", DENSE_DIMS),
    "ep": GroupKind("expert", ("ep",)),
    "etp": GroupKind("expert", ("etp",)),
    "edp": GroupKind("expert", ("edp",)),  # replicas of an expert parameter
    "etp_ep": GroupKind("expert", ("etp", "ep")),
    "expert_model": GroupKind("expert", ("etp", "ep", "pp")),  # one copy of every expert parameter
}


def complement(kind: str) -> str:
    """The kind varying exactly the other dimensions of ``kind``'s grid.

    The complement of a parameter's replica group (``dp_cp``, ``edp``) is the group
    holding one copy of every such parameter (``model``, ``expert_model``): a sum over
    the one, then over the other, covers the grid once.
    """
    spec = GROUP_KINDS[kind]
    dims = DENSE_DIMS if spec.grid == "dense" else EXPERT_DIMS
    rest = {d for d in dims if d not in spec.dims}
    for name, other in GROUP_KINDS.items():
        if other.grid == spec.grid and set(other.dims) == rest and not other.ends_only:
            return name
    raise LayoutError(f"group kind {kind!r} has no complement in GROUP_KINDS")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise LayoutError(f"{name} must be >= 1, got {name}={value}")
    return value


def _parse_order(order: str) -> tuple[str, ...]:
    """The named dimensions of ``order``, checked for unknown and repeated names."""
    if not isinstance(order, str):
        raise LayoutError(f"order must be a string like {DEFAULT_ORDER!r}, got {order!r}")
    parts = tuple(p.strip() for p in order.split("-"))
    for part in parts:
        if part not in ORDER_DIMS:
            raise LayoutError(
                f"order {order!r}: unknown dimension {part!r}; use a permutation of "
                f"{', '.join(ORDER_DIMS)} separated by '-', e.g. {DEFAULT_ORDER!r}"
            )
    dupes = sorted({p for p in parts if parts.count(p) > 1})
    if dupes:
        raise LayoutError(f"order {order!r}: dimension {dupes[0]!r} appears more than once")
    return parts


@dataclass(frozen=True)
class Coords:
    """A rank's coordinates in the dense grid (its expert coordinates: ``Topology.coord``)."""

    tp: int
    cp: int
    dp: int
    pp: int

    def __getitem__(self, dim: str) -> int:
        if dim not in DENSE_DIMS:
            raise KeyError(f"{dim!r} is not a dense dimension {DENSE_DIMS}")
        return getattr(self, dim)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A layout of ranks over named dimensions; see the module docstring for the formula.

    Two topologies are equal when they give the same groups: same sizes and the same
    order of their dimensions of size > 1 (``"tp-dp-pp"`` equals ``"tp-cp-ep-dp-pp"``
    when cp = ep = 1). Group kinds: ``GROUP_KINDS``. Every kind but ``embedding``
    partitions all ranks; ``embedding`` covers only the end stages of each pipeline.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    etp: int | None = None  # expert tensor parallel; None: tp
    order: str = field(default=DEFAULT_ORDER, compare=False)
    _order: tuple[str, ...] = field(init=False, repr=False)  # all five, size > 1 ones as given
    _cache: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "ep", "dp", "pp"):
            _positive_int(name, getattr(self, name))
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        _positive_int("etp", self.etp)
        named = _parse_order(self.order)
        expert_block = self.etp * self.ep * self.pp
        if self.world_size % expert_block:
            raise LayoutError(
                f"world_size = tp*cp*dp*pp = {self.tp}*{self.cp}*{self.dp}*{self.pp} = {self.world_size} "
                f"is not divisible by etp*ep*pp = {self.etp}*{self.ep}*{self.pp} = {expert_block}, "
                f"so the experts' data-parallel size edp is not a whole number"
            )
        object.__setattr__(self, "_cache", {})
        for dim in ORDER_DIMS:
            if dim in named:
                continue
            if self._sizes("dense")[dim] > 1 or self._sizes("expert")[dim] > 1:
                grid_dim = dim if self._sizes("dense")[dim] > 1 else EXPERT_AT[dim]
                raise LayoutError(
                    f"order {self.order!r} does not name {dim!r}, but {grid_dim}={self.size(grid_dim)} > 1"
                    + (f" (the expert grid's {grid_dim} takes the place of {dim})" if grid_dim != dim else "")
                    + f"; name every dimension of size > 1, e.g. {DEFAULT_ORDER!r}"
                )
        full = named + tuple(d for d in ORDER_DIMS if d not in named)
        # Size-1 dimensions go last, in a fixed order: equal layouts get equal ``_order``s.
        object.__setattr__(self, "_order", tuple(d for d in full if self._any_size(d) > 1)
                           + tuple(d for d in ORDER_DIMS if self._any_size(d) == 1))
        self._check_fold()

    def _any_size(self, dim: str) -> int:
        return max(self._sizes("dense")[dim], self._sizes("expert")[dim])

    def _sizes(self, grid: str) -> dict[str, int]:
        """Sizes at each order position (keyed by the dense name of the position)."""
        if grid == "dense":
            return {d: getattr(self, d) if d in DENSE_DIMS else 1 for d in ORDER_DIMS}
        return {d: getattr(self, e) if e else 1 for d, e in EXPERT_AT.items()}

    def _check_fold(self) -> None:
        """Refuse a fold where the dense and expert grids disagree on the pipeline groups."""
        before = self._order[: self._order.index("pp")]
        dense, expert = self._span("dense", before), self._span("expert", before)
        if self.pp > 1 and dense[1] != expert[1]:
            raise LayoutError(
                f"{self.describe()}: the dense and expert grids would give different pipeline groups: "
                f"in order {self.order!r} the dimensions before pp span {dense[0]} = {dense[1]} ranks in the "
                f"dense grid but {expert[0]} = {expert[1]} in the expert grid; put pp last in the order or "
                f"make these products equal"
            )

    def _span(self, grid: str, positions: tuple[str, ...]) -> tuple[str, int]:
        """``("tp*dp", 4)``: the dimensions of ``grid`` at ``positions`` with size > 1, and their product."""
        sizes = self._sizes(grid)
        names = [d if grid == "dense" else EXPERT_AT[d] for d in positions if sizes[d] > 1]
        product = 1
        for d in positions:
            product *= sizes[d]
        return "*".join(names) or "1", product

    # ---- sizes -----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data parallel size: the replicas of one expert parameter."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def size(self, dim: str) -> int:
        """The size of one dimension of either grid (``tp cp dp pp ep etp edp``)."""
        if dim not in DIM_PLACES:
            raise LayoutError(f"unknown dimension {dim!r}; expected one of {tuple(DIM_PLACES)}")
        return getattr(self, dim)

    def check_world_size(self, world_size: int) -> None:
        """Raise if this layout does not use exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            raise LayoutError(
                f"tp*cp*dp*pp = {self.tp}*{self.cp}*{self.dp}*{self.pp} = {self.world_size} "
                f"but the job has world_size={world_size} ranks"
            )

    # ---- coordinates -----------------------------------------------------
    def _strides(self, grid: str) -> dict[str, int]:
        """The stride of each order position in ``grid`` (keyed by the dense name of the position)."""
        key = ("strides", grid)
        if key not in self._cache:
            sizes, stride, out = self._sizes(grid), 1, {}
            for d in self._order:
                out[d] = stride
                stride *= sizes[d]
            self._cache[key] = out
        return self._cache[key]

    def _check_rank(self, rank: int) -> None:
        if not (0 <= rank < self.world_size):
            raise LayoutError(f"rank {rank} out of range for world_size={self.world_size}")

    def coord(self, dim: str, rank: int) -> int:
        """``rank``'s coordinate along ``dim`` of its grid (its rank inside its ``dim`` group)."""
        self._check_rank(rank)
        if dim not in DIM_PLACES:
            raise LayoutError(f"unknown dimension {dim!r}; expected one of {tuple(DIM_PLACES)}")
        grid, position = DIM_PLACES[dim]
        return (rank // self._strides(grid)[position]) % self._sizes(grid)[position]

    def coords(self, rank: int) -> Coords:
        """``rank``'s dense coordinates."""
        return Coords(**{d: self.coord(d, rank) for d in DENSE_DIMS})

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The rank at these dense coordinates (inverse of ``coords``)."""
        given = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        strides = self._strides("dense")
        for dim, c in given.items():
            if not (0 <= c < self.size(dim)):
                raise LayoutError(f"{dim} coordinate {c} out of range [0, {self.size(dim)})")
        return sum(c * strides[dim] for dim, c in given.items())

    # ---- groups ----------------------------------------------------------
    def groups(self, kind: str) -> list[list[int]]:
        """All groups of ``kind``, each an ascending rank list, ordered by first rank (same on every rank)."""
        if kind not in self._cache:
            self._cache[kind] = self._build_groups(kind)
        return [list(g) for g in self._cache[kind]]

    def _build_groups(self, kind: str) -> list[list[int]]:
        spec = GROUP_KINDS.get(kind)
        if spec is None:
            raise LayoutError(f"unknown group kind {kind!r}; expected one of {tuple(GROUP_KINDS)}")
        sizes, strides = self._sizes(spec.grid), self._strides(spec.grid)
        positions = {DIM_PLACES[d][1] for d in spec.dims}
        varying = [d for d in self._order if d in positions]
        fixed = [d for d in self._order if d not in positions]

        def offsets(dims: list[str]) -> list[int]:
            # Fastest dimension innermost, so the offsets come out ascending.
            combos = itertools.product(*(range(sizes[d]) for d in reversed(dims)))
            return [sum(c * strides[d] for c, d in zip(combo, reversed(dims))) for combo in combos]

        inside = offsets(varying)
        out = [[base + o for o in inside] for base in offsets(fixed)]
        if spec.ends_only:
            out = [sorted({g[0], g[-1]}) for g in out]
        return out

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The members of ``rank``'s group of ``kind`` ([] for a middle stage's embedding group)."""
        self._check_rank(rank)
        key = ("index", kind)
        if key not in self._cache:
            self._cache[key] = {r: i for i, g in enumerate(self.groups(kind)) for r in g}
        index = self._cache[key].get(rank)
        return [] if index is None else list(self._cache[kind][index])

    def group_size(self, kind: str) -> int:
        """Members of a group of ``kind`` (for ``embedding``: of an end stage's group)."""
        return len(self.groups(kind)[0])

    # ---- pipeline neighbours ----------------------------------------------
    def stage_of(self, rank: int) -> int:
        return self.coord("pp", rank)

    def stage_rank(self, rank: int, stage: int) -> int:
        """The rank holding pipeline ``stage`` in ``rank``'s pipeline."""
        if not (0 <= stage < self.pp):
            raise LayoutError(f"pp coordinate {stage} out of range [0, {self.pp})")
        return rank + (stage - self.stage_of(rank)) * self._strides("dense")["pp"]

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
        if num_layers < fewest_layers(chunks):
            raise LayoutError(
                f"num_layers={num_layers} is fewer than pipeline chunks pp*virtual_stages="
                f"{self.pp}*{virtual_stages}={chunks} less the first and the last ({chunks - 2}); every chunk but "
                f"the first (embedding) and the last (final norm, head) needs at least one layer"
            )

    def describe(self) -> str:
        """A short human-readable summary, e.g. for logs (expert sizes only when they differ from 1/tp)."""
        sizes = ", ".join(f"{d}={self.size(d)}" for d in ("tp", "cp", "ep", "dp", "pp"))
        expert = f", etp={self.etp}, edp={self.edp}" if self.ep > 1 or self.etp != self.tp else ""
        return f"Topology({sizes}{expert}, order={self.order!r}, world_size={self.world_size})"


def fewest_layers(chunks: int) -> int:
    """The fewest transformer layers ``chunks`` pipeline chunks can hold: one per middle chunk, while the
    first may hold the embedding alone and the last the final norm and head alone (at least one layer
    in all: a model has layers)."""
    return max(chunks - 2, 1)
