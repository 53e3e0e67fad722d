"""Odd reshard pairs: a drawn odd model shape saved at an odd layout, resumed at another layout.

``tests/reshard_matrix.py`` moves runs between layouts of the matrix's fixed models (hidden 64, degrees
in {1, 2, 4}); here both sides come from the shape fuzz (``tests/shape_fuzz.py``): the source is a
validator-accepted ``ShapeCase`` (degrees 3 and 5, world ``MIN_WORLD``-``MAX_WORLD``, a drawn hidden / head /
kv-head / FFN / vocabulary / layer / sequence shape, 6 experts for MoE draws), the target a further fuzz
layout with the source's shape, sequence, document mask and global batch swapped in (any world up to
``MAX_WORLD``, one process too), accepted by the validator. Every fuzz vocabulary is one no tp > 1 divides,
so each change of tp re-pads the vocabulary. The pair trains and checks as any ``reshard_matrix.Pair``.

Pair ``k`` under property ``label`` is reproducible from ``(ODD_PAIR_SEED, label, k)`` alone.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from typing import Callable

from tests import layout_matrix as lm
from tests import layout_run as lr
from tests import noise_floor as nf
from tests import reshard_matrix as rm
from tests import shape_fuzz as sf
from tests.float64_run import train_float64_on_rank

ODD_PAIR_SEED = 20261207
MAX_DRAWS = 4000
CI_MAX_WORLD = 3  # CI's pairs: at most 3 ranks on either side (2 cores)
CI_CANDIDATES = 6  # pairs drawn per CI property, the cheapest kept

Cond = Callable[[sf.ShapeCase], bool]
# Each property: what the source must be, and what the target must be given the source.
PAIR_PROPERTIES: dict[str, tuple[Cond, Callable[[sf.ShapeCase, sf.ShapeCase], bool]]] = {
    "tp3 -> another tp": (lambda s: s.parallel["tp"] == 3, lambda s, t: t.parallel["tp"] != 3),
    "pp3 uneven -> another pp": (lambda s: s.parallel["pp"] == 3 and sf.uneven(s),
                                 lambda s, t: t.parallel["pp"] != 3),
    "dp3 ZeRO-2 -> another dp, another stage": (
        lambda s: s.parallel["dp"] == 3 and s.parallel["zero_stage"] == 2,
        lambda s, t: t.parallel["dp"] != 3 and t.parallel["zero_stage"] != 2),
    "cp3 -> cp1": (lambda s: s.parallel["cp"] == 3, lambda s, t: t.parallel["cp"] == 1),
    "ep3 -> another ep": (lambda s: s.parallel.get("ep", 1) == 3, lambda s, t: t.parallel.get("ep", 1) != 3),
    "ZeRO-3 at dp > 1 -> another stage": (
        lambda s: s.parallel["zero_stage"] == 3 and s.parallel["dp"] > 1,
        lambda s, t: t.parallel["zero_stage"] != 3),
    "any": (lambda s: True, lambda s, t: True),
}
CI_PROPERTIES = ("tp3 -> another tp", "pp3 uneven -> another pp")  # a degree-3 tp or pp source, world <= 3
EXTENDED_PAIRS = {label: (6 if label == "any" else 2) for label in PAIR_PROPERTIES}  # plus CI's


def _side(case: sf.ShapeCase) -> rm.Side:
    return rm.Side(dict(case.parallel), dict(case.train))


def _on_source_shape(draw: sf.ShapeCase, source: sf.ShapeCase) -> sf.ShapeCase:
    """``draw``'s layout (parallel section, micro-batch, recompute) on ``source``'s model, data and batch."""
    train = dict(draw.train, global_batch_size=source.train["global_batch_size"])
    return dataclasses.replace(draw, model=source.model, shape=source.shape, seq=source.seq, train=train,
                               document_mask=source.document_mask)


def _fits(case: sf.ShapeCase, max_world: int) -> bool:
    """Within the world budget, and cheap on 2 cores: the layout matrix's microbatch budget."""
    return case.world_size <= max_world and lm.affordable_for_ci(case, "")


@functools.lru_cache(maxsize=None)
def odd_pair(label: str, k: int, max_world: int = sf.MAX_WORLD) -> rm.Pair:
    """Pair ``k`` of property ``label``: the first valid source draw meeting its source condition, then the
    first valid target (same MoE-ness, another layout) meeting its target condition; both within ``max_world``."""
    source_ok, target_ok = PAIR_PROPERTIES[label]
    rng = random.Random(f"{ODD_PAIR_SEED}:{label}:{k}")
    source = target = None
    for _ in range(MAX_DRAWS):
        case = sf.draw(rng, k)
        if source is None:
            if sf.MIN_WORLD <= case.world_size and _fits(case, max_world) and source_ok(case) \
                    and sf.judge(case).error is None:
                source = case
            continue
        case = _on_source_shape(case, source)
        layers = case.parallel["pp_layers"]
        if (("ep" in case.parallel) == ("ep" in source.parallel) and _fits(case, max_world)
                and (layers is None or sum(layers) == source.shape["num_layers"])
                and _side(case).label() != _side(source).label() and target_ok(source, case)
                and sf.judge(case).error is None):
            target = case
            break
    if source is None or target is None:
        raise RuntimeError(f"odd reshard pair {label!r} {k}: no valid pair in {MAX_DRAWS} draws")
    return rm.Pair(f"odd-{source.shape['name']}", _side(source), _side(target), case=source)


def pair_cost(pair: rm.Pair) -> int:
    """Roughly what a pair costs on 2 cores: ``layout_matrix.ci_cost`` of its source and its target."""
    assert pair.case is not None
    return sum(lm.ci_cost(dataclasses.replace(pair.case, parallel=s.parallel, train=s.train))
               for s in (pair.source, pair.target))


def ci_pairs() -> list[rm.Pair]:
    """Per ``CI_PROPERTIES`` entry, the cheapest (``pair_cost``) of its first ``CI_CANDIDATES`` pairs within
    ``CI_MAX_WORLD``, then the first drawn."""
    return [min((odd_pair(label, k, CI_MAX_WORLD) for k in range(CI_CANDIDATES)), key=pair_cost)
            for label in CI_PROPERTIES]


def extended_pairs() -> list[rm.Pair]:
    """One or more pairs per ``PAIR_PROPERTIES`` entry (``EXTENDED_PAIRS``), the CI pairs left out."""
    return [odd_pair(label, k) for label, n in EXTENDED_PAIRS.items() for k in range(n)]


def single_process_tolerances(pair: rm.Pair, single: list, out_dir: str, cache_dir: str) -> dict[int, float]:
    """step -> the relative tolerance of the one-process comparison, by ``tests/noise_floor.py``'s rule: the
    one-process run (``single``, ``rm.single_process_values``) again with one sample per micro-batch gives
    the shape's rounding floor; a floor at ``FLOOR_CAP`` or above fails (no verdict possible). Why: cp3
    layouts of drawn shapes sit at 1e-5-6e-5 from the one-process grad norm by step 2-3, as does the
    one-process run itself re-batched (docs/checkpoints.md, "Odd pairs")."""
    values = rm.single_process_values(pair, out_dir, cache_dir)
    values["train"]["micro_batch_size"] = 1
    floors = nf.floors(lr.train_reference(values, True), single)
    assert max(floors.values()) < nf.FLOOR_CAP, (pair.name, floors)
    return {step: nf.tolerance(f) for step, f in floors.items()}


def float64_gaps(pair: rm.Pair, out_dir: str, cache_dir: str) -> dict[int, float]:
    """step -> the largest relative gap (loss, grad norm, eval loss) between the pair's uninterrupted source
    and its one-process run, both trained in float64 (``tests/float64_run.py``). The verdict on a miss of
    ``single_process_tolerances``: rounding amplified by a threshold (an Adam update of a gradient below
    ``eps``, a top-k near tie) shrinks with the rounding, a wrong term does not. Measured on the one such pair
    (``any`` 3, h96 MoE dp2 cp3 a2a): fp32 step 4 1.5e-5, float64 <= 2.4e-7 at every step (docs/checkpoints.md)."""
    values = rm.job_values(pair, pair.source, os.path.join(out_dir, "source"), cache_dir)
    curve = next(c for c in rm.run(train_float64_on_rank, pair.source.world_size, values) if c)
    single = rm.single_process_values(pair, os.path.join(out_dir, "single"), cache_dir)
    ref = rm.run(train_float64_on_rank, 1, single)[0]
    return {r[0]: max(abs(a - b) / abs(b) for a, b in zip(got[1:], r[1:]) if b is not None)
            for got, r in zip(curve, ref)}
