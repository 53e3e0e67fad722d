"""Pairs of layouts for "save at one layout, resume at another", and how to run them.

A pair trains the *source* layout for ``STEPS`` steps through the real Trainer with a
checkpoint at ``SAVE_STEP`` (the uninterrupted run), then resumes that checkpoint at the
*target* layout and trains to ``STEPS``. Checked (``tests/test_checkpoint_reshard.py``):
the continued losses equal the uninterrupted run's within ``RTOL`` (fp32, dropout off;
grad norms within the layout matrix's 1e-5: another layout sums in another order); every
parameter of the target equals the checkpoint's value; and the target's state written
back (``pieces_to_write``) is bit-identical to the checkpoint.

Pairs: the issue's (save at tp2-pp2-dp2-ZeRO-2, resume at tp1-pp4-dp2-ZeRO-1, tp4-pp1-dp2-
ZeRO-0 and one process, on the gpt matrix model; the reverse directions on the llama one:
GQA, untied head, vocabulary 510, padded at tp=4), plus ``GENERATED`` pairs drawn by the
layout matrix's generator (``tests/layout_matrix.py``: config schema choices, validator
filtered, reproducible by id), the target drawn with the source's model and global batch;
CI's generated pairs always include an interleaved schedule, ZB-V, explicit ``pp_layers`` and a
change of the context-parallel degree cp.

Mixtures of experts: ``moe_pair`` draws both sides with the layout matrix's MoE generator
(``_draw_moe``: the ``mixtral`` / ``deepseek`` matrix models; ep, etp, tp, cp, pp, dp, ZeRO stage
and ``parallel.expert_zero_stage``), the target with the source's model and global batch. CI runs
one pair per ``MOE_PAIR_MUST_COVER`` property, each drawn under its property and within
``moe_affordable`` (ids ``MOE_COVER_BASE + 2k``); ``--layout-matrix=all`` adds unconstrained
draws (ids ``MOE_PAIR_BASE + 2k``). The deepseek model's router carries the aux-loss-free
expert bias, a buffer: the continued curve holds only if the checkpoint restores it too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable

from tests import layout_matrix as lm
from tests import layout_run as lr

STEPS = 4
SAVE_STEP = 2
RTOL = 1e-6
GENERATED = 0  # CI: the issue's pairs plus one generated pair per PAIR_MUST_COVER property (suite < 15 min)
PAIR_BASE = 20_000  # generated pair k draws case ids PAIR_BASE + 2k (source) and + 2k + 1 (target)
MOE_GENERATED = 0  # CI: one MoE pair per MOE_PAIR_MUST_COVER property
MOE_PAIR_BASE = 40_000  # MoE pair k: ids MOE_PAIR_BASE + 2k, + 2k + 1 (>= layout_matrix.MOE_BASE: MoE draws)
MOE_COVER_BASE = 41_000  # the MoE pair covering property k: ids MOE_COVER_BASE + 2k, + 2k + 1
MOE_CI_MAX_WORLD = 4
DENSE_COVER_MAX_WORLD = 4  # CI's covering dense pairs: ranks on either side (the issue's pairs are 8 and stay)

ISSUE_LAYOUT = {"tp": 2, "pp": 2, "dp": 2, "zero_stage": 2}
ISSUE_OTHERS = ({"tp": 1, "pp": 4, "dp": 2, "zero_stage": 1}, {"tp": 4, "pp": 1, "dp": 2, "zero_stage": 0},
                {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0})
ISSUE_TRAIN = {"global_batch_size": 8, "micro_batch_size": 2}


@dataclass(frozen=True)
class Side:
    """One layout of a pair: the ``parallel`` and ``train`` sections (``job_from_dict`` input)."""

    parallel: dict[str, Any]
    train: dict[str, Any]

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.get("tp", 1) * p.get("pp", 1) * p.get("dp", 1) * p.get("cp", 1)

    def label(self) -> str:
        p = self.parallel
        cp = f"cp{p['cp']}-{p['cp_comm']}" if p.get("cp", 1) > 1 else ""
        bits = [f"tp{p.get('tp', 1)}pp{p.get('pp', 1)}dp{p.get('dp', 1)}{cp}z{p.get('zero_stage', 0)}"]
        if p.get("schedule", "1f1b") != "1f1b":
            bits.append(p["schedule"])
        if p.get("offload", "none") != "none":
            bits.append(f"off-{p['offload']}")
        if p.get("virtual_stages", 1) > 1:
            bits.append(f"v{p['virtual_stages']}")
        if p.get("pp_layers"):
            bits.append("L" + ".".join(map(str, p["pp_layers"])))
        if p.get("ep", 1) > 1:
            bits.append(f"ep{p['ep']}")
        if p.get("etp", p.get("tp", 1)) != p.get("tp", 1):
            bits.append(f"etp{p['etp']}")
        if p.get("expert_zero_stage") is not None:
            bits.append(f"ez{p['expert_zero_stage']}")
        return "-".join(bits)


@dataclass(frozen=True)
class Pair:
    model: str
    source: Side
    target: Side
    # The case whose model, data and mask both sides train (``LayoutCase.job``); None: the matrix model ``model``.
    # ``tests/odd_reshard.py`` passes a drawn shape (``shape_fuzz.ShapeCase``) here.
    case: lm.LayoutCase | None = None

    @property
    def name(self) -> str:
        return f"{self.model}-{self.source.label()}-to-{self.target.label()}"


def issue_pairs() -> list[Pair]:
    src = Side(ISSUE_LAYOUT, ISSUE_TRAIN)
    out = [Pair("gpt", src, Side(other, ISSUE_TRAIN)) for other in ISSUE_OTHERS]
    out += [Pair("llama", Side(other, ISSUE_TRAIN), src) for other in ISSUE_OTHERS]
    return out


def _side(case: lm.LayoutCase) -> Side:
    return Side(dict(case.parallel), dict(case.train))


@functools.lru_cache(maxsize=None)  # ci_pairs asks again for the pairs each property's search passed over
def generated_pair(k: int) -> Pair:
    source = lm.generate_case(PAIR_BASE + 2 * k)
    target = lm.generate_case(
        PAIR_BASE + 2 * k + 1,
        lambda c: c.model == source.model and c.train["global_batch_size"] == source.train["global_batch_size"]
        and _side(c).label() != _side(source).label(),
    )
    return Pair(source.model, _side(source), _side(target))


# What the generated pairs in CI must include (drawn further until each holds for some pair).
PAIR_MUST_COVER = {
    "interleaved (virtual stages)": lambda p: max(s.parallel["virtual_stages"] for s in (p.source, p.target)) > 1,
    "explicit pp_layers": lambda p: any(s.parallel["pp_layers"] for s in (p.source, p.target)),
    "ZeRO-3 at dp>1 on one side, another stage on the other": lambda p: any(
        a.parallel["zero_stage"] == 3 and a.parallel["dp"] > 1 and b.parallel["zero_stage"] != 3
        for a, b in ((p.source, p.target), (p.target, p.source))),
    "disk offload (save or resume)": lambda p: any(s.parallel.get("offload") == "disk" for s in (p.source, p.target)),
    "ZB-V (chunks in a V) on one side": lambda p: any(s.parallel.get("schedule") == "zbv" for s in (p.source, p.target)),
    "resume at another cp": lambda p: p.source.parallel.get("cp", 1) != p.target.parallel.get("cp", 1),
}
MAX_PAIR_DRAWS = 200


def ci_pairs(generated: int = GENERATED, moe_generated: int = MOE_GENERATED) -> list[Pair]:
    """The issue's pairs, the first ``generated`` generated ones, the first generated pair of at most
    ``DENSE_COVER_MAX_WORLD`` ranks a side with each ``PAIR_MUST_COVER`` property that those lack, and the MoE
    pairs (``moe_ci_pairs``). Why the cap: on 2 cores an 8-rank side costs a minute; every property has a
    4-rank pair, and the issue's pairs keep 8 ranks in CI."""
    drawn = [generated_pair(k) for k in range(generated)]
    for label, holds in PAIR_MUST_COVER.items():
        k = generated
        while not any(holds(p) for p in drawn):
            if k >= MAX_PAIR_DRAWS:
                raise RuntimeError(f"no generated pair with {label} in {MAX_PAIR_DRAWS} draws")
            pair = generated_pair(k)
            if holds(pair) and max(pair.source.world_size, pair.target.world_size) <= DENSE_COVER_MAX_WORLD:
                drawn.append(pair)
            k += 1
    return issue_pairs() + drawn + moe_ci_pairs(moe_generated)


def moe_pair(k: int, base: int = MOE_PAIR_BASE, where: Callable[[Pair], bool] = lambda p: True,
             model: str | None = None, fits: Callable[[lm.LayoutCase], bool] = lambda c: True) -> Pair:
    """MoE pair ``k`` from ids ``base + 2k`` (source, of ``model`` if given) and ``base + 2k + 1`` (the
    target: same model and global batch, another layout, and the pair meets ``where``); both ``fits``."""
    source = lm.generate_case(base + 2 * k, lambda c: (model is None or c.model == model) and fits(c))

    def target_ok(c: lm.LayoutCase) -> bool:
        return (c.model == source.model and c.train["global_batch_size"] == source.train["global_batch_size"]
                and _side(c).label() != _side(source).label() and fits(c)
                and where(Pair(source.model, _side(source), _side(c))))

    target = lm.generate_case(base + 2 * k + 1, target_ok)
    return Pair(source.model, _side(source), _side(target))


def _etp(side: Side) -> int:
    return side.parallel.get("etp", side.parallel.get("tp", 1))


# What CI's MoE pairs must include, one pair per property unless an earlier one has it:
# (the model the pair trains, the property). Together: both MoE models, experts re-split
# over another expert tensor-parallel degree, and experts moved to other ep ranks.
MOE_PAIR_MUST_COVER: dict[str, tuple[str, Callable[[Pair], bool]]] = {
    "mixtral, etp != tp on save or resume": ("mixtral", lambda p: any(
        _etp(s) != s.parallel.get("tp", 1) for s in (p.source, p.target))),
    "deepseek (expert bias buffer), resume at another ep": ("deepseek", lambda p: p.source.parallel.get("ep", 1)
                                                            != p.target.parallel.get("ep", 1)),
}


def moe_affordable(case: lm.LayoutCase) -> bool:
    """CI's MoE pairs stay small on 2 cores: at most ``MOE_CI_MAX_WORLD`` ranks, the layout matrix's
    microbatch budget, no disk offload (slow in small chunks; the dense pairs cover it)."""
    return case.world_size <= MOE_CI_MAX_WORLD and lm.affordable_for_ci(case, "")


def moe_ci_pairs(generated: int = MOE_GENERATED) -> list[Pair]:
    """One pair drawn under each ``MOE_PAIR_MUST_COVER`` property not met yet, then ``generated``
    unconstrained MoE pairs."""
    out: list[Pair] = []
    for k, (model, holds) in enumerate(MOE_PAIR_MUST_COVER.values()):
        if not any(p.model == model and holds(p) for p in out):
            out.append(moe_pair(k, MOE_COVER_BASE, holds, model, moe_affordable))
    return out + [moe_pair(k) for k in range(generated)]


def job_values(pair: Pair, side: Side, out_dir: str, cache_dir: str, **train: Any) -> dict[str, Any]:
    if pair.case is None:
        values = lm.job_values(pair.model, side.parallel, side.train, out_dir, cache_dir)
    else:
        values = pair.case.job(side.parallel, side.train, out_dir, cache_dir)
    values["model"]["dropout"] = 0.0
    values["train"].update(steps=STEPS, save_every=SAVE_STEP, keep_last=STEPS, **train)
    return values


def single_process_values(pair: Pair, out_dir: str, cache_dir: str) -> dict[str, Any]:
    """The uninterrupted single-process job of a pair with a ``case`` (``layout_matrix.reference_values``),
    dropout off and ``STEPS`` steps as both sides train."""
    assert pair.case is not None
    values = lm.reference_values(pair.case, out_dir, cache_dir)
    values["model"]["dropout"] = 0.0
    values["train"]["steps"] = STEPS
    return values


def checkpoint_of(out_dir: str, step: int) -> str:
    from parallel3d.checkpoint import step_dir

    return step_dir(os.path.join(out_dir, "checkpoints"), step)


# ---- rank functions (run_on_ranks targets; world size 1 runs them in the test process) ----


def params_differing_from(trainer: Any, state_dir: str) -> list[str]:
    """Names of this rank's parameters that are not exactly the checkpoint's weights (a parameter
    holds its box of the global tensor, ``pieces.held_box``: tp chunks, etp chunks for routed
    experts, zero vocabulary padding), and of buffers that are not the checkpoint's."""
    import torch

    from parallel3d.checkpoint_io.pieces import BUFFER_PREFIX, held_box
    from parallel3d.checkpoint_io.state import read_metadata, read_tensors

    params = {p.global_name: p for c in trainer.chunks for p in c.parameters()}
    full = read_tensors(state_dir, [f"model.{n}" for n in params])
    differing = []
    with trainer.optimizer.gathered_params():  # ZeRO-3 holds shards only: gather to compare (dp-collective)
        for n, p in params.items():
            want = torch.zeros_like(p)
            box = held_box(p, trainer.pstate)
            if box is not None:
                want[tuple(slice(0, s) for s in box.sizes)] = \
                    full[f"model.{n}"][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            if not torch.equal(p.detach(), want):
                differing.append(n)
    # Buffers (the router's expert bias): a chunk's module paths are global names (independent of
    # how pieces name them), so each must be stored under its path and equal the stored value.
    held = {f"{BUFFER_PREFIX}{n}": b for c in trainer.chunks for n, b in c.named_buffers()}
    stored = set(read_metadata(state_dir).state_dict_metadata)
    differing += [k for k in held if k not in stored]
    saved = read_tensors(state_dir, [k for k in held if k in stored]) if held else {}
    differing += [k for k, v in saved.items() if not torch.equal(v.to(held[k].dtype), held[k])]
    return differing


def resume_on_rank(rank: int, world: int, values: dict, checkpoint: str, copy_dir: str) -> tuple[list, list[str]]:
    """Load ``checkpoint`` at this layout, write the state back to ``copy_dir``, then train on."""
    from parallel3d.checkpoint_io.compat import STATE_DIR
    from parallel3d.checkpoint_io.pieces import pieces_to_write
    from parallel3d.checkpoint_io.state import write_state
    from parallel3d.config import job_from_dict, resolve
    from parallel3d.parallel_state import ParallelState
    from parallel3d.trainer import Trainer

    rj = resolve(job_from_dict(values), world)
    with lr.silenced(True):
        trainer = Trainer(rj, ParallelState(rj.topology))
        trainer.load_checkpoint(checkpoint)
        differing = params_differing_from(trainer, os.path.join(checkpoint, STATE_DIR))
        write_state(copy_dir, pieces_to_write(trainer.optimizer, trainer.pstate), {}, trainer.checkpoints.group)
        result = trainer.train()  # train.resume = checkpoint: loads it again, then steps SAVE_STEP+1..STEPS
    return lr.curve_of(result.records), differing


def run(fn, world: int, *args: Any, timeout: float = 300.0) -> list:
    """``fn`` on ``world`` gloo ranks, or in this process (no process group) when world is 1."""
    if world == 1:
        return [fn(0, 1, *args)]
    from tests.harness import run_on_ranks

    return run_on_ranks(fn, world, *args, timeout=timeout)
