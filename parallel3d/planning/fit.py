"""Fit each device family's compute curve on the ``calibration`` rows of ``published_runs.yaml``.

``python -m parallel3d.planning.fit [--family h100_80gb] [--rounds 2] [--jobs 2]`` prints, per
family, the fitted ``matmul_efficiency``, ``gemm_knee``, ``attention_efficiency`` and
``layer_overhead_us`` (device YAML keys read by ``gemm`` and ``cost``; ``--knobs`` picks a subset),
the calibration rows' MFU errors before and after, and the YAML lines to paste. A family is the devices with the same SMs (A100 40/80 GB;
H100, H200, H800): its rows are priced on the family's calibration device.

The objective is the mean absolute relative MFU error of the family's calibration rows, each priced
exactly as ``validation`` prices it (the run's own framework options, unstated layout fields at the
planner's best fitting choice, the full pipeline simulator, the source's FLOPs convention); it is
minimised one knob at a time by golden-section search inside physical bounds, for ``rounds`` sweeps.
The completion of unstated fields depends on the device curve, so it is held fixed during a fit and
redone on the fitted curve, refitting until it no longer changes (at most ``MAX_COMPLETIONS`` passes).
A knob that no calibration row exercises (fused attention on a family whose calibration rows all ran
unfused) keeps its current value.

Invariant: only rows with ``split: calibration`` are read; held-out rows never enter the fit.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.cost import CostOptions, estimate_step
from parallel3d.planning.devices import DEVICES, DeviceSpec
from parallel3d.planning.planner import stage_layer_counts
from parallel3d.planning.published import load_published_runs
from parallel3d.planning.source_frameworks import run_options, source_flops_per_token, source_peak_flops
from parallel3d.planning.validation import Unpriceable, priced_candidate, run_cluster, run_config

# Devices sharing one compute curve (same SMs and tensor cores), keyed by the calibration device.
FAMILIES: dict[str, tuple[str, ...]] = {
    "a100_80gb": ("a100_40gb", "a100_80gb"),
    "h100_80gb": ("h100_80gb", "h200_141gb", "h800_80gb"),
}
# Physical bounds of each knob: a fraction of peak, and a shape size (0: shape-independent).
BOUNDS: dict[str, tuple[float, float]] = {
    "matmul_efficiency": (0.40, 0.95),
    "gemm_knee": (0.0, 800.0),
    "attention_efficiency": (0.15, 0.95),
    "layer_overhead_s": (0.0, 1e-3),
}
KNOBS = tuple(BOUNDS)
MAX_COMPLETIONS = 3  # fit passes, each on the rows re-completed on the previous pass's fitted device
_GOLDEN = 0.6180339887498949


@dataclass(frozen=True)
class CalibrationRow:
    """One calibration run, rebuilt once: what pricing it on a trial device needs."""

    run_id: str
    config: object
    layout: object
    gpus: int
    gpus_per_node: int
    options: CostOptions
    splits: tuple[int, ...]
    flops_per_token: float
    peak_flops: float
    published_mfu: float

    def predicted_mfu(self, device: DeviceSpec) -> float:
        cluster = ClusterSpec(gpus=self.gpus, gpus_per_node=self.gpus_per_node, device=device)
        step = estimate_step(self.config, self.layout, cluster, self.options, list(self.splits))
        return step.tokens_per_s() / self.gpus * self.flops_per_token / self.peak_flops

    @property
    def fused_attention(self) -> bool:
        return self.options.fused_attention


def calibration_rows(device: str, completed_on: DeviceSpec | None = None) -> list[CalibrationRow]:
    """The priceable ``calibration`` rows that ran on ``device`` (held-out rows are never read), each
    layout as ``validation.priced_candidate`` completes it (unstated fields at the planner's best fitting
    choice) on ``completed_on`` (default: the device YAML as it is). The completion is held fixed while
    the fit varies the knobs; ``main`` re-completes on the fitted device and refits until it is stable."""
    rows = []
    for run in load_published_runs():
        if run.split != "calibration" or run.hardware.device != device or run.mfu is None:
            continue
        try:
            config, cluster = run_config(run), run_cluster(run)
            if completed_on is not None:
                cluster = ClusterSpec(gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node, device=completed_on)
            layout = priced_candidate(run, run_options(run), cluster).layout
        except Unpriceable:
            continue
        peak = source_peak_flops(run, cluster)
        rows.append(CalibrationRow(run.id, config, layout, cluster.gpus, cluster.gpus_per_node, run_options(run),
                                   tuple(stage_layer_counts(config, layout.pp, layout.virtual_stages, layout.seq_len)),
                                   source_flops_per_token(run, config), peak, run.mfu))
    return rows


def _price(args: tuple[CalibrationRow, DeviceSpec]) -> float:
    row, device = args
    return row.predicted_mfu(device)


class Objective:
    """Mean |relative MFU error| of a family's calibration rows for a trial device (cached)."""

    def __init__(self, rows: list[CalibrationRow], pool: ProcessPoolExecutor | None) -> None:
        self.rows, self.pool = rows, pool
        self._seen: dict[tuple, list[float]] = {}

    def errors(self, device: DeviceSpec) -> list[float]:
        key = tuple(getattr(device, k) for k in KNOBS)
        if key not in self._seen:
            jobs = [(row, device) for row in self.rows]
            mfus = list(self.pool.map(_price, jobs)) if self.pool else [_price(j) for j in jobs]
            self._seen[key] = [(m - r.published_mfu) / r.published_mfu for m, r in zip(mfus, self.rows)]
        return self._seen[key]

    def __call__(self, device: DeviceSpec) -> float:
        errs = self.errors(device)
        return sum(abs(e) for e in errs) / len(errs)


def golden_section(f: Callable[[float], float], lo: float, hi: float, steps: int) -> float:
    """Argmin of a unimodal ``f`` on [lo, hi] to within (hi - lo) * 0.618**steps."""
    a, b = lo, hi
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = f(d)
    return (a + b) / 2


def _rounded(knob: str, value: float) -> float:
    if knob == "layer_overhead_s":
        return round(value, 6)  # whole microseconds
    return round(value) if knob == "gemm_knee" else round(value, 3)


def rows_exercising(rows: list[CalibrationRow], knobs: tuple[str, ...]) -> list[CalibrationRow]:
    """The rows whose price depends on ``knobs``: only fused-attention rows see attention_efficiency."""
    if set(knobs) <= {"attention_efficiency"}:
        return [r for r in rows if r.fused_attention]
    return rows


def fit_family(device: DeviceSpec, objective: Objective, rounds: int, steps: int,
               knobs: tuple[str, ...] = KNOBS) -> DeviceSpec:
    """Coordinate descent over ``knobs`` (module docstring); knobs no row exercises are kept."""
    fused = any(r.fused_attention for r in objective.rows)
    knobs = tuple(k for k in knobs if k != "attention_efficiency" or fused)
    if device.attention_efficiency is None and "attention_efficiency" in knobs:
        device = replace(device, attention_efficiency=0.5)  # start of the search; any value in BOUNDS
    for _ in range(rounds):
        for knob in knobs:
            lo, hi = BOUNDS[knob]
            best = golden_section(lambda x: objective(replace(device, **{knob: _rounded(knob, x)})), lo, hi, steps)
            trial = replace(device, **{knob: _rounded(knob, best)})
            if objective(trial) <= objective(device):
                device = trial
    return device


def _table(rows: list[CalibrationRow], before: list[float], after: list[float]) -> str:
    lines = [f"  {'calibration row':38s} {'before':>8s} {'after':>8s}"]
    for row, b, a in zip(rows, before, after):
        lines.append(f"  {row.run_id:38s} {100 * b:+7.1f}% {100 * a:+7.1f}%")
    for name, agg in (("mean |err|", lambda e: sum(map(abs, e)) / len(e)), ("worst |err|", lambda e: max(map(abs, e)))):
        lines.append(f"  {name:38s} {100 * agg(before):7.1f}% {100 * agg(after):7.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel3d.planning.fit", description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), action="append",
                        help="calibration device of the family to fit (default: all)")
    parser.add_argument("--rounds", type=int, default=2, help="coordinate-descent sweeps over the knobs")
    parser.add_argument("--steps", type=int, default=8, help="golden-section steps per knob")
    parser.add_argument("--jobs", type=int, default=1, help="processes pricing rows in parallel")
    parser.add_argument("--knobs", default=",".join(KNOBS),
                        help="comma-separated knobs to fit (the others keep the device YAML's values)")
    args = parser.parse_args(argv)
    knobs = tuple(k for k in args.knobs.split(",") if k)
    unknown = set(knobs) - set(KNOBS)
    if unknown:  # before any pricing or pool start-up
        parser.error(f"--knobs: unknown {sorted(unknown)}; allowed: {list(KNOBS)}")
    pool = ProcessPoolExecutor(args.jobs) if args.jobs > 1 else None
    try:
        for name in args.family or sorted(FAMILIES):
            current = DEVICES[name]
            fitted, completions, before = current, None, None
            for passes in range(1, MAX_COMPLETIONS + 1):  # re-completed on the fitted curve until stable
                rows = rows_exercising(calibration_rows(name, fitted), knobs)
                if completions == [r.layout for r in rows]:
                    break
                completions = [r.layout for r in rows]
                objective = Objective(rows, pool)
                before = before or objective.errors(current)  # as validation prices the YAML today
                fitted = fit_family(fitted, objective, args.rounds, args.steps, knobs)
            print(f"{name} family {', '.join(FAMILIES[name])}: {len(rows)} calibration rows, "
                  f"{passes} completion passes")
            print(_table(rows, before, Objective(rows, pool).errors(fitted)))
            yaml = {k: getattr(fitted, k) for k in KNOBS}
            yaml["layer_overhead_us"] = round(yaml.pop("layer_overhead_s") * 1e6)
            print("  YAML:", ", ".join(f"{k}: {v}" for k, v in yaml.items()))
    finally:
        if pool:
            pool.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
