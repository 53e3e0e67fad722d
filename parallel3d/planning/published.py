"""Published LLM training runs (``published_runs.yaml``): typed, validated, printable.

``load_published_runs()`` returns one frozen ``PublishedRun`` per run; every run is checked
when loaded, and a bad one is one ``ValueError`` naming the run and the field:
- the layout's arithmetic: ``tp*pp*cp*dp == gpus``, the global batch splits into whole
  micro-batches per data-parallel rank, expert groups (``ep*etp``) fold into ``tp*cp*dp``;
- the shape: heads divide by kv heads and by tp, experts by ep;
- the published numbers agree with each other (TFLOP/s / peak vs MFU, tokens/s vs step time)
  and with the device catalogue's peak;
- conventions and the source are present, and every ``inferred`` key names a real field.

``python -m parallel3d.planning.published`` prints the runs as a table.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import yaml

from parallel3d.config import PRECISIONS, RECOMPUTE, SCHEDULES
from parallel3d.planning.devices import DEVICES

RUNS_FILE = Path(__file__).with_name("published_runs.yaml")

SPLITS = ("calibration", "held_out", "reference")
RUN_PRECISIONS = tuple(p for p in PRECISIONS if p != "fp32") + ("fp8",)
# The training config's schedules, plus those only published runs use; "none" when pp = 1.
RUN_SCHEDULES = ("none",) + SCHEDULES + ("dualpipe",)
MLPS = ("gelu", "swiglu", "squared_relu")
ATTENTIONS = ("mha", "gqa", "mla", "gqa_swa")
ANSWERS = ("yes", "no", "n/a", "unknown")
ATTENTION_COUNTING = ("full", "causal", "none", "unknown", "n/a")
METRICS = ("mfu_percent", "hfu_percent", "tflops_per_gpu", "tokens_per_s_per_gpu", "step_time_s")
# Published percentages are rounded (often to whole percents): TFLOP/s over the peak may differ
# from the printed MFU by this many points, and tokens/s from batch/step time by this fraction.
MFU_POINTS_TOLERANCE = 1.0
RATE_TOLERANCE = 0.02


@dataclass(frozen=True)
class MoEShape:
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int
    shared_expert_ffn: int
    dense_layers: int  # leading layers with a dense MLP of width ``ModelShape.ffn``
    capacity_factor: float | None  # None: dropless


@dataclass(frozen=True)
class MLAShape:
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    params_b: float | None
    layers: int
    hidden: int
    heads: int
    kv_heads: int | None  # None: heads (multi-head attention)
    head_dim: int | None  # None: hidden // heads
    ffn: int
    mlp: str
    vocab: int
    tied_embeddings: bool
    attention: str
    moe: MoEShape | None
    mla: MLAShape | None = None

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def query_head_dim(self) -> int:
        return self.hidden // self.heads if self.head_dim is None else self.head_dim


@dataclass(frozen=True)
class Hardware:
    device: str
    gpus: int
    gpus_per_node: int
    network: str


@dataclass(frozen=True)
class RunLayout:
    tp: int
    pp: int
    vp: int
    cp: int
    ep: int
    etp: int
    dp: int
    micro_batch: int
    sequence_parallel: bool
    recompute: str
    zero_stage: int
    schedule: str
    precision: str


@dataclass(frozen=True)
class Batch:
    global_batch: int
    seq_len: int


@dataclass(frozen=True)
class Published:
    primary: str
    mfu_percent: float | None = None
    hfu_percent: float | None = None
    tflops_per_gpu: float | None = None
    tokens_per_s_per_gpu: float | None = None
    step_time_s: float | None = None


@dataclass(frozen=True)
class FlopsConvention:
    recompute_counted: str
    attention: str
    gqa_accounted: str
    logits_counted: str
    peak_tflops: float | None
    formula: str


@dataclass(frozen=True)
class Source:
    citation: str
    location: str
    url: str
    verified: str


@dataclass(frozen=True)
class PublishedRun:
    """One published run; fields not named in ``inferred`` are as the source states them."""

    id: str
    split: str
    model: ModelShape
    hardware: Hardware
    layout: RunLayout
    batch: Batch
    published: Published
    flops_convention: FlopsConvention
    source: Source
    inferred: Mapping[str, str]
    notes: str = ""

    @property
    def tokens_per_step(self) -> int:
        return self.batch.global_batch * self.batch.seq_len

    @property
    def microbatches(self) -> int:
        """Micro-batches per data-parallel rank per step."""
        return self.batch.global_batch // (self.layout.micro_batch * self.layout.dp)

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """As published, else from the published step time."""
        if self.published.tokens_per_s_per_gpu is not None:
            return self.published.tokens_per_s_per_gpu
        if self.published.step_time_s is not None:
            return self.tokens_per_step / (self.published.step_time_s * self.hardware.gpus)
        return None

    @property
    def mfu(self) -> float | None:
        """The published MFU as a fraction, else TFLOP/s over the convention's peak."""
        if self.published.mfu_percent is not None:
            return self.published.mfu_percent / 100
        if self.published.tflops_per_gpu is not None and self.flops_convention.peak_tflops:
            return self.published.tflops_per_gpu / self.flops_convention.peak_tflops
        return None

    @property
    def implied_flops_per_token(self) -> float | None:
        """FLOPs per token the source counted (its convention), where its numbers pin it down."""
        rate = self.tokens_per_s_per_gpu
        if rate is None:
            return None
        if self.published.tflops_per_gpu is not None:
            return self.published.tflops_per_gpu * 1e12 / rate
        if self.published.mfu_percent is not None and self.flops_convention.peak_tflops:
            return self.published.mfu_percent / 100 * self.flops_convention.peak_tflops * 1e12 / rate
        return None


# ---- parsing -------------------------------------------------------------------------------

def _fail(run_id: str, message: str) -> ValueError:
    return ValueError(f"published_runs.yaml: run {run_id!r}: {message}")


def _typed(cls: type, data: Any, run_id: str, path: str) -> Any:
    """``cls(**data)`` with exact keys and each value's type checked against the annotation."""
    if not isinstance(data, Mapping):
        raise _fail(run_id, f"{path} must be a mapping, got {type(data).__name__}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise _fail(run_id, f"{path}: unknown key(s) {unknown}; allowed: {names}")
    values = {}
    for f in fields(cls):
        if f.name not in data:
            if f.default is not MISSING:
                continue
            raise _fail(run_id, f"{path}.{f.name} is missing")
        values[f.name] = _check_type(data[f.name], str(f.type), run_id, f"{path}.{f.name}")
    return cls(**values)


def _check_type(value: Any, annotation: str, run_id: str, path: str) -> Any:
    optional = annotation.endswith("| None")
    base = annotation.replace(" | None", "")
    if value is None:
        if optional:
            return None
        raise _fail(run_id, f"{path} must not be null")
    if base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    elif base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        value = float(value) if ok else value
    elif base == "bool":
        ok = isinstance(value, bool)
    elif base == "str":
        ok = isinstance(value, str) and value != ""
    else:
        return value  # nested dataclasses and mappings are parsed by the caller
    if not ok:
        raise _fail(run_id, f"{path}={value!r} is not a valid {base}")
    return value


def _choice(run_id: str, path: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise _fail(run_id, f"{path}={value!r} is not one of {allowed}")


def parse_run(data: Mapping[str, Any]) -> PublishedRun:
    """One run from its YAML mapping, validated (see the module docstring)."""
    run_id = data.get("id", "<no id>") if isinstance(data, Mapping) else "<not a mapping>"
    if not isinstance(data, Mapping):
        raise _fail(run_id, "each run must be a mapping")
    model_data = dict(data.get("model") or {})
    moe, mla = model_data.pop("moe", None), model_data.pop("mla", None)
    model_data["moe"], model_data["mla"] = None, None
    model = _typed(ModelShape, model_data, run_id, "model")
    model = ModelShape(**{**model.__dict__, "moe": None if moe is None else _typed(MoEShape, moe, run_id, "model.moe"),
                          "mla": None if mla is None else _typed(MLAShape, mla, run_id, "model.mla")})
    run = _typed(PublishedRun, {**data, "model": model,
                                "hardware": _typed(Hardware, data.get("hardware"), run_id, "hardware"),
                                "layout": _typed(RunLayout, data.get("layout"), run_id, "layout"),
                                "batch": _typed(Batch, data.get("batch"), run_id, "batch"),
                                "published": _typed(Published, data.get("published"), run_id, "published"),
                                "flops_convention": _typed(FlopsConvention, data.get("flops_convention"), run_id,
                                                           "flops_convention"),
                                "source": _typed(Source, data.get("source"), run_id, "source"),
                                "inferred": data.get("inferred")}, run_id, "run")
    validate_run(run, data)
    return run


# ---- validation ----------------------------------------------------------------------------

def _field_paths(data: Mapping[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, value in data.items():
        path = f"{prefix}{key}"
        paths.add(path)
        if isinstance(value, Mapping) and key != "inferred":
            paths |= _field_paths(value, path + ".")
    return paths


def _check_shape(run: PublishedRun) -> None:
    m, lay, rid = run.model, run.layout, run.id
    _choice(rid, "model.mlp", m.mlp, MLPS)
    _choice(rid, "model.attention", m.attention, ATTENTIONS)
    for key in ("layers", "hidden", "heads", "kv", "ffn", "vocab"):
        if getattr(m, key) < 1:
            raise _fail(rid, f"model.{key} must be >= 1")
    if m.heads % m.kv:
        raise _fail(rid, f"model.heads={m.heads} is not divisible by model.kv_heads={m.kv}")
    if m.head_dim is None and m.hidden % m.heads:
        raise _fail(rid, f"model.hidden={m.hidden} is not divisible by model.heads={m.heads} (set model.head_dim)")
    if (m.attention == "mla") != (m.mla is not None):
        raise _fail(rid, "model.mla is required with model.attention='mla' and only then")
    if m.attention != "mla" and (m.attention == "mha") != (m.kv == m.heads):
        raise _fail(rid, f"model.attention={m.attention!r} with kv_heads={m.kv}, heads={m.heads}: "
                         "'mha' exactly when they are equal")
    if m.heads % lay.tp:
        raise _fail(rid, f"model.heads={m.heads} is not divisible by layout.tp={lay.tp}")
    if m.moe is None:
        if lay.ep != 1 or lay.etp != 1:
            raise _fail(rid, f"a dense model needs layout.ep = layout.etp = 1, got {lay.ep}, {lay.etp}")
        return
    e = m.moe
    if not 1 <= e.top_k <= e.experts or e.expert_ffn < 1 or e.dense_layers >= m.layers:
        raise _fail(rid, "model.moe needs 1 <= top_k <= experts, expert_ffn >= 1 and dense_layers < layers")
    if (e.shared_experts == 0) != (e.shared_expert_ffn == 0):
        raise _fail(rid, "model.moe.shared_experts and shared_expert_ffn must both be 0 or both > 0")
    if e.experts % lay.ep:
        raise _fail(rid, f"model.moe.experts={e.experts} is not divisible by layout.ep={lay.ep}")


def _check_layout(run: PublishedRun) -> None:
    lay, rid = run.layout, run.id
    for key in ("tp", "pp", "vp", "cp", "ep", "etp", "dp", "micro_batch"):
        if getattr(lay, key) < 1:
            raise _fail(rid, f"layout.{key} must be >= 1")
    _choice(rid, "layout.recompute", lay.recompute, RECOMPUTE)
    _choice(rid, "layout.schedule", lay.schedule, RUN_SCHEDULES)
    _choice(rid, "layout.precision", lay.precision, RUN_PRECISIONS)
    _choice(rid, "layout.zero_stage", lay.zero_stage, (0, 1, 2, 3))
    gpus = run.hardware.gpus
    if lay.tp * lay.pp * lay.cp * lay.dp != gpus:
        raise _fail(rid, f"layout.tp*pp*cp*dp = {lay.tp}*{lay.pp}*{lay.cp}*{lay.dp} = "
                         f"{lay.tp * lay.pp * lay.cp * lay.dp} != hardware.gpus={gpus}")
    if (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp):
        raise _fail(rid, f"layout.ep*etp={lay.ep * lay.etp} does not fold into tp*cp*dp={lay.tp * lay.cp * lay.dp}")
    if run.batch.global_batch % (lay.micro_batch * lay.dp):
        raise _fail(rid, f"batch.global_batch={run.batch.global_batch} is not divisible by "
                         f"layout.micro_batch*dp={lay.micro_batch * lay.dp}")
    if (lay.pp == 1) != (lay.schedule == "none"):
        raise _fail(rid, f"layout.schedule={lay.schedule!r} with layout.pp={lay.pp}: 'none' exactly when pp = 1")
    if lay.vp > 1 and lay.schedule != "interleaved_1f1b":
        raise _fail(rid, f"layout.vp={lay.vp} needs layout.schedule='interleaved_1f1b'")
    if lay.schedule == "interleaved_1f1b" and lay.vp < 2:
        raise _fail(rid, "layout.schedule='interleaved_1f1b' needs layout.vp >= 2")
    if lay.sequence_parallel and lay.tp == 1:
        raise _fail(rid, "layout.sequence_parallel needs layout.tp > 1")
    if lay.cp > 1 and run.batch.seq_len % (2 * lay.cp):
        raise _fail(rid, f"batch.seq_len={run.batch.seq_len} is not divisible by 2*layout.cp={2 * lay.cp}")
    if run.hardware.device not in DEVICES:
        raise _fail(rid, f"hardware.device={run.hardware.device!r} is not in the device catalogue {sorted(DEVICES)}")
    if gpus > run.hardware.gpus_per_node and gpus % run.hardware.gpus_per_node:
        raise _fail(rid, f"hardware.gpus={gpus} is not a multiple of hardware.gpus_per_node")


def _check_published(run: PublishedRun) -> None:
    pub, conv, rid = run.published, run.flops_convention, run.id
    _choice(rid, "published.primary", pub.primary, METRICS)
    if getattr(pub, pub.primary) is None:
        raise _fail(rid, f"published.primary={pub.primary!r} has no value")
    for key in ("mfu_percent", "hfu_percent"):
        value = getattr(pub, key)
        if value is not None and not 0 < value <= 100:
            raise _fail(rid, f"published.{key}={value} is not a percentage")
    if pub.mfu_percent is not None and pub.hfu_percent is not None and pub.hfu_percent < pub.mfu_percent:
        raise _fail(rid, "published.hfu_percent < mfu_percent: hardware FLOPs include the model's")
    for key in ("recompute_counted", "gqa_accounted", "logits_counted"):
        _choice(rid, f"flops_convention.{key}", getattr(conv, key), ANSWERS)
    _choice(rid, "flops_convention.attention", conv.attention, ATTENTION_COUNTING)
    if (pub.mfu_percent is not None or pub.hfu_percent is not None) and conv.peak_tflops is None:
        raise _fail(rid, "an MFU/HFU is published but flops_convention.peak_tflops is null")
    if conv.peak_tflops is not None:
        device_peak = DEVICES[run.hardware.device].peak_flops / 1e12
        if abs(conv.peak_tflops / device_peak - 1) > 0.01:
            raise _fail(rid, f"flops_convention.peak_tflops={conv.peak_tflops} is not the catalogue's "
                             f"{run.hardware.device} peak {device_peak:g}")
    if pub.mfu_percent is not None and pub.tflops_per_gpu is not None:
        implied = 100 * pub.tflops_per_gpu / conv.peak_tflops
        if abs(implied - pub.mfu_percent) > MFU_POINTS_TOLERANCE:
            raise _fail(rid, f"published.tflops_per_gpu / peak = {implied:.1f}% disagrees with "
                             f"published.mfu_percent={pub.mfu_percent}")
    if pub.tokens_per_s_per_gpu is not None and pub.step_time_s is not None:
        from_time = run.tokens_per_step / (pub.step_time_s * run.hardware.gpus)
        if abs(from_time / pub.tokens_per_s_per_gpu - 1) > RATE_TOLERANCE:
            raise _fail(rid, f"published.tokens_per_s_per_gpu={pub.tokens_per_s_per_gpu} disagrees with the "
                             f"batch over published.step_time_s ({from_time:.1f})")


def validate_run(run: PublishedRun, data: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the run and field when ``run`` is inconsistent."""
    _choice(run.id, "split", run.split, SPLITS)
    _check_shape(run)
    _check_layout(run)
    _check_published(run)
    if not isinstance(run.inferred, Mapping) or not all(isinstance(v, str) and v for v in run.inferred.values()):
        raise _fail(run.id, "inferred must map field paths to how each was inferred")
    valid = _field_paths({k: v for k, v in data.items() if k != "inferred"})
    bad = sorted(set(run.inferred) - valid)
    if bad:
        raise _fail(run.id, f"inferred names field(s) that do not exist: {bad}")


def load_published_runs(path: Path | str = RUNS_FILE) -> tuple[PublishedRun, ...]:
    """Every run of the data file, validated; ids are unique."""
    document = yaml.safe_load(Path(path).read_text())
    if not isinstance(document, Mapping) or not isinstance(document.get("runs"), list):
        raise ValueError(f"{path}: expected a mapping with a 'runs' list")
    unknown = sorted(set(document) - {"schema_version", "conventions", "runs"})
    if unknown or document.get("schema_version") != 1:
        raise ValueError(f"{path}: expected schema_version 1 and keys schema_version, conventions, runs; "
                         f"got unknown {unknown}")
    runs = tuple(parse_run(item) for item in document["runs"])
    seen: set[str] = set()
    for run in runs:
        if run.id in seen:
            raise _fail(run.id, "duplicate id")
        seen.add(run.id)
    return runs


# ---- table -----------------------------------------------------------------------------------

def _layout_text(lay: RunLayout) -> str:
    parts = [f"tp{lay.tp}", f"pp{lay.pp}"]
    parts += [f"vp{lay.vp}"] if lay.vp > 1 else []
    parts += [f"cp{lay.cp}"] if lay.cp > 1 else []
    parts += [f"ep{lay.ep}"] + ([f"etp{lay.etp}"] if lay.etp > 1 else []) if lay.ep > 1 else []
    parts += [f"dp{lay.dp}", f"mbs{lay.micro_batch}", f"z{lay.zero_stage}", lay.recompute[:3]]
    parts += ["sp"] if lay.sequence_parallel else []
    return " ".join(parts)


def format_table(runs: tuple[PublishedRun, ...]) -> str:
    """One line per run: model, GPUs, layout, batch, the primary published number and its convention."""
    header = (f"{'id':44} {'split':11} {'model':26} {'device':12} {'GPUs':>6} {'layout':44} "
              f"{'GBS x seq':>14} {'published (primary)':>26} conv")
    lines = [header, "-" * len(header)]
    for run in runs:
        value = getattr(run.published, run.published.primary)
        conv = run.flops_convention
        lines.append(
            f"{run.id:44} {run.split:11} {run.model.name[:26]:26} {run.hardware.device:12} {run.hardware.gpus:6d} "
            f"{_layout_text(run.layout):44} {run.batch.global_batch:>6}x{run.batch.seq_len:<7} "
            f"{run.published.primary + '=' + format(value, 'g'):>26} "
            f"rc:{conv.recompute_counted} attn:{conv.attention} peak:{conv.peak_tflops or '-'}")
    counts = {split: sum(r.split == split for r in runs) for split in SPLITS}
    lines.append(f"{len(runs)} runs: " + ", ".join(f"{n} {split}" for split, n in counts.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table of ``published_runs.yaml`` (or of the file given as the one argument)."""
    args = sys.argv[1:] if argv is None else argv
    print(format_table(load_published_runs(*args[:1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
