"""Reading ``metrics.jsonl``: one JSON object per line, each written whole by ``metrics.JsonlSink``.

A run killed in the middle of a write (SIGKILL, a full disk, a lost node) can leave its last line cut
short, or a tail of zero bytes; a reader watching a live run can meet a line being written. Neither
may stop a resume or a report. Invariant: ``parse_record`` is the one test of a line, and every line it
refuses is named to the user (``skipped_message``), never dropped silently.
"""

from __future__ import annotations

import json
from typing import Any


def parse_record(line: str) -> dict[str, Any] | None:
    """The JSON object on ``line``; None for a line that is not one (cut short, zero bytes, garbage)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_lines(path: str) -> list[tuple[int, str, dict[str, Any] | None]]:
    """``(line number, line, its record or None)`` for every non-blank line of ``path``."""
    with open(path, encoding="utf-8", errors="replace") as fh:  # a torn multi-byte character is a bad line
        return [(number, line, parse_record(line)) for number, line in enumerate(fh, 1) if line.strip()]


def read_records(path: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of ``path`` in order, and the numbers of the lines that held none."""
    lines = read_lines(path)
    return [r for _, _, r in lines if r is not None], [n for n, _, r in lines if r is None]


def skipped_message(path: str, bad_lines: list[int]) -> str:
    shown = ", ".join(str(n) for n in bad_lines[:5]) + (", ..." if len(bad_lines) > 5 else "")
    return (f"{path}: skipped {len(bad_lines)} line(s) that are not a JSON record (line {shown}; a write cut "
            f"short by a killed run?)")
