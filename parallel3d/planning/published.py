"""Published LLM training runs (``published_runs.yaml``): loaded, validated, printable.

``load_published_runs()`` returns one frozen ``PublishedRun`` per run (types in
``published_schema``); every run is checked when loaded (``published_checks``), and a bad one
is one ``ValueError`` naming the run and the field. ``python -m parallel3d.planning.published``
prints the runs as a table.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Mapping

import yaml

from parallel3d.planning.published_checks import SPLITS, fail, validate_run
from parallel3d.planning.published_schema import (
    Batch,
    FlopsConvention,
    Hardware,
    MLAShape,
    ModelShape,
    MoEShape,
    Published,
    PublishedRun,
    RunLayout,
    Source,
)

RUNS_FILE = Path(__file__).with_name("published_runs.yaml")


def _typed(cls: type, data: Any, run_id: str, path: str) -> Any:
    """``cls(**data)`` with exact keys and each value's type checked against the annotation."""
    if not isinstance(data, Mapping):
        raise fail(run_id, f"{path} must be a mapping, got {type(data).__name__}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise fail(run_id, f"{path}: unknown key(s) {unknown}; allowed: {names}")
    values = {}
    for f in fields(cls):
        if f.name not in data:
            if f.default is not MISSING:
                continue
            raise fail(run_id, f"{path}.{f.name} is missing")
        values[f.name] = _check_type(data[f.name], str(f.type), run_id, f"{path}.{f.name}")
    return cls(**values)


def _check_type(value: Any, annotation: str, run_id: str, path: str) -> Any:
    optional = annotation.endswith("| None")
    base = annotation.replace(" | None", "")
    if value is None:
        if optional:
            return None
        raise fail(run_id, f"{path} must not be null")
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
        raise fail(run_id, f"{path}={value!r} is not a valid {base}")
    return value


def parse_run(data: Mapping[str, Any]) -> PublishedRun:
    """One run from its YAML mapping, validated (see the module docstring)."""
    run_id = data.get("id", "<no id>") if isinstance(data, Mapping) else "<not a mapping>"
    if not isinstance(data, Mapping):
        raise fail(run_id, "each run must be a mapping")
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
                                "inferred": data.get("inferred"),
                                "unstated": tuple(data.get("unstated") or ())}, run_id, "run")
    validate_run(run, data)
    return run


def load_published_runs(path: Path | str = RUNS_FILE) -> tuple[PublishedRun, ...]:
    """Every run of the data file, validated; ids are unique."""
    # The C loader when PyYAML has it: the file is long and this runs on every planner check.
    document = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
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
            raise fail(run.id, "duplicate id")
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


__all__ = ["RUNS_FILE", "PublishedRun", "format_table", "load_published_runs", "main", "parse_run"]
