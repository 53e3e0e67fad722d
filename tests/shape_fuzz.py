"""Odd layouts on odd model shapes: the layout matrix's promise beyond its fixed models and even degrees.

``tests/layout_matrix.py`` draws layouts over tp, pp, dp in {1, 2, 4} (pp 3 too) for a few fixed
models (hidden 64, 4 or 8 heads, 8 layers, seq 32). This module draws the model shape too, with degrees
of 3 and 5: tp, pp, dp, cp in ``DEGREES`` (world <= ``MAX_WORLD``), ep = 3 over 6 experts, hidden sizes
48 / 96 / 120 (and 80, which no head count here divides: valid only with ``kv_channels``), heads 3 / 6 / 12
with kv heads dividing them, head widths that are not a power of two, FFN widths that are not a multiple
of 64, 3 / 5 / 7 layers (uneven over pp), vocabularies no tp divides, sequence lengths that are not
powers of two, micro-batches > 1 with accumulation.

``generate(case_id)`` is the first draw of the RNG seeded by ``FUZZ_SEED`` and the id alone that the
config validator accepts (validity is the validator's business, not a list of rules here); the draws it
rejects on the way come back with the validator's message (``Draw``). A rejection that is not a
``ConfigError`` is a crash of the validator itself (``Draw.crashed``): ``tests/test_shape_fuzz.py`` fails on one.

A case is a ``ShapeCase``: a ``layout_matrix.LayoutCase`` carrying its own model section and sequence
length, so ``layout_run.run_case`` trains and compares it like any layout-matrix case.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from parallel3d import config as cfg
from parallel3d.config import ConfigError, job_from_dict, resolve
from parallel3d.context_parallel import CP_COMM_VARIANTS
from tests import layout_matrix as lm
from tests.layer_splits import composition

FUZZ_SEED = 20261206
MIN_WORLD, MAX_WORLD = 3, 6  # world sizes 3 to 6: the odd ones and 6 = 2 * 3, on a 2-core machine
DEGREES = {"tp": (1, 2, 3), "pp": (1, 2, 3, 5), "dp": (1, 2, 3, 5), "cp": (1, 3)}
EP_DEGREES, NUM_EXPERTS = (1, 2, 3), 6
HIDDEN = (48, 96, 120, 80)
HEADS = (3, 6, 12)
HEAD_WIDTHS = {"gpt": (None, None, 5, 9, 10), "llama": (None, None, 6, 10, 14)}  # kv_channels: rotary needs even
FFN = (None, 72, 90, 150, 198, 132)  # None: 4 * hidden (gpt) or the llama default below
EXPERT_FFN = (30, 42, 54)
ODD_EXPERT_FFN = (35, 45, 40)  # 35, 45: only etp = 1 (or 5) splits them; 40: not 3
LAYERS = (3, 5, 7)
VOCABS = (259, 301, 385, 511)  # 7 * 37, 7 * 43, 5 * 7 * 11, 7 * 73: no tp here divides them
SEQS = (18, 24, 30, 36, 42)
GLOBAL_BATCHES, MICRO_BATCHES = (6, 12, 18, 30), (1, 2, 3)
ALL_CASES = 30
MAX_DRAWS = 2000


@dataclass(frozen=True)
class ShapeCase(lm.LayoutCase):
    """A layout-matrix case whose model (``shape``: the model section) and sequence length were drawn."""

    shape: dict[str, Any] = field(default_factory=dict)
    seq: int = lm.SEQ_LEN

    @property
    def seq_len(self) -> int:
        return self.seq

    def model_values(self) -> dict[str, Any]:
        return self.shape


@dataclass(frozen=True)
class Draw:
    """One draw and what the validator said of it (``error`` None: accepted)."""

    case: ShapeCase
    error: str | None = None
    crashed: bool = False  # not a ConfigError: the validator itself broke


def _shape_name(s: dict[str, Any], seq: int) -> str:
    kv = f"k{s['num_kv_heads']}" if s["num_kv_heads"] else ""
    width = f"d{s['kv_channels']}" if s["kv_channels"] else ""
    moe = f"-e{s['moe']['num_experts']}f{s['moe']['ffn_hidden_size']}" if s.get("moe") else ""
    if s.get("moe", {}).get("num_shared_experts"):
        moe += f"sh{s['moe']['shared_ffn_hidden_size']}"
    return (f"{s['arch']}-h{s['hidden_size']}a{s['num_heads']}{kv}{width}-f{s['ffn_hidden_size']}"
            f"-L{s['num_layers']}-V{s['vocab_size']}-s{seq}{moe}")


def _draw_shape(rng: random.Random, moe: bool) -> tuple[dict[str, Any], int]:
    arch = "llama" if moe else rng.choice(("gpt", "llama"))
    heads = rng.choice(HEADS)
    kv = rng.choice([k for k in range(1, heads + 1) if heads % k == 0]) if arch == "llama" else None
    seq = rng.choice(SEQS)
    shape = dict(name="fuzz", arch=arch, num_layers=rng.choice(LAYERS), hidden_size=rng.choice(HIDDEN),
                 num_heads=heads, num_kv_heads=kv, kv_channels=rng.choice(HEAD_WIDTHS[arch]),
                 ffn_hidden_size=rng.choice(FFN), vocab_size=rng.choice(VOCABS), max_seq_len=seq,
                 tie_embeddings=arch == "gpt", use_bias=arch == "gpt", dropout=0.1)
    if moe:
        shape["moe"] = dict(num_experts=NUM_EXPERTS, top_k=2, ffn_hidden_size=rng.choice(EXPERT_FFN),
                            aux_loss_coeff=0.01, aux_loss_scope="sequence", z_loss_coeff=0.001)
        # Odd expert widths and a shared expert, from a salted fork of the RNG: the draws after keep their values.
        fork = random.Random(repr(rng.getstate()) + "moe")
        if fork.random() < 0.4:
            shape["moe"]["ffn_hidden_size"] = fork.choice(ODD_EXPERT_FFN)
        if fork.random() < 0.4:
            shape["moe"].update(num_shared_experts=1, shared_ffn_hidden_size=fork.choice(ODD_EXPERT_FFN))
    shape["name"] = _shape_name(shape, seq)
    return shape, seq


def draw(rng: random.Random, case_id: int) -> ShapeCase:
    """The next shape and layout from ``rng``, not judged yet (``tests/odd_reshard.py`` draws its layouts here)."""
    moe = rng.random() < 0.3
    shape, seq = _draw_shape(rng, moe)
    tp, pp, dp, cp = (rng.choice(DEGREES[d]) for d in ("tp", "pp", "dp", "cp"))
    schedule = rng.choice(cfg.SCHEDULES)
    v = rng.choice((2, 3)) if schedule == "interleaved_1f1b" else 2 if schedule == "zbv" else 1
    layers = shape["num_layers"]
    pp_layers = None
    if pp > 1 and pp * v <= layers + 2 and rng.random() < 0.5:  # uneven, sometimes with empty end chunks
        counts = composition(rng, layers + 2, pp * v)
        pp_layers = [counts[0] - 1, *counts[1:-1], counts[-1] - 1]  # the ends may be 0
    stage = rng.choice(cfg.ZERO_STAGES)
    dims = ["tp", "cp", "dp", "pp"] if not moe else ["tp", "cp", "ep", "dp", "pp"]
    rng.shuffle(dims)
    cp_comm = rng.choice(CP_COMM_VARIANTS) if cp > 1 else "p2p"
    parallel = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "zero_stage": stage, "schedule": schedule,
                "virtual_stages": v, "sequence_parallel": tp > 1 and rng.random() < 0.5, "order": "-".join(dims),
                "pp_layers": pp_layers, "bucket_size_mb": rng.choice((0.01, 25.0)),
                "offload": rng.choice(("none", "none", "none", "cpu")),  # disk: slow in small chunks, the matrix has it
                "zero3_reshard": rng.choice(cfg.ZERO3_RESHARD) if stage == 3 else "auto",
                "zero3_prefetch": rng.choice((0, 1, 2)) if stage == 3 else 1,
                "cp_comm": cp_comm, "cp_a2a_size": rng.choice((1, 3)) if cp_comm == "a2a+p2p" else None}
    if moe:
        parallel["ep"] = rng.choice(EP_DEGREES)
    train = {"global_batch_size": rng.choice(GLOBAL_BATCHES), "micro_batch_size": rng.choice(MICRO_BATCHES),
             "recompute": rng.choice(cfg.RECOMPUTE)}
    return ShapeCase(case_id, shape["name"], parallel, train, emulate_nccl=pp > 1 and rng.random() < 0.3,
                     document_mask=rng.random() < 0.3, shape=shape, seq=seq)


def judge(case: ShapeCase) -> Draw:
    """What the config validator says of ``case``: accepted, a ConfigError's message, or a crash."""
    try:
        resolve(job_from_dict(case.values("unused-out-dir", "unused-cache")), case.world_size)
    except ConfigError as exc:
        return Draw(case, str(exc))
    except Exception as exc:  # noqa: BLE001 - a traceback where a clear message was due: recorded, reported
        return Draw(case, f"{type(exc).__name__}: {exc}", crashed=True)
    return Draw(case)


@functools.lru_cache(maxsize=None)  # judging a draw (OmegaConf, the validator) costs ~0.1-0.5 s
def draws(case_id: int) -> tuple[Draw, ...]:
    """The draws of ``case_id`` within the world budget up to the first the validator accepts (the last)."""
    rng = random.Random(f"{FUZZ_SEED}:{case_id}")
    out = []
    for _ in range(MAX_DRAWS):
        case = draw(rng, case_id)
        if MIN_WORLD <= case.world_size <= MAX_WORLD:
            out.append(judge(case))
            if out[-1].error is None:
                return tuple(out)
    raise RuntimeError(f"shape-fuzz case {case_id}: no valid draw in {MAX_DRAWS}")


def generate(case_id: int) -> ShapeCase:
    return draws(case_id)[-1].case


def uneven(c: ShapeCase) -> bool:
    """Stages hold different layer counts (drawn, or the default split of a count pp does not divide)."""
    p = c.parallel
    return p["pp_layers"] is not None and len(set(p["pp_layers"])) > 1 or c.shape["num_layers"] % p["pp"] != 0


# What CI must always run (each property's case: the cheapest of CI_CANDIDATES valid draws meeting it).
CI_MUST_COVER: dict[str, Callable[[ShapeCase], bool]] = {
    "tp3": lambda c: c.parallel["tp"] == 3,
    "pp3_uneven": lambda c: c.parallel["pp"] == 3 and uneven(c),
    "dp3_zero2": lambda c: c.parallel["dp"] == 3 and c.parallel["zero_stage"] == 2,
    "cp3_or_ep3": lambda c: c.parallel["cp"] == 3 or c.parallel.get("ep", 1) == 3,
}
# The whole fuzz adds one case per property here (chance alone rarely draws a world of 5).
EXTENDED_COVER: dict[str, Callable[[ShapeCase], bool]] = {
    "dp5": lambda c: c.parallel["dp"] == 5,
    "pp5": lambda c: c.parallel["pp"] == 5,
}
PROPERTIES = {**CI_MUST_COVER, **EXTENDED_COVER}
COVER_BASE, EXTENDED_BASE, CI_CANDIDATES = 10_000, 20_000, 6  # ids: base + the property's index


def _label(case_id: int) -> str | None:
    """The property a coverage id is drawn under (None: a plain id)."""
    for base, cover in ((COVER_BASE, CI_MUST_COVER), (EXTENDED_BASE, EXTENDED_COVER)):
        if 0 <= case_id - base < len(cover):
            return list(cover)[case_id - base]
    return None


def _cover(case_id: int, uncovered: list[str]) -> ShapeCase:
    """Coverage id ``case_id``'s case: of the first ``CI_CANDIDATES`` valid draws meeting its property, the
    least ``layout_matrix.ci_cost`` per property in ``uncovered`` it meets (greedy set cover), then the first."""
    label = _label(case_id)
    rng = random.Random(f"{FUZZ_SEED}:{case_id}")
    ranked = []
    for i in range(MAX_DRAWS):
        case = draw(rng, case_id)
        if MIN_WORLD <= case.world_size <= MAX_WORLD and PROPERTIES[label](case) \
                and lm.affordable_for_ci(case, label) and judge(case).error is None:
            ranked.append((lm.ci_cost(case) / sum(PROPERTIES[u](case) for u in uncovered), i, case))
            if len(ranked) == CI_CANDIDATES:
                break
    if not ranked:
        raise RuntimeError(f"shape-fuzz case {case_id}: no valid draw for {label} in {MAX_DRAWS}")
    return min(ranked, key=lambda r: r[:2])[2]


@functools.lru_cache(maxsize=1)
def ci_sample() -> tuple[ShapeCase, ...]:
    """A greedy cover of ``CI_MUST_COVER``, ordered by world size."""
    labels, cases = list(CI_MUST_COVER), []
    uncovered = list(labels)
    while uncovered:
        case = _cover(COVER_BASE + labels.index(uncovered[0]), uncovered)
        cases.append(case)
        uncovered = [label for label in uncovered if not CI_MUST_COVER[label](case)]
    return tuple(sorted(cases, key=lambda c: (c.world_size, c.case_id)))


def case_by_id(case_id: int) -> ShapeCase:
    for case in ci_sample():
        if case.case_id == case_id:
            return case
    label = _label(case_id)
    return generate(case_id) if label is None else _cover(case_id, [label])


def all_cases() -> list[ShapeCase]:
    """``0 .. ALL_CASES - 1``, one case per ``EXTENDED_COVER`` property, and the CI sample."""
    extended = [_cover(EXTENDED_BASE + k, [label]) for k, label in enumerate(EXTENDED_COVER)]
    cases = {c.case_id: c for c in [*(generate(i) for i in range(ALL_CASES)), *extended, *ci_sample()]}
    return [cases[i] for i in sorted(cases)]


def rejections(case_ids: range = range(ALL_CASES)) -> list[Draw]:
    """Every draw the validator refused on the way to the cases of ``case_ids``."""
    return [d for i in case_ids for d in draws(i)[:-1]]
