"""User-facing warnings print as one clean line from the command-line tools; they stay Python warnings."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from parallel3d import user_warnings
from parallel3d.user_warnings import RunWarning, one_line_warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _displayed(code: str) -> list[str]:
    """stderr of a fresh interpreter running ``code`` (pytest records warnings instead of displaying them)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.splitlines()


def test_the_cli_context_displays_a_run_warning_as_one_line_and_others_as_python_does():
    err = _displayed(
        "import warnings\n"
        "from parallel3d import user_warnings\n"
        "with user_warnings.one_line_warnings():\n"
        "    user_warnings.warn('checkpoint /x/step_2 is damaged, not resuming from it:\\nbad crc')\n"
        "    warnings.warn(\"a library's own warning\", FutureWarning)\n"
        "user_warnings.warn('after the context: as Python displays it')\n")
    assert err[0] == "warning: checkpoint /x/step_2 is damaged, not resuming from it: bad crc"
    assert err[1] == "<string>:5: FutureWarning: a library's own warning"
    assert err[2] == "<string>:6: RunWarning: after the context: as Python displays it"
    assert len(err) == 3


def test_filters_and_pytest_warns_still_see_it():
    with pytest.warns(RunWarning, match="no peak TFLOP/s"), one_line_warnings():
        user_warnings.warn("no peak TFLOP/s known for device 'cpu'")
    with warnings.catch_warnings(), one_line_warnings():
        warnings.simplefilter("error", RunWarning)
        with pytest.raises(RunWarning):
            user_warnings.warn("an error under -W error")
    assert issubclass(RunWarning, UserWarning)
