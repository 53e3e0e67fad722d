"""Drawn layouts for the dry run against real gloo ranks: ``shape_fuzz``'s odd shapes and degrees, plus precision
and the experts' own tensor-parallel degree and ZeRO stage.

``generate(case_id)``: the first draw of the RNG seeded by ``FUZZ_SEED`` and the id that the config validator
accepts (``shape_fuzz.draw``: tp, pp, dp, cp in 1/2/3/5 with every ``cp_comm``, ep over 6 experts, every schedule,
virtual stages, uneven stages with empty end chunks, ZeRO 0-3, host offload, odd model shapes, worlds 3-6), with
what ``shape_fuzz`` does not draw taken from a salted fork of the RNG (its draws keep their values): the precision
(fp32 / bf16) and, on MoE draws, ``parallel.etp`` and ``parallel.expert_zero_stage``. Validity is the validator's
(``shape_fuzz.judge``). Ids from ``MOE_BASE`` keep MoE draws only. ``ci_sample()`` is a greedy cover of
``PROPERTIES`` over the first ``CI_POOL`` cases and ``MOE_CI_POOL`` MoE cases, the cheapest case per property not
yet met (``layout_matrix.ci_cost``).

Ids from ``WIDE_BASE`` on (``--dryrun-seeds A:B`` runs a range of them) widen the draw where the ids below keep
theirs: worlds up to ``WIDE_MAX_WORLD`` ranks, every precision of ``config.PRECISIONS`` (fp16 too), and on MoE draws
half the time a MoE preset of ``conf/model`` (``MOE_PRESETS``: 8 experts, top-2; DeepSeek's shared expert and dense
first layer) with ep over its expert count, all from a second salted fork. Ids from ``OPTIONS_BASE`` on
(``--dryrun-seeds 1000:B``) also draw, from a third fork, what changes a rank's bytes or messages beyond the layout
(``_draw_options``): the gradients' reduction dtype, ZeRO's parameter all-gather overlap,
``parallel.split_drain`` and the MoE dispatcher, each over its options module's values (none of them was drawn
before session 44).

``real_on_rank`` is the ``run_on_ranks`` target: a real ``Trainer`` on gloo, its bytes and one step's messages
(``real_step.held_and_sent``).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from parallel3d import config as cfg
from parallel3d.config import ConfigError, job_from_dict, resolve
from parallel3d.moe.options import DISPATCHERS
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.options import SPLIT_DRAIN_VALUES, drain_is_split
from parallel3d.trainer import Trainer
from tests import layout_matrix as lm
from tests import shape_fuzz as sf
from tests.real_step import Sent, held_and_sent

FUZZ_SEED = 20261207
CI_POOL, ALL_CASES = 24, 40  # cases 0 .. CI_POOL - 1 are the candidates of the CI cover; the whole fuzz to ALL_CASES
# Ids from MOE_BASE on keep only MoE draws (shape_fuzz draws 30% MoE, and the validator refuses most of them).
MOE_BASE, MOE_CI_POOL, MOE_CASES = 1000, 8, 12
MAX_DRAWS = 2000
PRECISIONS = ("fp32", "bf16")
ETP_DEGREES = (1, 2, 3)
# Ids from WIDE_BASE on: the widened draw (module docstring). Up to 8 ranks: the task's bound for a real gloo run here.
WIDE_BASE, WIDE_MAX_WORLD = 2000, 8
MOE_PRESETS, PRESET_EP_DEGREES = ("mixtral_tiny", "deepseek_tiny"), (1, 2, 4)
OPTIONS_BASE = WIDE_BASE + 1000  # the widened draw plus ``_draw_options``
FP16_LOSS_SCALE = 1.0  # fp16 jobs' first loss scale: one step without overflow on the real side (``values``)
MODEL_CONF = Path(__file__).resolve().parent.parent / "conf" / "model"


def _preset(name: str, seq: int) -> dict[str, Any]:
    """The model section of ``conf/model/<name>.yaml`` at sequence length ``seq`` (its own name kept apart)."""
    shape = OmegaConf.to_container(OmegaConf.load(MODEL_CONF / f"{name}.yaml"))
    return dict(shape, name=f"{name}-s{seq}", max_seq_len=max(seq, shape["max_seq_len"]))


def _widen(rng: random.Random, case: sf.ShapeCase) -> sf.ShapeCase:
    """A wide id's case (``WIDE_BASE``): any precision, and a MoE draw on a preset half the time."""
    fork = random.Random(repr(rng.getstate()) + "wide")
    train = dict(case.train, precision=fork.choice(cfg.PRECISIONS))
    shape, parallel = case.shape, dict(case.parallel)
    if "ep" in parallel and fork.random() < 0.5:
        shape = _preset(fork.choice(MOE_PRESETS), case.seq)
        parallel["ep"] = fork.choice(PRESET_EP_DEGREES)
    return dataclasses.replace(case, model=shape["name"], shape=shape, parallel=parallel, train=train)


def _drain_allowed(schedule: str, split_drain: bool | str, recompute: str) -> bool:
    """Whether ``parallel.split_drain`` may take this value here (the option's own rule, ``drain_is_split``)."""
    try:
        drain_is_split(schedule, split_drain, recompute)
    except ConfigError:
        return False
    return True


def _draw_options(rng: random.Random, case: sf.ShapeCase) -> sf.ShapeCase:
    """An options id's case (``OPTIONS_BASE``): the reduction dtype (fp32 or the precision), the all-gather
    overlap, the split drain and (MoE) the dispatcher. Not disk offload: the dry run refuses it (it would create the
    real job's state files; ``parallel3d/dryrun/__main__.py``), and host offload counts the same bytes."""
    fork = random.Random(repr(rng.getstate()) + "options")
    parallel, shape = dict(case.parallel), case.shape
    drains = [d for d in SPLIT_DRAIN_VALUES if _drain_allowed(parallel["schedule"], d, case.train["recompute"])]
    parallel.update(grad_reduce_dtype=fork.choice(sorted({"fp32", case.train["precision"]})),
                    overlap_param_gather=fork.choice((True, False)), split_drain=fork.choice(drains))
    if shape.get("moe"):
        shape = dict(shape, moe=dict(shape["moe"], dispatcher=fork.choice(DISPATCHERS)))
    return dataclasses.replace(case, parallel=parallel, shape=shape)


def _extend(rng: random.Random, case: sf.ShapeCase) -> sf.ShapeCase:
    """``case`` with a precision and (MoE) the experts' tp degree and ZeRO stage, from a fork of ``rng``."""
    fork = random.Random(repr(rng.getstate()) + "dryrun")
    parallel, train = dict(case.parallel), dict(case.train, precision=fork.choice(PRECISIONS))
    if "ep" in parallel:
        parallel["etp"] = fork.choice((parallel["tp"], *ETP_DEGREES))
        stage = fork.choice((None, *cfg.ZERO_STAGES))
        if stage is not None and stage != parallel["zero_stage"]:
            parallel["expert_zero_stage"] = stage
    return dataclasses.replace(case, parallel=parallel, train=train)


@functools.lru_cache(maxsize=None)
def generate(case_id: int) -> sf.ShapeCase:
    rng = random.Random(f"{FUZZ_SEED}:{case_id}")
    wide = case_id >= WIDE_BASE
    max_world = WIDE_MAX_WORLD if wide else sf.MAX_WORLD
    for _ in range(MAX_DRAWS):
        case = _extend(rng, sf.draw(rng, case_id))
        if wide:
            case = _widen(rng, case)
        elif case_id >= MOE_BASE and "ep" not in case.parallel:
            continue
        if case_id >= OPTIONS_BASE:
            case = _draw_options(rng, case)
        if sf.MIN_WORLD <= case.world_size <= max_world and sf.judge(case).error is None:
            return case
    raise RuntimeError(f"dry-run fuzz case {case_id}: no valid draw in {MAX_DRAWS}")


def values(case: sf.ShapeCase, out_dir: str, cache_dir: str) -> dict:
    """The job: the case's, saving nothing (one step is run by hand)."""
    v = case.values(out_dir, cache_dir)
    v["train"].update(async_save=False, resume="none")
    if v["train"]["precision"] == "fp16":
        # The dry run answers the overflow check as a healthy step's (dryrun/meta_values.py); fp16's default first
        # scale (2^16) overflows these tiny models' gradients, so the real step would skip the update and its sync.
        v["optimizer"]["loss_scale_init"] = FP16_LOSS_SCALE
    return v


def real_on_rank(rank: int, world: int, job_values: dict, emulate_nccl: bool) -> tuple[dict[str, int], Sent]:
    rj = resolve(job_from_dict(job_values), world)
    trainer = Trainer(rj, ParallelState(rj.topology, emulate_nccl=emulate_nccl))
    return held_and_sent(trainer)


def _p(c: sf.ShapeCase) -> dict:
    return c.parallel


# What the CI sample covers (each: the property of one layout dimension the gloo test had none of).
PROPERTIES: dict[str, Callable[[sf.ShapeCase], bool]] = {
    "tp3": lambda c: _p(c)["tp"] == 3,
    "cp3": lambda c: _p(c)["cp"] == 3,
    "ep": lambda c: _p(c).get("ep", 1) > 1,
    "etp": lambda c: _p(c).get("etp", _p(c)["tp"]) != _p(c)["tp"],
    "expert_zero_stage": lambda c: "expert_zero_stage" in _p(c),
    "virtual": lambda c: _p(c)["virtual_stages"] > 1,
    "uneven": sf.uneven,
    "empty_end_chunk": lambda c: 0 in (_p(c)["pp_layers"] or [1]),
    "zero3": lambda c: 3 in (_p(c)["zero_stage"], _p(c).get("expert_zero_stage")),
    "offload": lambda c: _p(c)["offload"] == "cpu",
    "bf16": lambda c: c.train["precision"] == "bf16",
    "world5": lambda c: c.world_size == 5,
}


@functools.lru_cache(maxsize=1)
def ci_sample() -> tuple[sf.ShapeCase, ...]:
    """Greedy cover of ``PROPERTIES`` (those any pool case has) over the first ``CI_POOL`` cases and the first
    ``MOE_CI_POOL`` MoE cases."""
    pool = [generate(i) for i in [*range(CI_POOL), *range(MOE_BASE, MOE_BASE + MOE_CI_POOL)]]
    uncovered = [k for k, f in PROPERTIES.items() if any(f(c) for c in pool)]
    chosen: list[sf.ShapeCase] = []
    while uncovered:
        gain = {c.case_id: sum(PROPERTIES[k](c) for k in uncovered) for c in pool}
        best = min((c for c in pool if gain[c.case_id]), key=lambda c: (lm.ci_cost(c) / gain[c.case_id], c.case_id))
        chosen.append(best)
        uncovered = [k for k in uncovered if not PROPERTIES[k](best)]
    return tuple(sorted({c.case_id: c for c in chosen}.values(), key=lambda c: (c.world_size, c.case_id)))


def seed_range(spec: str) -> range:
    """``--dryrun-seeds A:B``: wide ids ``WIDE_BASE + A`` up to ``WIDE_BASE + B`` (B excluded)."""
    start, _, stop = spec.partition(":")
    if not (start.isdigit() and stop.isdigit() and int(start) < int(stop)):
        raise ValueError(f"--dryrun-seeds {spec!r}: expected A:B with 0 <= A < B")
    return range(WIDE_BASE + int(start), WIDE_BASE + int(stop))


def all_cases() -> list[sf.ShapeCase]:
    ids = [*range(ALL_CASES), *range(MOE_BASE, MOE_BASE + MOE_CASES)]
    return sorted((generate(i) for i in ids), key=lambda c: (c.world_size, c.case_id))
