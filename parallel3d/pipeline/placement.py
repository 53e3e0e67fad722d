"""Where model chunks sit: which pipeline stage runs model chunk ``k``, as its local chunk ``c``.

The model is cut into ``p * v`` chunks, ``0 .. p*v - 1`` in forward order; every stage
holds ``v`` of them (its local chunks ``0 .. v-1``, in model order). Two shapes:

- ``loop`` (1F1B, gpipe, interleaved 1F1B, zb_h1; Narayanan et al. 2021): stage ``s``
  holds model chunks ``s, s + p, ..., s + (v-1) p``; activations leave the last stage's
  chunk ``c`` for the first stage's chunk ``c + 1``.
- ``v`` (ZB-V; Qi et al. 2024): the model runs down the stages and back up, so stage
  ``s`` holds chunks ``s`` and ``2p - 1 - s`` (for ``v > 2`` the zig-zag continues:
  even local chunks run down, odd ones up). The turns happen inside one stage: chunk
  ``p - 1`` hands its output to chunk ``p`` on stage ``p - 1`` without a message, and the
  first and the last model chunk both sit on stage 0.

``placement_for(schedule_name)`` names the shape each schedule runs on; everything that
maps chunks to stages (schedules, simulation, p2p peers, the trainer's chunk builder,
checkpoints' layer ranges) asks a ``ChunkPlacement`` instead of assuming a loop.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PLACEMENT_KINDS", "ChunkPlacement", "placement_for"]

PLACEMENT_KINDS = ("loop", "v")
V_SHAPED_SCHEDULES = ("zbv",)


@dataclass(frozen=True)
class ChunkPlacement:
    """``num_chunks`` local chunks on each of ``num_stages`` stages, laid out as ``kind``."""

    num_stages: int
    num_chunks: int = 1
    kind: str = "loop"

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENT_KINDS:
            raise ValueError(f"chunk placement {self.kind!r} is not one of {PLACEMENT_KINDS}")
        if self.num_stages < 1 or self.num_chunks < 1:
            raise ValueError(f"{self}: num_stages and num_chunks must be >= 1")

    @property
    def total(self) -> int:
        """Model chunks in all."""
        return self.num_stages * self.num_chunks

    def model_chunk(self, stage: int, chunk: int) -> int:
        """The model chunk that local chunk ``chunk`` of ``stage`` runs."""
        p = self.num_stages
        if self.kind == "v" and chunk % 2:
            return chunk * p + p - 1 - stage
        return chunk * p + stage

    def stage_and_chunk(self, model_chunk: int) -> tuple[int, int]:
        """(stage, local chunk) running ``model_chunk``."""
        p = self.num_stages
        chunk, offset = divmod(model_chunk, p)
        if self.kind == "v" and chunk % 2:
            return p - 1 - offset, chunk
        return offset, chunk

    def stage_of(self, model_chunk: int) -> int:
        return self.stage_and_chunk(model_chunk)[0]

    def chunks_of(self, stage: int) -> list[int]:
        """The model chunks ``stage`` holds, by local chunk."""
        return [self.model_chunk(stage, c) for c in range(self.num_chunks)]

    def local_previous(self, stage: int, chunk: int) -> int | None:
        """The local chunk of ``stage`` feeding ``chunk`` without a message (a turn of the V), else None."""
        k = self.model_chunk(stage, chunk)
        if k == 0 or self.stage_of(k - 1) != stage:
            return None
        return self.stage_and_chunk(k - 1)[1]

    def local_next(self, stage: int, chunk: int) -> int | None:
        """The local chunk of ``stage`` that ``chunk`` feeds without a message, else None."""
        k = self.model_chunk(stage, chunk)
        if k == self.total - 1 or self.stage_of(k + 1) != stage:
            return None
        return self.stage_and_chunk(k + 1)[1]


def placement_for(schedule: str, num_stages: int, num_chunks: int) -> ChunkPlacement:
    """The placement schedule ``schedule`` runs on."""
    return ChunkPlacement(num_stages, num_chunks, "v" if schedule in V_SHAPED_SCHEDULES else "loop")
