"""The generated layout-equivalence matrix: any layout trains the same model as one process.

``generate_case(case_id)`` draws one layout from a seeded RNG keyed by the id alone, so
a failing case is reproduced by its id (``scripts/check_layouts.py --case ID`` or
``pytest tests/test_layout_matrix.py -k case17``). The dimensions come from the
config schema's own choices (``config.SCHEDULES``, ``ZERO_STAGES``, ``RECOMPUTE``,
the rank-order permutations, ...), so a new schedule or stage is drawn without editing
this file. A draw is kept only if ``config.resolve`` accepts it: validity is the
validator's business, not a second list of rules here. The one rule of our own is a
budget: at most ``MAX_WORLD`` ranks (this machine has 2 cores).

Each case trains ``STEPS`` optimizer steps through the real ``Trainer`` (fp32, dropout on;
masks are layout-independent; some pipelined cases with NCCL's p2p semantics emulated on gloo) and its per-step loss and grad norm must match the
single-process run of the same model, data and global batch within ``RTOL``; so must the
validation loss (``EVAL_EVERY``/``EVAL_ITERS``: forward only through the same pipeline
layout, dropout off, on a held-out ``VALID_FRACTION`` of the corpus).

- ``ci_sample()``: what CI runs: the first ``CI_HEAD`` ids plus a greedy cover of the
  properties in ``CI_MUST_COVER`` (``tests/layout_coverage.py``) (each added case is drawn under the first property not met
  yet, id ``COVER_BASE + k``, and is the cheapest per property it adds): pp=3 and pp=4 with
  dp > 1 and ZeRO-2, 1F1B at pp >= 3 with dp > 1, an interleaved schedule with pp >= 3, NCCL
  semantics at pp >= 3, tp=4 with sequence parallel, an uneven split at pp >= 3, the
  zero-bubble schedule at pp >= 3 with dp > 1 and at pp >= 2 with tp > 1, an empty first and last chunk, ZeRO-3 with pp > 1
  and dp > 1, ZB-V at pp >= 2 with the tied gpt and ZeRO >= 1, disk offload with dp > 1, ZeRO-0 with dp > 1, GPipe, Llama at pp >= 3,
  context parallel with pp >= 3, with tp + sequence parallel, with ZeRO-3, a2a+p2p, and with document masks
  (coverage draws within ``affordable_for_ci``).
- Context parallel: cp from ``DEGREES["cp"]``, every ``parallel.cp_comm`` (and an a2a size dividing cp),
  and ``data.document_mask`` on or off (the reference masks documents too).
- Pipelines (``_draw_pipe``, ids ``PIPE_BASE + k`` and the ``pipe_`` properties): 1F1B and interleaved 1F1B on
  3 or 4 uneven stages with ``parallel.split_drain`` drawn (the dense draw leaves it at ``auto``).
- ``all_cases()``: the whole matrix, ids ``0 .. ALL_CASES - 1``, the MoE and pipeline draws, plus the CI sample.
- ``LayoutCase.job`` builds a case's job and its reference's from ``model_values()`` and ``seq_len``:
  ``tests/shape_fuzz.py`` overrides those two with drawn model shapes (odd degrees and sizes).
"""

from __future__ import annotations

import functools
import itertools
import os
import random
from dataclasses import dataclass
from typing import Any, Callable

from models.moe_config import MoEConfig
from parallel3d import config as cfg
from parallel3d.config import ConfigError, job_from_dict, resolve
from parallel3d.context_parallel import CP_COMM_VARIANTS
from parallel3d.moe.options import DISPATCHERS, DROP_POLICIES
from parallel3d.pipeline.options import AUTO, SPLIT_DRAIN_SCHEDULES, SPLIT_DRAIN_VALUES
from tests.layer_splits import composition, empty_ends
from tests.matrix_models import MODELS, MOE_MODELS, SEQ_LEN  # the drawn models (dense, MoE)
from tests.layout_coverage import CI_MUST_COVER, COVER_BASE  # the sample's properties and their ids

MATRIX_SEED = 20261203
MAX_WORLD = 8
STEPS = 4
RTOL = 1e-5
# Adam's first steps turn rounding noise in near-zero gradients into whole-lr updates: at lr 3e-3
# one process with 8 vs 24 samples per microbatch (same math, other summation order) already
# differed by 3.6e-5 in the step-3 grad norm (llama). At 1e-3 that noise floor is ~2e-7, so a
# miss of RTOL means the layout, not the reference; test_layout_matrix checks the floor stays low.
LR = 1e-3
EVAL_EVERY, EVAL_ITERS, VALID_FRACTION = 2, 1, 0.1  # evaluations after steps 2 and 4 (the end)
ALL_CASES = 64
CI_HEAD = 1
DEGREES = {"tp": (1, 2, 4), "pp": (1, 2, 3, 4), "dp": (1, 2, 4), "cp": (1, 2, 4)}  # the dimensions the config runs today
GLOBAL_BATCHES = (8, 12, 24)
MICRO_BATCHES = (1, 2, 4)
MAX_DRAWS = 1000

MOE_BASE, MOE_CASES = 30_000, 16  # ids of the MoE draws in the whole matrix (above the reshard pairs' 20_000)
# Pipeline draws (``_draw_pipe``: ids ``PIPE_BASE`` up to ``MOE_BASE`` and the ``pipe_`` coverage properties): the
# schedules ``parallel.split_drain`` applies to on 3 or 4 stages, the option drawn from its values, always an uneven
# split (interleaved 1F1B at pp=3 needs one: 8 layers over 6 chunks; the dense draw rarely gives it one). Every id
# from MOE_BASE on stays an MoE draw (tests/reshard_matrix.py and tests/train_fuzz.py draw MoE layouts there).
PIPE_BASE, PIPE_CASES = 25_000, 16  # above the reshard pairs' 20_000 + 2k
EP_DEGREES = (1, 2, 4)
CAPACITY_FACTORS = (0.5, 1.0)  # 0.5: certain drops; 1.0: some


@dataclass(frozen=True)
class LayoutCase:
    """One drawn layout: ``values`` are the job's config sections (``job_from_dict`` input)."""

    case_id: int
    model: str
    parallel: dict[str, Any]
    train: dict[str, Any]
    emulate_nccl: bool = False  # ParallelState(emulate_nccl=True): NCCL's one-Work-per-batch p2p on gloo
    document_mask: bool = False  # data.document_mask (the reference run masks too)
    # MoE capacity (factor, drop policy) or None (dropless). Drops are defined per micro-batch, so the
    # reference then runs the same micro-batches (micro_batch_size), not one.
    capacity: tuple[float, str] | None = None
    # model.moe.dispatcher of the layout's job (None: the model's own). The reference keeps the model's:
    # how tokens reach their experts must not change the model.
    dispatcher: str | None = None

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p["tp"] * p["pp"] * p["dp"] * p.get("cp", 1)

    @property
    def name(self) -> str:
        p, t = self.parallel, self.train
        zero = f"z{p['zero_stage']}"
        if p.get("expert_zero_stage") is not None:
            zero += f"e{p['expert_zero_stage']}"
        if 3 in (p["zero_stage"], p.get("expert_zero_stage")):
            zero += f"-{p['zero3_reshard']}-pf{p['zero3_prefetch']}"
        if p["offload"] != "none":
            zero += f"-off-{p['offload']}"
        cp = f"cp{p['cp']}-{p['cp_comm']}{p.get('cp_a2a_size') or ''}" if p.get("cp", 1) > 1 else ""
        bits = [f"case{self.case_id}", self.model, f"tp{p['tp']}pp{p['pp']}dp{p['dp']}{cp}", zero,
                p["schedule"] + (f"v{p['virtual_stages']}" if p["virtual_stages"] > 1 else ""),
                f"mb{t['micro_batch_size']}x{t['global_batch_size'] // (t['micro_batch_size'] * p['dp'])}"]
        if p["sequence_parallel"]:
            bits.append("sp")
        if t["recompute"] != "none":
            bits.append(f"rc-{t['recompute']}")
        if p["pp_layers"] is not None:
            bits.append("L" + ".".join(map(str, p["pp_layers"])))
        if p.get("split_drain", AUTO) != AUTO:
            bits.append(f"drain-{'split' if p['split_drain'] else 'plain'}")
        if p["order"] not in ("tp-dp-pp", "tp-ep-dp-pp"):  # the same layout as the default order tp-cp-ep-dp-pp (cp = ep = 1)
            bits.append(p["order"])
        if self.emulate_nccl:
            bits.append("nccl")
        if self.document_mask:
            bits.append("docmask")
        if p.get("ep", 1) > 1:
            bits.append(f"ep{p['ep']}")
        if p.get("etp", p["tp"]) != p["tp"]:
            bits.append(f"etp{p['etp']}")
        if self.capacity is not None:
            bits.append(f"cap{self.capacity[0]}-{self.capacity[1]}")
        if self.dispatcher not in (None, MoEConfig.dispatcher):  # named only where it is not the default
            bits.append(self.dispatcher)
        return "-".join(bits)

    @property
    def seq_len(self) -> int:
        return SEQ_LEN

    def model_values(self) -> dict[str, Any]:
        """The ``model`` section (``tests/shape_fuzz.py`` draws its own instead of naming one of these)."""
        return {**MODELS, **MOE_MODELS}[self.model]

    def job(self, parallel: dict, train: dict, out_dir: str, cache_dir: str) -> dict[str, Any]:
        """The job of this case's model, data and mask with ``parallel`` and ``train`` (the reference's too)."""
        return model_job_values(self.model_values(), parallel, train, out_dir, cache_dir, self.document_mask,
                                self.capacity, self.seq_len)

    def values(self, out_dir: str, cache_dir: str) -> dict[str, Any]:
        values = self.job(self.parallel, self.train, out_dir, cache_dir)
        if self.dispatcher is not None:
            values["model"] = dict(values["model"], moe=dict(values["model"]["moe"], dispatcher=self.dispatcher))
        return values

    def reference_micro_batch_size(self) -> int:
        """The reference's micro-batch: the whole global batch, or with capacity the case's own (drops are
        defined per micro-batch; ``tests/train_fuzz.py``: fp16 overflows too)."""
        return self.train["global_batch_size"] if self.capacity is None else self.train["micro_batch_size"]

    def reference_key(self) -> tuple:
        """Cases with the same key share one single-process reference run (model, global batch, document
        mask, then with capacity: factor, policy and the micro-batch size the drops are defined over)."""
        key = (self.model, self.train["global_batch_size"], self.document_mask)
        return key if self.capacity is None else (*key, *self.capacity, self.train["micro_batch_size"])


def job_values(model: str, parallel: dict, train: dict, out_dir: str, cache_dir: str,
               document_mask: bool = False, capacity: tuple[float, str] | None = None) -> dict[str, Any]:
    return model_job_values({**MODELS, **MOE_MODELS}[model], parallel, train, out_dir, cache_dir, document_mask,
                            capacity)


def model_job_values(model_values: dict, parallel: dict, train: dict, out_dir: str, cache_dir: str,
                     document_mask: bool = False, capacity: tuple[float, str] | None = None,
                     seq_len: int = SEQ_LEN) -> dict[str, Any]:
    parallel, model_values = dict(parallel), dict(model_values)
    if capacity is not None:
        model_values["moe"] = dict(model_values["moe"], capacity_factor=capacity[0], drop_policy=capacity[1])
    if parallel.get("offload") == "disk":  # the state files go with the run; small chunks: several per piece
        parallel.update(offload_dir=os.path.join(out_dir, "offload"), offload_buffer_mb=0.05)
    return {
        "model": model_values,
        "parallel": parallel,
        "train": {"steps": STEPS, "seq_len": seq_len, "seed": 11, "out_dir": out_dir, "save_every": 0,
                  "device": "cpu", "resume": "none", "precision": "fp32", "eval_every": EVAL_EVERY,
                  "eval_iters": EVAL_ITERS, **train},
        "optimizer": {"lr": LR, "min_lr": LR / 10, "warmup_steps": 1},
        "data": {"cache_dir": cache_dir, "valid_fraction": VALID_FRACTION, "document_mask": document_mask},
        "logging": {"log_every": 1},
    }


def reference_values(case: LayoutCase, out_dir: str, cache_dir: str) -> dict[str, Any]:
    """The single-process job of ``case``: same model, data, global batch; one microbatch (with capacity:
    the case's microbatches, over which drops are defined)."""
    g = case.train["global_batch_size"]
    return case.job({}, {"global_batch_size": g, "micro_batch_size": case.reference_micro_batch_size()}, out_dir,
                    cache_dir)


def _orders() -> list[str]:
    return ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))]


def _draw(rng: random.Random, case_id: int) -> LayoutCase:
    tp, pp, dp = (rng.choice(DEGREES[d]) for d in ("tp", "pp", "dp"))
    schedule = rng.choice(cfg.SCHEDULES)
    v = rng.choice((2, 3, 4)) if schedule == "interleaved_1f1b" else 2 if schedule == "zbv" else 1
    layers = MODELS["gpt"]["num_layers"]
    pp_layers = composition(rng, layers, pp * v) if pp > 1 and pp * v <= layers and rng.random() < 0.4 else None
    if pp_layers is not None:  # empty end chunks, from a fork of the RNG: the draws after keep their values
        pp_layers = empty_ends(random.Random(repr(rng.getstate())), pp_layers)
    g = rng.choice(GLOBAL_BATCHES)
    mbs = rng.choice(MICRO_BATCHES)
    stage = rng.choice(cfg.ZERO_STAGES)
    parallel = {"tp": tp, "pp": pp, "dp": dp, "zero_stage": stage, "schedule": schedule,
                "virtual_stages": v, "sequence_parallel": tp > 1 and rng.random() < 0.5,
                "order": rng.choice(_orders()), "pp_layers": pp_layers,
                "bucket_size_mb": rng.choice((0.01, 25.0)),  # tiny buckets: many reductions overlap backward
                "offload": rng.choice(cfg.OFFLOAD_MODES),
                # stage 3's own knobs, drawn for stage 3 (as virtual_stages is for the interleaved schedule)
                "zero3_reshard": rng.choice(cfg.ZERO3_RESHARD) if stage == 3 else "auto",
                "zero3_prefetch": rng.choice((0, 1, 2)) if stage == 3 else 1}
    train = {"global_batch_size": g, "micro_batch_size": mbs, "recompute": rng.choice(cfg.RECOMPUTE)}
    model = rng.choice(sorted(MODELS))
    emulate_nccl = pp > 1 and rng.random() < 0.4
    # Context parallel, drawn last and within the world budget: the draws above keep their odds.
    cp = rng.choice([d for d in DEGREES["cp"] if tp * pp * dp * d <= MAX_WORLD] or [1])
    cp_comm = rng.choice(CP_COMM_VARIANTS) if cp > 1 else "p2p"
    # a2a+p2p: a real hierarchy (1 < a2a size < cp) where cp allows one, else either degenerate end.
    sizes = [d for d in range(2, cp) if cp % d == 0] or [d for d in (1, cp) if cp % d == 0]
    a2a = rng.choice(sizes) if cp_comm == "a2a+p2p" else None
    parallel.update(cp=cp, cp_comm=cp_comm, cp_a2a_size=a2a)
    if cp > 1:  # cp takes a drawn place in the rank order
        dims = parallel["order"].split("-")
        dims.insert(rng.randrange(len(dims) + 1), "cp")
        parallel["order"] = "-".join(dims)
    return LayoutCase(case_id, model, parallel, train, emulate_nccl=emulate_nccl or (cp > 1 and rng.random() < 0.3),
                      document_mask=rng.random() < 0.3)


def _draw_moe(rng: random.Random, case_id: int) -> LayoutCase:
    """A dense draw turned into a mixture of experts: an MoE model, an ep degree (it folds over
    tp x dp, which the validator checks) and, at pp > 1, sometimes the dense first layer alone on stage 0."""
    case = _draw(rng, case_id)
    model = rng.choice(sorted(MOE_MODELS))
    layers = MOE_MODELS[model]["num_layers"]
    two_chunks = 2 * case.parallel["pp"] <= layers  # the virtual schedules: 2 chunks per stage, 1+ layer each
    p = dict(case.parallel, ep=rng.choice(EP_DEGREES), virtual_stages=1, order=case.parallel["order"].replace("dp", "ep-dp"),
             schedule=rng.choice([s for s in cfg.SCHEDULES if s not in ("interleaved_1f1b", "zbv") or two_chunks]))
    if p["schedule"] in ("interleaved_1f1b", "zbv"):
        p["virtual_stages"] = 2
    p["pp_layers"] = [1, *composition(rng, layers - 1, p["pp"] - 1)] \
        if p["virtual_stages"] == 1 and 1 < p["pp"] < layers and rng.random() < 0.5 else None
    # Expert tensor parallel: tp's default or another degree whose expert grid fills the world (so that
    # draws meeting the rarer coverage properties stay valid often enough; the validator still decides).
    world = p["tp"] * p["pp"] * p["dp"] * p.get("cp", 1)
    p["etp"] = rng.choice([d for d in (p["tp"], 1, 2, 4) if world % (d * p["ep"] * p["pp"]) == 0] or [p["tp"]])
    # The experts' own ZeRO stage (parallel.expert_zero_stage), drawn last: the draws above keep their odds.
    if rng.random() < 0.5:
        p["expert_zero_stage"] = rng.choice([s for s in cfg.ZERO_STAGES if s != p["zero_stage"]])
        if p["offload"] != "none" and p["expert_zero_stage"] == 0:
            p["expert_zero_stage"] = rng.choice([s for s in cfg.ZERO_STAGES if s not in (0, p["zero_stage"])])
        if 3 not in (p["zero_stage"], p["expert_zero_stage"]):
            p["zero3_reshard"] = "auto"
    # Capacity drops (any tp / cp: defined over the micro-batch), from a fork of the RNG's state that leaves
    # its sequence untouched: every layout drawn before capacity existed (and the CI sample) stays as it was.
    state = repr(rng.getstate())  # both forks seed from it: one repr of the 625-word state (~0.2 ms) a draw
    fork = random.Random(state)
    capacity = (fork.choice(CAPACITY_FACTORS), fork.choice(DROP_POLICIES)) if fork.random() < 0.4 else None
    # The dispatcher, from a second fork (the draws above keep their values); the dense draw's document mask.
    dispatcher = random.Random(state + "dispatcher").choice(DISPATCHERS)
    return LayoutCase(case_id, model, p, case.train, emulate_nccl=case.emulate_nccl, capacity=capacity,
                      document_mask=case.document_mask, dispatcher=dispatcher)


def _draw_pipe(rng: random.Random, case_id: int) -> LayoutCase:
    """A dense draw moved onto 3 or 4 stages of 1F1B or interleaved 1F1B, with ``parallel.split_drain`` drawn
    (auto / true / false) and an uneven split of the layers over the chunks (empty ends sometimes)."""
    case = _draw(rng, case_id)
    pp, schedule = rng.choice((3, 4)), rng.choice(SPLIT_DRAIN_SCHEDULES)
    v = 2 if schedule == "interleaved_1f1b" else 1  # pp * v <= 8 layers: 2 is the only choice at pp >= 3
    counts = empty_ends(rng, composition(rng, MODELS[case.model]["num_layers"], pp * v))
    p = dict(case.parallel, pp=pp, schedule=schedule, virtual_stages=v, pp_layers=counts,
             split_drain=rng.choice(SPLIT_DRAIN_VALUES))
    return LayoutCase(case_id, case.model, p, case.train, emulate_nccl=rng.random() < 0.4,
                      document_mask=case.document_mask)


def _drawer(case_id: int, label: str = "") -> Callable[[random.Random, int], LayoutCase]:
    """The draw of ``case_id`` (or of coverage property ``label``): pipeline, MoE or dense."""
    if PIPE_BASE <= case_id < MOE_BASE or label.startswith("pipe_"):
        return _draw_pipe
    return _draw_moe if case_id >= MOE_BASE or label.startswith("moe_") else _draw


def is_valid(case: LayoutCase) -> bool:
    """Whether the config validator accepts ``case`` (the one source of validity)."""
    try:
        resolve(job_from_dict(case.values("unused-out-dir", "unused-cache")), case.world_size)
    except ConfigError:
        return False
    return True


def generate_case(case_id: int, where: Callable[[LayoutCase], bool] = lambda c: True) -> LayoutCase:
    """The layout of ``case_id``: the first draw of its own RNG within budget, valid and ``where``."""
    rng = random.Random(f"{MATRIX_SEED}:{case_id}")
    cover = list(CI_MUST_COVER)[case_id - COVER_BASE] if 0 <= case_id - COVER_BASE < len(CI_MUST_COVER) else ""
    draw = _drawer(case_id, cover)
    for _ in range(MAX_DRAWS):
        case = draw(rng, case_id)
        if case.world_size <= MAX_WORLD and where(case) and is_valid(case):
            return case
    raise RuntimeError(f"case {case_id}: no valid layout in {MAX_DRAWS} draws")


CI_MAX_MICROBATCHES = 6  # per rank and step


def affordable_for_ci(case: LayoutCase, label: str) -> bool:
    """Coverage draws stay cheap on 2 cores: few microbatches, and disk offload (slow in small
    chunks) only where the property asks for it. The whole matrix has no such budget."""
    p, t = case.parallel, case.train
    microbatches = t["global_batch_size"] // (t["micro_batch_size"] * p["dp"])
    return microbatches <= CI_MAX_MICROBATCHES and (p["offload"] != "disk" or "disk" in label)


CI_CANDIDATES = 300  # coverage draws considered per coverage case (drawing is cheap, validating is not)


CI_CASE_OVERHEAD = 4  # a rank's set-up (model, data, groups) and evaluations, in microbatches, roughly


def ci_cost(case: LayoutCase) -> int:
    """What a case costs on a shared 2-core machine, roughly: rank x (microbatches + set-up)."""
    p, t = case.parallel, case.train
    return case.world_size * (t["global_batch_size"] // (t["micro_batch_size"] * p["dp"]) + CI_CASE_OVERHEAD)


def _cover_draw(k: int, uncovered: list[str]) -> LayoutCase:
    """The layout covering property ``k``: among the first ``CI_CANDIDATES`` draws of id
    ``COVER_BASE + k`` that meet it within ``affordable_for_ci``, the valid one of least ``ci_cost``
    per ``uncovered`` property it meets (the greedy rule for a cheap set cover), then the first drawn."""
    label, where = list(CI_MUST_COVER.items())[k]
    rng = random.Random(f"{MATRIX_SEED}:{COVER_BASE + k}")
    draw = _drawer(COVER_BASE + k, label)
    ranked = []
    for i in range(MAX_DRAWS):
        case = draw(rng, COVER_BASE + k)
        if case.world_size <= MAX_WORLD and where(case) and affordable_for_ci(case, label):
            ranked.append((ci_cost(case) / sum(CI_MUST_COVER[u](case) for u in uncovered), i, case))
            if len(ranked) == CI_CANDIDATES:
                break
    for *_, case in sorted(ranked, key=lambda r: r[:2]):
        if is_valid(case):
            return case
    raise RuntimeError(f"case {COVER_BASE + k}: no valid layout for {label} in {MAX_DRAWS} draws")


@functools.lru_cache(maxsize=1)
def ci_sample() -> tuple[LayoutCase, ...]:
    """The first ``CI_HEAD`` ids, then a greedy cover of ``CI_MUST_COVER``: for the first property
    not met yet, the draw meeting the most properties not met yet (``_cover_draw``); until all are.
    Ordered by world size (the test harness keeps rank processes per world size)."""
    cases = [generate_case(i) for i in range(CI_HEAD)]
    labels = list(CI_MUST_COVER)
    uncovered = [label for label in labels if not any(CI_MUST_COVER[label](c) for c in cases)]
    while uncovered:
        case = _cover_draw(labels.index(uncovered[0]), uncovered)
        cases.append(case)
        uncovered = [label for label in uncovered if not CI_MUST_COVER[label](case)]
    return tuple(sorted(cases, key=lambda c: (c.world_size, c.case_id)))


def case_by_id(case_id: int) -> LayoutCase:
    """The case of any id: a coverage id (``COVER_BASE + k``) is the CI sample's case of that id, or
    (if the sample did not need property k) the first valid draw under it."""
    if COVER_BASE <= case_id < COVER_BASE + len(CI_MUST_COVER):  # (MoE ids, MOE_BASE + k, lie above)
        for case in ci_sample():
            if case.case_id == case_id:
                return case
        label, where = list(CI_MUST_COVER.items())[case_id - COVER_BASE]
        return generate_case(case_id, lambda c: where(c) and affordable_for_ci(c, label))
    return generate_case(case_id)


def all_cases() -> list[LayoutCase]:
    cases = {c.case_id: c for c in [*(generate_case(i) for i in range(ALL_CASES)),
                                     *(generate_case(MOE_BASE + k) for k in range(MOE_CASES)),
                                     *(generate_case(PIPE_BASE + k) for k in range(PIPE_CASES)), *ci_sample()]}
    return [cases[i] for i in sorted(cases)]
