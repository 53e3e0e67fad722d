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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tests import layout_matrix as lm

STEPS = 4
SAVE_STEP = 2
RTOL = 1e-6
GENERATED = 0  # CI: the issue's pairs plus one generated pair per PAIR_MUST_COVER property (suite < 15 min)
PAIR_BASE = 20_000  # generated pair k draws case ids PAIR_BASE + 2k (source) and + 2k + 1 (target)

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
        return "-".join(bits)


@dataclass(frozen=True)
class Pair:
    model: str
    source: Side
    target: Side

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
MAX_PAIR_DRAWS = 50


def ci_pairs(generated: int = GENERATED) -> list[Pair]:
    """The issue's pairs, the first ``generated`` generated ones, and the first generated pair
    with each ``PAIR_MUST_COVER`` property that those lack."""
    drawn = [generated_pair(k) for k in range(generated)]
    for label, holds in PAIR_MUST_COVER.items():
        k = generated
        while not any(holds(p) for p in drawn):
            if k >= MAX_PAIR_DRAWS:
                raise RuntimeError(f"no generated pair with {label} in {MAX_PAIR_DRAWS} draws")
            pair = generated_pair(k)
            if holds(pair):
                drawn.append(pair)
            k += 1
    return issue_pairs() + drawn


def job_values(pair: Pair, side: Side, out_dir: str, cache_dir: str, **train: Any) -> dict[str, Any]:
    values = lm.job_values(pair.model, side.parallel, side.train, out_dir, cache_dir)
    values["model"]["dropout"] = 0.0
    values["train"].update(steps=STEPS, save_every=SAVE_STEP, keep_last=STEPS, **train)
    return values


def checkpoint_of(out_dir: str, step: int) -> str:
    from parallel3d.checkpoint import step_dir

    return step_dir(os.path.join(out_dir, "checkpoints"), step)


# ---- rank functions (run_on_ranks targets; world size 1 runs them in the test process) ----


def params_differing_from(trainer: Any, state_dir: str) -> list[str]:
    """Names of this rank's parameters that are not exactly the checkpoint's weights."""
    from parallel3d.checkpoint_io.state import read_tensors
    from parallel3d.tensor_parallel.sharding import shard_of

    params = {p.global_name: p for c in trainer.chunks for p in c.parameters()}
    full = read_tensors(state_dir, [f"model.{n}" for n in params])
    with trainer.optimizer.gathered_params():  # ZeRO-3 holds shards only: gather to compare (dp-collective)
        return [n for n, p in params.items()
                if not bool((p.detach() == shard_of(full[f"model.{n}"], p, trainer.pstate).to(p.dtype)).all())]


def resume_on_rank(rank: int, world: int, values: dict, checkpoint: str, copy_dir: str) -> tuple[list, list[str]]:
    """Load ``checkpoint`` at this layout, write the state back to ``copy_dir``, then train on."""
    from parallel3d.checkpoint_io.compat import STATE_DIR
    from parallel3d.checkpoint_io.pieces import pieces_to_write
    from parallel3d.checkpoint_io.state import write_state
    from parallel3d.config import job_from_dict, resolve
    from parallel3d.parallel_state import ParallelState
    from parallel3d.trainer import Trainer

    rj = resolve(job_from_dict(values), world)
    with lm._silenced(True):
        trainer = Trainer(rj, ParallelState(rj.topology))
        trainer.load_checkpoint(checkpoint)
        differing = params_differing_from(trainer, os.path.join(checkpoint, STATE_DIR))
        write_state(copy_dir, pieces_to_write(trainer.optimizer, trainer.pstate), {}, trainer.checkpoints.group)
        result = trainer.train()  # train.resume = checkpoint: loads it again, then steps SAVE_STEP+1..STEPS
    return lm.curve_of(result.records), differing


def run(fn, world: int, *args: Any, timeout: float = 300.0) -> list:
    """``fn`` on ``world`` gloo ranks, or in this process (no process group) when world is 1."""
    if world == 1:
        return [fn(0, 1, *args)]
    from tests.harness import run_on_ranks

    return run_on_ranks(fn, world, *args, timeout=timeout)
