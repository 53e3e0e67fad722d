"""Runs of global sequence positions, and how a local tensor lays them out.

A rank's local q/k/v hold a list of ``Segment``s back to back along the sequence dim
(the load-balanced share: two chunks; after an all-to-all: several ranks' shares). The
attention masks depend on global positions, so every block carries its segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """``length`` consecutive tokens starting at global position ``start``."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def total_length(segments: list[Segment]) -> int:
    return sum(seg.length for seg in segments)


def local_offsets(segments: list[Segment]) -> list[int]:
    """Where each segment starts in the local tensor (segments are stored back to back)."""
    offsets, at = [], 0
    for seg in segments:
        offsets.append(at)
        at += seg.length
    return offsets


def split_segments(segments: list[Segment], max_length: int) -> list[Segment]:
    """The same tokens in the same order, cut into segments of at most ``max_length``."""
    out = []
    for seg in segments:
        for start in range(seg.start, seg.end, max_length):
            out.append(Segment(start, min(max_length, seg.end - start)))
    return out


def coalesced_order(segments: list[Segment]) -> tuple[list[int], list[Segment]]:
    """``(order, runs)``: the segment indices sorted by position, and the maximal runs of
    consecutive positions that order forms (one run for a whole sequence)."""
    order = sorted(range(len(segments)), key=lambda i: segments[i].start)
    runs: list[Segment] = []
    for i in order:
        seg = segments[i]
        if runs and runs[-1].end == seg.start:
            runs[-1] = Segment(runs[-1].start, runs[-1].length + seg.length)
        else:
            runs.append(seg)
    return order, runs


def reorder(x: torch.Tensor, segments: list[Segment], order: list[int], seq_dim: int) -> torch.Tensor:
    """``x``'s segments (laid out as ``segments``) concatenated in ``order`` (differentiable;
    ``x`` itself when the order changes nothing)."""
    if order == list(range(len(segments))):
        return x
    offsets = local_offsets(segments)
    parts = [x.narrow(seq_dim, offsets[i], segments[i].length) for i in order]
    return parts[0] if len(parts) == 1 else torch.cat(parts, seq_dim)


def inverse_order(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, i in enumerate(order):
        inverse[i] = position
    return inverse
