"""User-facing warnings: printed by the command-line tools as one clean line, ``warning: <message>``.

The framework warns through ``warn`` (category ``RunWarning``, a ``UserWarning``), so filters,
``python -W error`` and ``pytest.warns`` treat it as any warning. Python's own display adds the
framework's file path, line number and source line, which tell a user nothing about their run;
the entry points (``python -m parallel3d.train``, ``python -m parallel3d.export``) run inside
``one_line_warnings()``, which formats each ``RunWarning`` as the one line above when it is
displayed and leaves every other warning (torch's, a library's) as Python prints it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

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
    """Inside, a displayed ``RunWarning`` reads ``format_line``; other warnings, filters, and whoever
    records warnings instead of displaying them (``pytest.warns``) are as before."""
    python_format = warnings.formatwarning

    def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                       line: str | None = None) -> str:
        if issubclass(category, RunWarning):
            return format_line(message) + "\n"
        return python_format(message, category, filename, lineno, line)

    warnings.formatwarning = format_warning
    try:
        yield
    finally:  # (catch_warnings restores filters and the display hook, not the formatter)
        warnings.formatwarning = python_format
