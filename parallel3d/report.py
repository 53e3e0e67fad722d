"""``python -m parallel3d.report RUN_DIR``: one picture of a run, from its ``metrics.jsonl``.

Writes ``RUN_DIR/report.png`` (matplotlib, the ``report`` extra) with six panels over
steps: train loss and eval loss; tokens/s; MFU (or TFLOP/s per device where the
device's peak is unknown, e.g. CPUs); memory per rank (peak, max and min over ranks,
plus the tracked model-state categories and activations, max over ranks); the pipeline
bubble fraction ("n/a" without a pipeline: pp = 1); and a text panel (layout, steps, final
and best losses, mean throughput). A mixture of experts (``moe/layer_{i}/...`` keys) adds four
panels, one line per MoE layer: tokens per expert (min and max), their coefficient of
variation, the dropped fraction, and the aux and z losses. Without matplotlib it writes ``RUN_DIR/report.html``, self-contained with
inline SVG, and says so. Every plotted number is a JSONL value as written; nothing is
smoothed.
"""

from __future__ import annotations

import argparse
import errno
import html
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from parallel3d.jsonl_records import read_records as read_jsonl_records, skipped_message

# (JSONL key, legend label) of the memory panel; plotted in MiB.
MEMORY_SERIES = (
    ("mem_peak_bytes_max", "peak, max over ranks"),
    ("mem_peak_bytes_min", "peak, min over ranks"),
    ("mem_model_weights_bytes_max", "weights"),
    ("mem_gradients_bytes_max", "gradients"),
    ("mem_optimizer_moments_bytes_max", "optimizer moments"),
    ("mem_master_weights_bytes_max", "master weights"),
    ("mem_activations_bytes_max", "activations"),
)


# The per-layer MoE metrics (``parallel3d.moe_step.METRIC_NAMES``) and their panels: (title, ylabel,
# ((metric, line label suffix), ...)).
MOE_PANELS = (
    ("MoE tokens per expert (min, max)", "tokens", (("tokens_max", " max"), ("tokens_min", " min"))),
    ("MoE load: coefficient of variation", "std / mean", (("tokens_cv", ""),)),
    ("MoE dropped fraction", "fraction of routed slots", (("dropped_fraction", ""),)),
    ("MoE aux and z losses", "loss", (("aux_loss", " aux"), ("z_loss", " z"))),
)


def read_records(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: is {run_dir!r} a run directory (train.out_dir)?")
    records, bad = read_jsonl_records(path)
    if bad:  # a run killed mid-write, or a live run's line being written: draw the rest
        print(f"warning: {skipped_message(path, bad)}", file=sys.stderr)
    if not records:
        raise ValueError(f"{path} holds no records yet")
    return records


def _series(records: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key]) * scale) for r in records
           if r.get(key) is not None and math.isfinite(float(r[key]))]
    return [s for s, _ in pts], [v for _, v in pts]


@dataclass
class Panel:
    title: str
    ylabel: str
    lines: list[tuple[str, list[int], list[float]]]  # (label, steps, values)
    log_y: bool = False  # values spanning orders of magnitude (memory: RSS vs model states)
    note: str | None = None  # drawn instead of lines when the panel has nothing to show


def panels(records: list[dict[str, Any]]) -> list[Panel]:
    """The plotted series of each panel (what both renderers draw)."""
    out = [Panel("loss", "loss", [("train loss", *_series(records, "loss")),
                                  ("eval loss", *_series(records, "eval_loss"))]),
           Panel("throughput", "tokens/s", [("tokens/s", *_series(records, "tokens_per_sec"))])]
    mfu = _series(records, "mfu", 100.0)
    if mfu[0]:
        out.append(Panel("MFU", "% of peak", [("MFU", *mfu)]))
    else:
        out.append(Panel("TFLOP/s per device (MFU: peak unknown)", "TFLOP/s",
                         [("TFLOP/s/device", *_series(records, "tflops_per_device"))]))
    out.append(Panel("memory per rank", "MiB", [(label, *_series(records, key, 1 / 2**20))
                                                for key, label in MEMORY_SERIES]))
    out.append(Panel("pipeline bubble", "% of step", [("bubble", *_series(records, "bubble_fraction", 100.0))]))
    for p in out:
        p.lines = [line for line in p.lines if line[1]]
    if not out[4].lines:  # the trainer records no bubble without a pipeline (pp = 1)
        out[4].title, out[4].note = "pipeline bubble: n/a", "n/a: no pipeline (pp = 1)"
    positive = [v for _, _, values in out[3].lines for v in values if v > 0]
    out[3].lines = [line for line in out[3].lines if any(v > 0 for v in line[2])]
    out[3].log_y = bool(positive) and max(positive) > 100 * min(positive)
    return out + moe_panels(records)


def moe_layers(records: list[dict[str, Any]]) -> list[str]:
    """The ``layer_{i}`` names with ``moe/`` metrics, in layer order."""
    names = {key.split("/")[1] for r in records for key in r if key.startswith("moe/") and key.count("/") == 2}
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]) if n.rsplit("_", 1)[1].isdigit() else -1)


def moe_panels(records: list[dict[str, Any]]) -> list[Panel]:
    """``MOE_PANELS`` over every MoE layer of the run (none for a dense run)."""
    layers = moe_layers(records)
    if not layers:
        return []
    out = []
    for title, ylabel, metrics in MOE_PANELS:
        lines = [(f"{layer}{suffix}", *_series(records, f"moe/{layer}/{metric}"))
                 for layer in layers for metric, suffix in metrics]
        out.append(Panel(title, ylabel, [line for line in lines if line[1]]))
    return out


def summary_lines(records: list[dict[str, Any]], run_dir: str) -> list[str]:
    last = records[-1]
    lines = [os.path.abspath(run_dir), f"steps logged: {records[0]['step']} .. {last['step']}"]
    layout = _layout(run_dir)
    if layout:
        lines.append(layout)
    if last.get("loss") is not None:
        lines.append(f"final train loss: {last['loss']:.4f}")
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if evals:
        step, best = min(evals, key=lambda e: e[1])
        lines.append(f"best eval loss: {best:.4f} (step {step}), ppl {math.exp(min(best, 700)):.2f}")
    tps = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    if tps:
        lines.append(f"tokens/s: median {sorted(tps)[len(tps) // 2]:,.0f}")
    peak = max((r.get("mem_peak_bytes_max") or 0) for r in records)
    if peak:
        lines.append(f"peak memory (max over ranks): {peak / 2**20:,.0f} MiB")
    return lines


def _layout(run_dir: str) -> str | None:
    """``model | tp x pp x dp | zero`` from the run's ``.hydra/config.yaml``, when there is one."""
    path = os.path.join(run_dir, ".hydra", "config.yaml")
    if not os.path.isfile(path):
        return None
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(path)
        p = cfg.parallel
        return (f"{cfg.model.name} | tp {p.tp} x pp {p.pp} x dp {p.dp} | zero {p.zero_stage} | "
                f"{p.schedule} | {cfg.train.precision}")
    except Exception:  # noqa: BLE001 - the picture does not need it
        return None


def build_figure(records: list[dict[str, Any]], run_dir: str):  # noqa: ANN201 - a matplotlib Figure
    """The report as a matplotlib Figure (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    drawn = panels(records)
    rows = math.ceil((len(drawn) + 1) / 3)  # the panels, then the text panel, three a row
    fig = Figure(figsize=(15, 4.25 * rows), dpi=100, layout="constrained")
    axes = fig.subplots(rows, 3).ravel()
    for ax, panel in zip(axes, drawn):
        for label, steps, values in panel.lines:
            ax.plot(steps, values, label=label, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(panel.title)
        if panel.note:
            ax.text(0.5, 0.5, panel.note, ha="center", va="center", fontsize=12, transform=ax.transAxes)
        if panel.log_y:
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if len(panel.lines) > 1:
            ax.legend(fontsize=8)
    for ax in axes[len(drawn):]:
        ax.axis("off")
    text_ax = axes[len(drawn)]
    text_ax.text(0.0, 1.0, "\n".join(summary_lines(records, run_dir)), va="top", ha="left", fontsize=9,
                 family="monospace", wrap=True, transform=text_ax.transAxes)
    fig.suptitle(f"parallel3d run: {os.path.basename(os.path.abspath(run_dir))}")
    return fig


def _svg(panel: Panel, width: int = 440, height: int = 260) -> str:
    """One panel as inline SVG: polylines scaled to the panel, min/max on the axis."""
    colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
    xs = [s for _, steps, _ in panel.lines for s in steps] or [0, 1]
    ys = [v for _, _, values in panel.lines for v in values] or [0, 1]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    pad = 40

    def pt(s: float, v: float) -> str:
        return f"{pad + (s - x0) / (x1 - x0) * (width - 2 * pad):.1f},{height - pad - (v - y0) / (y1 - y0) * (height - 2 * pad):.1f}"

    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
             f'<text x="{width / 2}" y="16" text-anchor="middle">{html.escape(panel.title)}</text>',
             f'<text x="4" y="{pad}" font-size="10">{y1:.4g}</text>',
             f'<text x="4" y="{height - pad}" font-size="10">{y0:.4g}</text>',
             f'<text x="{pad}" y="{height - 8}" font-size="10">step {x0}</text>',
             f'<text x="{width - pad}" y="{height - 8}" font-size="10" text-anchor="end">step {x1}</text>']
    if panel.note:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">{html.escape(panel.note)}</text>')
    for i, (label, steps, values) in enumerate(panel.lines):
        color = colors[i % len(colors)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                     f'points="{" ".join(pt(s, v) for s, v in zip(steps, values))}"/>')
        parts.append(f'<text x="{width - pad}" y="{30 + 12 * i}" font-size="10" fill="{color}" '
                     f'text-anchor="end">{html.escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def write_html(records: list[dict[str, Any]], run_dir: str, path: str) -> str:
    body = "".join(f"<div style='display:inline-block;margin:6px'>{_svg(p)}</div>" for p in panels(records))
    text = "<br>".join(html.escape(line) for line in summary_lines(records, run_dir))
    with open(path, "w") as fh:
        fh.write(f"<!doctype html><html><head><meta charset='utf-8'><title>parallel3d run report</title></head>"
                 f"<body style='font-family:sans-serif'><h2>parallel3d run report</h2><p>{text}</p>{body}</body></html>")
    return path


class UnwritableOutput(OSError):
    """The report's file cannot be written; the message names it and what to do."""


def _writing(path: str, run_dir: str, given: bool, write: Callable[[str], Any] | None = None) -> str:
    """Without ``write``: probe that ``path`` can be written (before the figure is drawn); with it: ``write(path)``,
    whose own failure is caught (the place was probed once already: a second probe would only repeat the first).
    A failure (a read-only run directory, a missing folder, a directory, a full disk) is one line naming ``path``
    and the way out: another ``--out``."""
    try:
        if write is not None:
            write(path)
        else:
            if os.path.isdir(path):
                raise IsADirectoryError(errno.EISDIR, "it is a directory")
            with tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(path))):
                pass  # permission bits do not bind root: only a real write tells
    except OSError as exc:
        instead = "another --out FILE" if given else \
            f"--out FILE in a writable directory (python -m parallel3d.report {run_dir} --out /tmp/report.png)"
        raise UnwritableOutput(f"cannot write the report to {path} ({exc.strerror or exc}): pass {instead}") from None
    return path


def write_report(run_dir: str, out: str | None = None, fmt: str = "auto") -> str:
    """Render ``run_dir``'s report; returns the written path (PNG, or HTML without matplotlib). The output's
    place is probed before the figure is drawn (the PNG and HTML defaults share ``run_dir``)."""
    records = read_records(run_dir)
    default = lambda ext: os.path.join(run_dir, f"report.{ext}")  # noqa: E731
    _writing(out or default("png"), run_dir, out is not None)
    if fmt in ("auto", "png"):
        try:
            fig = build_figure(records, run_dir)
        except ImportError:
            if fmt == "png":
                raise
            print("matplotlib is not installed (pip install 'parallel3d[report]'): writing HTML instead",
                  file=sys.stderr)
        else:
            path = out or default("png")
            if not os.path.splitext(path)[1]:  # matplotlib adds ".png" to such a name: print where the file is
                path += ".png"
            return _writing(path, run_dir, out is not None, fig.savefig)
    return _writing(out or default("html"), run_dir, out is not None, lambda path: write_html(records, run_dir, path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel3d.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (train.out_dir) holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output file (default RUN_DIR/report.png or .html)")
    parser.add_argument("--format", choices=("auto", "png", "html"), default="auto")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir, args.out, args.format)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
