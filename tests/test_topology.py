"""Topology: groups equal megatron-core's RankGenerator on generated layouts (no process group needed).

The reference is megatron-core's ``RankGenerator`` (a dev dependency: a missing one fails
the suite; imported by the tests that use it, not at collection, where every xdist worker would pay its
~5 s import), built the way ``initialize_model_parallel`` builds its two generators: the dense
one with ``ep=1`` and the expert one with ``tp=etp, cp=1, dp=edp``, both with our order.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from parallel3d.topology import DENSE_DIMS, GROUP_KINDS, ORDER_DIMS, Coords, LayoutError, Topology, complement

ORDERS = ["-".join(p) for p in itertools.permutations(ORDER_DIMS)]
# Our kind -> megatron token, per generator (``initialize_model_parallel``'s groups).
DENSE_TOKENS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp_cp": "dp-cp", "tp_cp": "tp-cp",
                "model": "tp-pp", "world": "tp-cp-dp-pp"}
EXPERT_TOKENS = {"ep": "ep", "etp": "tp", "edp": "dp", "etp_ep": "tp-ep", "expert_model": "tp-ep-pp"}
SIZES = [1, 1, 1, 2, 2, 2, 3, 4, 4, 5, 8]
MAX_WORLD = 1024


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _random_sizes(rng: random.Random, large: bool) -> dict[str, int]:
    """tp, cp, dp, pp, etp, ep with etp * ep * pp dividing the world (the fold may still be refused);
    the world is at most 64, or with ``large`` between 257 and ``MAX_WORLD``."""
    while True:
        dense = {d: rng.choice(SIZES + [16] * large) for d in DENSE_DIMS}
        world = dense["tp"] * dense["cp"] * dense["dp"] * dense["pp"]
        if (256 < world <= MAX_WORLD) if large else world <= 64:
            break
    rest = world // dense["pp"]
    etp = dense["tp"] if rng.random() < 0.4 else rng.choice(_divisors(rest))
    ep = rng.choice(_divisors(rest // etp))
    return dict(dense, etp=etp, ep=ep)


def _cases(seed: int, per_order: int) -> list[tuple[dict[str, int], str]]:
    """Every order, ``per_order`` random layouts each; every third case drops the size-1 dimensions
    from the order at random (megatron-core appends them), one in ten has a world above 256."""
    rng = random.Random(seed)
    out = []
    for order in ORDERS:
        for i in range(per_order):
            sizes = _random_sizes(rng, large=rng.random() < 0.1)
            if i % 3 == 2:
                edp = sizes["tp"] * sizes["cp"] * sizes["dp"] // (sizes["etp"] * sizes["ep"])
                biggest = {"tp": max(sizes["tp"], sizes["etp"]), "cp": sizes["cp"], "ep": sizes["ep"],
                           "dp": max(sizes["dp"], edp), "pp": sizes["pp"]}
                order = "-".join(d for d in order.split("-") if biggest[d] > 1 or rng.random() < 0.5) or "tp"
            out.append((sizes, order))
    return out


def _megatron(sizes: dict[str, int], order: str) -> tuple[RankGenerator, RankGenerator]:  # noqa: F821
    from megatron.core.parallel_state import RankGenerator

    world = sizes["tp"] * sizes["cp"] * sizes["dp"] * sizes["pp"]
    dense = RankGenerator(tp=sizes["tp"], ep=1, dp=sizes["dp"], pp=sizes["pp"], cp=sizes["cp"], order=order)
    edp = world // (sizes["etp"] * sizes["ep"] * sizes["pp"])
    expert = RankGenerator(tp=sizes["etp"], ep=sizes["ep"], dp=edp, pp=sizes["pp"], cp=1, order=order)
    return dense, expert


def _megatron_groups(dense: RankGenerator, expert: RankGenerator) -> dict[str, list[list[int]]]:  # noqa: F821
    from megatron.core.parallel_state import default_embedding_ranks

    out = {kind: dense.get_ranks(token) for kind, token in DENSE_TOKENS.items()}
    out.update({kind: expert.get_ranks(token) for kind, token in EXPERT_TOKENS.items()})
    out["embedding"] = [default_embedding_ranks(g) for g in dense.get_ranks("pp")]
    return out


def test_every_kind_has_a_megatron_reference():
    assert set(DENSE_TOKENS) | set(EXPERT_TOKENS) | {"embedding"} == set(GROUP_KINDS)


@pytest.mark.parametrize("seed", [0, 1])
def test_groups_equal_megatron_rank_generator(seed):
    refused = accepted = 0
    for sizes, order in _cases(seed, per_order=3):
        dense, expert = _megatron(sizes, order)
        same_pipelines = dense.get_ranks("pp") == expert.get_ranks("pp")
        try:
            topo = Topology(order=order, **sizes)
        except LayoutError as exc:
            # megatron-core's initialize_model_parallel asserts the two grids' pp groups are equal.
            assert not same_pipelines and "different pipeline groups" in str(exc), (sizes, order, str(exc))
            refused += 1
            continue
        assert same_pipelines, (sizes, order)
        accepted += 1
        for kind, groups in _megatron_groups(dense, expert).items():
            assert topo.groups(kind) == groups, (kind, sizes, order)
    assert refused >= 20 and accepted >= 200  # the generator reaches both outcomes


def _check_invariants(topo: Topology) -> None:
    world = topo.world_size
    for r in range(world):
        c = topo.coords(r)
        assert topo.rank_of(**dataclasses.asdict(c)) == r
        for dim in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"):
            # A coordinate is the rank's index in its group of that dimension.
            assert topo.group_of(dim, r).index(r) == topo.coord(dim, r) < topo.size(dim)
        pipeline = topo.group_of("pp", r)
        nxt, prv = topo.next_stage_rank(r), topo.prev_stage_rank(r)
        assert nxt == (pipeline[c.pp + 1] if c.pp + 1 < topo.pp else None)
        assert prv == (pipeline[c.pp - 1] if c.pp > 0 else None)
        assert topo.is_first_stage(r) == (c.pp == 0) and topo.is_last_stage(r) == (c.pp == topo.pp - 1)
    assert len({topo.coords(r) for r in range(world)}) == world
    for kind in GROUP_KINDS:
        groups = topo.groups(kind)
        flat = sorted(r for g in groups for r in g)
        if kind != "embedding":
            assert flat == list(range(world)), f"{kind} groups do not partition the ranks"
        for g in groups:
            assert all(topo.group_of(kind, r) == g for r in g)
    for kind in ("dp_cp", "edp"):  # a parameter's replicas and its complement cover the grid once
        other = complement(kind)
        assert topo.group_size(kind) * topo.group_size(other) == world
        for r in range(world):
            assert set(topo.group_of(kind, r)) & set(topo.group_of(other, r)) == {r}


def test_invariants_on_generated_layouts():
    checked = 0
    for sizes, order in _cases(seed=7, per_order=1):
        if sizes["tp"] * sizes["cp"] * sizes["dp"] * sizes["pp"] > 64:
            continue
        try:
            topo = Topology(order=order, **sizes)
        except LayoutError:
            continue
        _check_invariants(topo)
        checked += 1
    assert checked >= 60


def test_old_three_dimension_orders_equal_the_five_dimension_ones():
    rng = random.Random(3)
    for three in itertools.permutations(("tp", "dp", "pp")):
        sizes = {d: rng.choice([1, 2, 3, 4]) for d in ("tp", "dp", "pp")}
        old = Topology(order="-".join(three), **sizes)
        # cp and ep inserted anywhere: the same layout when they have size 1.
        five = list(three)
        five.insert(rng.randrange(4), "cp")
        five.insert(rng.randrange(5), "ep")
        new = Topology(order="-".join(five), **sizes)
        assert old == new and hash(old) == hash(new)
        assert all(old.groups(k) == new.groups(k) for k in GROUP_KINDS)
    assert Topology(tp=2, dp=2, order="tp-dp-pp") != Topology(tp=2, dp=2, order="dp-tp-pp")


def test_default_order_tp_groups_are_consecutive_and_stages_furthest_apart():
    topo = Topology(tp=4, cp=2, dp=3, pp=2)
    for g in topo.groups("tp"):
        assert g == list(range(g[0], g[0] + 4))
    for r in range(topo.world_size):
        assert topo.coords(r).pp == r // (4 * 2 * 3)


def test_rank_formula_matches_order_string():
    topo = Topology(tp=2, cp=5, pp=3, dp=4, order="dp-cp-pp-tp")
    # dp fastest, then cp, then pp, then tp slowest.
    assert topo.rank_of(tp=1, cp=2, dp=3, pp=2) == 3 + 4 * (2 + 5 * (2 + 3 * 1))
    assert topo.coords(3 + 4 * (2 + 5 * (2 + 3 * 1))) == Coords(tp=1, cp=2, dp=3, pp=2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp=0), "tp must be >= 1"),
        (dict(pp=-2), "pp must be >= 1"),
        (dict(dp=1.5), "dp must be an integer"),
        (dict(etp=True), "etp must be an integer"),
        (dict(order="tp-dp-xx"), "unknown dimension 'xx'"),
        (dict(order="tp-tp-pp"), "appears more than once"),
        (dict(pp=2, order="tp-dp"), "does not name 'pp', but pp=2 > 1"),
        (dict(ep=2, dp=2, order="tp-dp-pp"), "does not name 'ep', but ep=2 > 1"),
        # dp = 1, but the expert grid's edp = 2 sits at dp's place
        (dict(tp=2, etp=1, order="tp-pp"), r"does not name 'dp', but edp=2 > 1 \(the expert grid's edp"),
        (dict(tp=2, dp=3, ep=4), r"is not divisible by etp\*ep\*pp = 2\*4\*1 = 8"),
        (dict(tp=2, etp=1, ep=1, pp=2, order="tp-pp-dp"), "different pipeline groups"),
    ],
)
def test_bad_layouts_fail_with_clear_message(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        Topology(**kwargs)


def test_positional_sizes_are_refused():
    with pytest.raises(TypeError):
        Topology(2, 2, 2)  # the old (tp, pp, dp) call would silently mean something else


def test_world_size_and_model_checks():
    topo = Topology(tp=2, pp=2, dp=2)
    with pytest.raises(LayoutError, match=r"tp\*cp\*dp\*pp = 2\*1\*2\*2 = 8 but the job has world_size=6"):
        topo.check_world_size(6)
    with pytest.raises(LayoutError, match="num_heads=6 is not divisible by tp=4"):
        Topology(tp=4).check_model(num_layers=4, num_heads=6)
    with pytest.raises(LayoutError, match="num_kv_heads=2 is not divisible by tp=4"):
        Topology(tp=4).check_model(num_layers=4, num_heads=8, num_kv_heads=2)
    with pytest.raises(LayoutError, match="num_layers=1 is fewer than pipeline chunks"):
        Topology(pp=4).check_model(num_layers=1, num_heads=4)
    Topology(pp=4).check_model(num_layers=2, num_heads=4)  # the end stages may hold no layer
    with pytest.raises(LayoutError, match="hidden_size=100 is not divisible by num_heads=3"):
        Topology().check_model(num_layers=3, num_heads=3, hidden_size=100)
    with pytest.raises(LayoutError, match="rank 8 out of range"):
        topo.coords(8)
    with pytest.raises(LayoutError, match="unknown group kind 'xp'"):
        topo.groups("xp")
