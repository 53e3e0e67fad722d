"""User-facing warnings: printed by the command-line tools as one clean line, ``warning: <message>``.

The framework warns through ``warn`` (category ``RunWarning``, a ``UserWarning``), so filters,
``python -W error`` and ``pytest.warns`` treat it as any warning. Python's own display adds the
framework's file path, line number and source line, which tell a user nothing about their run;
the entry points (``python -m parallel3d.train``, ``python -m parallel3d.export``) run inside
``one_line_warnings()``, which prints each ``RunWarning`` as the one line above and leaves every
other warning (torch's, a library's) as Python prints it.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Iterator, TextIO

PREFIX = "warning: "


class RunWarning(UserWarning):
    """Something a user should know about their run (damaged checkpoint skipped, no MFU, ...)."""


def warn(message: str) -> None:
    """Warn the user about their run (shown once per distinct message and call site, as Python does)."""
    warnings.warn(message, RunWarning, stacklevel=2)


def format_line(message: object) -> str:
    """The one line a ``RunWarning`` prints as (embedded newlines folded: one warning, one line)."""
    return PREFIX + " ".join(str(message).split("\n"))


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Inside: a ``RunWarning`` prints as ``format_line`` to stderr; filters and other warnings as before."""
    with warnings.catch_warnings():  # restores the display hook (and any filter change) on exit
        python_display = warnings.showwarning

        def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
            if issubclass(category, RunWarning):
                print(format_line(message), file=file or sys.stderr, flush=True)
            else:
                python_display(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield
