"""``parallel3d.report`` probes the output's place once (session 46 review): before the figure is drawn, not again
when it is written; a write that fails after the probe passed is still one line naming the file."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from parallel3d import report


@pytest.fixture
def run_dir(tmp_path) -> str:
    """A run directory with a few records of the keys a training run logs (the report only reads them)."""
    out = tmp_path / "run"
    out.mkdir()
    with open(out / "metrics.jsonl", "w") as fh:
        for step in (1, 2, 3):
            fh.write(json.dumps({"step": step, "loss": 6.0 - step / 10, "lr": 1e-3, "tokens_per_sec": 1000.0}) + "\n")
    return str(out)


@pytest.fixture
def probes(monkeypatch) -> list[str]:
    """The directories ``tempfile.TemporaryFile`` was opened in (the real function still runs)."""
    seen: list[str] = []
    real = tempfile.TemporaryFile

    def counting(*args, **kwargs):
        seen.append(kwargs.get("dir"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", counting)
    return seen


@pytest.mark.parametrize("given", [False, True], ids=["default-out", "given-out"])
def test_the_output_place_is_probed_once(run_dir, tmp_path, probes, given):
    """HTML (no figure to draw: cheap); the PNG path goes through the same two calls, counted in the test below."""
    out = str(tmp_path / "picture.html") if given else None
    path = report.write_report(run_dir, out, "html")
    assert os.path.isfile(path) and os.path.getsize(path) > 0
    assert probes == [os.path.dirname(os.path.abspath(path))], probes


def test_a_write_that_fails_after_the_probe_is_one_line_naming_the_file(run_dir, tmp_path, probes):
    """``--out NAME`` is written as ``NAME.png``: the probe of ``NAME``'s directory passes, the write into the
    directory ``NAME.png`` fails, and that failure is still the one ``UnwritableOutput`` line."""
    pytest.importorskip("matplotlib")
    (tmp_path / "picture.png").mkdir()
    with pytest.raises(report.UnwritableOutput) as err:
        report.write_report(run_dir, str(tmp_path / "picture"), "png")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"cannot write the report to {tmp_path / 'picture.png'} (")
    assert message.endswith("pass another --out FILE") and len(probes) == 1
