"""Bytes each rank sends, per (group kind, op): the counter behind the ``comm_bytes_*`` metrics.

The byte convention (what one op adds) is ``comm``'s; this module only keeps the sums.
"""

from __future__ import annotations

from collections import defaultdict


class CommStats:
    """Bytes sent by this rank, keyed by (group kind, op)."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, kind: str, op: str, nbytes: float) -> None:
        self.bytes[(kind, op)] += int(nbytes)
        self.calls[(kind, op)] += 1

    def total(self, kind: str | None = None) -> int:
        return sum(v for (k, _), v in self.bytes.items() if kind is None or k == kind)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (k, _), v in self.bytes.items():
            out[k] += v
        return dict(out)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
