"""``python -m parallel3d.report``: the picture of a real run, rendered from its metrics.jsonl."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import typing

import pytest

from parallel3d import report
from parallel3d.config import job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    """A real run: 4 steps of gpt_tiny with two evaluations, through the Trainer."""
    root = tmp_path_factory.mktemp("report")
    out = str(root / "run")
    values = {"train": {"steps": 4, "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 32, "device": "cpu",
                        "out_dir": out, "eval_every": 2, "eval_iters": 1},
              "optimizer": {"warmup_steps": 1}, "data": {"cache_dir": str(root / "cache"), "valid_fraction": 0.05},
              "logging": {"log_every": 1}}
    train(resolve(job_from_dict(values, model="gpt_tiny"), 1), ParallelState.single_process())
    return out


def _records(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_figure_plots_the_runs_numbers(run_dir):
    records = _records(run_dir)
    fig = report.build_figure(records, run_dir)
    by_title = {ax.get_title(): ax for ax in fig.axes}
    lines = {line.get_label(): line for line in by_title["loss"].get_lines()}
    assert list(lines["train loss"].get_ydata()) == [r["loss"] for r in records]
    assert list(lines["eval loss"].get_xdata()) == [2, 4]
    assert list(lines["eval loss"].get_ydata()) == [r["eval_loss"] for r in records if "eval_loss" in r]
    tps = by_title["throughput"].get_lines()[0]
    assert list(tps.get_ydata()) == [r["tokens_per_sec"] for r in records]
    mem = {line.get_label(): line for line in by_title["memory per rank"].get_lines()}
    assert list(mem["peak, max over ranks"].get_ydata()) == [r["mem_peak_bytes_max"] / 2**20 for r in records]
    assert any("TFLOP/s" in t or "MFU" in t for t in by_title)
    # pp = 1: no pipeline, no bubble recorded, and the panel says so instead of plotting noise.
    assert all(r["bubble_fraction"] is None for r in records)
    bubble = by_title["pipeline bubble: n/a"]
    assert not bubble.get_lines() and [t.get_text() for t in bubble.texts] == ["n/a: no pipeline (pp = 1)"]


def test_cli_writes_a_png_a_person_can_look_at(run_dir):
    proc = subprocess.run([sys.executable, "-m", "parallel3d.report", run_dir], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip()
    assert path == os.path.join(run_dir, "report.png")
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] >= 600 and pixels.shape[1] >= 1000
    # Not blank: each of the six panels (2 x 3 grid) holds drawn (non-white) pixels.
    h, w = pixels.shape[:2]
    for row in range(2):
        for col in range(3):
            cell = pixels[row * h // 2:(row + 1) * h // 2, col * w // 3:(col + 1) * w // 3, :3]
            assert (cell < 0.9).any(axis=-1).mean() > 0.005, (row, col)


def test_html_fallback_without_matplotlib(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    path = report.write_report(run_dir, str(tmp_path / "r.html"))
    text = open(path).read()
    assert path.endswith(".html") and text.count("<svg") == 5
    points = text.split('<polyline', 1)[1].split('points="', 1)[1].split('"', 1)[0].split()
    assert len(points) == len(_records(run_dir))  # train loss: one point per record


def test_missing_run_dir_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "parallel3d.report", str(tmp_path / "nope")], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def moe_run_dir(tmp_path_factory) -> str:
    """A real mixture-of-experts run: deepseek_tiny (layer 0 dense), 3 steps, capacity drops on."""
    root = tmp_path_factory.mktemp("report_moe")
    out = str(root / "run")
    values = {"train": {"steps": 3, "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "device": "cpu",
                        "out_dir": out, "eval_every": 0, "eval_iters": 1, "save_every": 0},
              "model": {"moe": {"capacity_factor": 1.0, "z_loss_coeff": 0.001}},
              "optimizer": {"warmup_steps": 1}, "data": {"cache_dir": str(root / "cache"), "valid_fraction": 0.05},
              "logging": {"log_every": 1}}
    train(resolve(job_from_dict(values, model="deepseek_tiny"), 1), ParallelState.single_process())
    return out


def test_moe_panels_plot_each_layers_metrics(moe_run_dir):
    from parallel3d.moe_step import METRIC_NAMES

    records = _records(moe_run_dir)
    assert {m for *_, metrics in report.MOE_PANELS for m, _ in metrics} == set(METRIC_NAMES)
    fig = report.build_figure(records, moe_run_dir)
    by_title = {ax.get_title(): ax for ax in fig.axes}
    steps = [r["step"] for r in records]
    layers = sorted({k.split("/")[1] for k in records[0] if k.startswith("moe/")})
    assert layers == ["layer_1", "layer_2", "layer_3"]  # layer 0 is dense: no line for it
    for title, _, metrics in report.MOE_PANELS:
        lines = {line.get_label(): line for line in by_title[title].get_lines()}
        assert len(lines) == len(layers) * len(metrics), (title, sorted(lines))
        for layer in layers:
            for metric, suffix in metrics:
                line = lines[f"{layer}{suffix}"]
                assert list(line.get_xdata()) == steps
                assert list(line.get_ydata()) == [r[f"moe/{layer}/{metric}"] for r in records], (layer, metric)
    assert any(r["moe/layer_1/dropped_fraction"] > 0 for r in records)  # capacity 1.0 drops some slots
    # The dense run's six cells are unchanged; here 5 + 4 panels and the text panel fill a 4 x 3 grid.
    assert len(fig.axes) == 12 and sum(ax.axison for ax in fig.axes) == 9


def test_dense_run_has_no_moe_panels(run_dir):
    assert report.moe_panels(_records(run_dir)) == []


@contextlib.contextmanager
def _unwritable_run_dir(run_dir: str, tmp_path) -> typing.Iterator[str]:
    """A copy of ``run_dir`` the report cannot write into: a read-only bind mount (session 44's trial: as root,
    permission bits do not bind), a mode-0555 directory for another user; where neither can be had (a container
    without mount rights), the copy's ``report.png`` is a directory, so the default path is unwritable all the same."""
    source, mounted = tmp_path / "source", tmp_path / "read_only"
    shutil.copytree(run_dir, source)
    mounted.mkdir()
    bound = os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "--bind", str(source), str(mounted)], capture_output=True).returncode == 0
    if bound:
        try:
            if subprocess.run(["mount", "-o", "remount,bind,ro", str(mounted)], capture_output=True).returncode == 0:
                yield str(mounted)
                return
        finally:
            subprocess.run(["umount", str(mounted)], check=True)
    if os.geteuid() != 0:
        source.chmod(0o555)
    else:
        (source / "report.png").mkdir()
    yield str(source)


@pytest.mark.parametrize("case", ["--out in a missing directory", "--out a directory", "read-only run directory"])
def test_an_unwritable_output_is_one_line_naming_it_and_the_way_out(run_dir, tmp_path, capsys, case):
    """Session 44's trial: a read-only run directory gave ``error: [Errno 30] Read-only file system: '.../report.png'``
    (no word of ``--out``); each unwritable output is now one line naming the file and the flag to use, exit 2."""
    with contextlib.ExitStack() as stack:
        if case == "read-only run directory":
            where = stack.enter_context(_unwritable_run_dir(run_dir, tmp_path))
            args, path, way_out = [where], os.path.join(where, "report.png"), "pass --out FILE in a writable directory"
        else:
            path = str(tmp_path / "no_such_dir" / "r.png") if case.endswith("missing directory") else str(tmp_path)
            args, way_out = [run_dir, "--out", path], "pass another --out FILE"
        assert report.main(args) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot write the report to {path} (") and way_out in lines[0], lines[0]


def test_the_printed_path_is_the_file_written(run_dir, tmp_path, capsys):
    """``--out NAME`` without an extension: matplotlib writes ``NAME.png``, and the report printed ``NAME`` (no such
    file). Cases: with and without an extension, and another format matplotlib writes (svg)."""
    for given, written in (("picture", "picture.png"), ("picture.png", "picture.png"), ("picture.svg", "picture.svg")):
        target = tmp_path / given
        assert report.main([run_dir, "--out", str(target)]) == 0
        printed = capsys.readouterr().out.strip()
        assert printed == str(tmp_path / written) and os.path.isfile(printed), (given, printed)
        os.remove(printed)
