"""One stage's schedule compiled once into what the executor does at each step, all decided ahead.

``compile_plan`` turns a stage's action list (``schedules``) into ``PlannedStep``s: per
computation, the batch to post before it (sends with their source keys and peer ranks,
receives with their peers), the receives to post ahead of need, the receives it waits
for, and the computation itself with everything the executor would otherwise look up
per action: its ``(microbatch, chunk)`` key, its module, where its input comes from
(the token ids, a received activation, or the output of the chunk before it on this
stage: a turn of ZB-V), where its input gradient goes, whether its output is sent,
whether a ``B`` is split (its ``W`` comes later) and the ``grad_sync.prepare`` flag. The executor's hot loop then only indexes dicts by
precomputed keys and calls the backend (``engine``, ``forward_only``).

The batches are exactly ``actions.comm_plan``'s, which ``check_coalesced_progress``
proves deadlock-free: posting and waiting follow the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from torch import nn

from parallel3d.pipeline.actions import Action, comm_plan, split_backwards
from parallel3d.pipeline.placement import ChunkPlacement

__all__ = ["PlannedCompute", "PlannedStep", "compile_plan"]

Key = tuple[int, int]  # (microbatch, local chunk)


@dataclass(frozen=True)
class PlannedCompute:
    """One computation with its lookups resolved (see the module doc)."""

    action: Action
    kind: str
    key: Key
    microbatch: int
    module: nn.Module
    first: bool  # the model's first chunk: its input is the token ids
    last: bool  # the model's last chunk: it computes the loss
    local_input: Key | None  # F: its input is this stage's output of that key (no message)
    local_grad: Key | None  # B: its input gradient is that key's output gradient (no message)
    sends_output: bool  # F: the output leaves by message (its storage can be freed once sent)
    completes: bool  # B / W: the chunk's last of its kind (``grad_sync.prepare``)
    split: bool = False  # B: a split backward (its W is listed: ``actions.split_backwards``)


@dataclass(frozen=True)
class PlannedStep:
    """Post ``sends`` and ``posts`` as one batch, each of ``ahead`` as its own, wait for ``needs``, compute.

    ``communicates`` (any of the four non-empty) and ``received`` (each need with its key and
    whether it is an activation) are derived once here, not per step of the hot loop."""

    sends: tuple[tuple[Action, Key, int], ...]  # (action, key of what it sends, peer rank)
    posts: tuple[tuple[Action, int], ...]  # receives posted in the batch, with peer ranks
    ahead: tuple[tuple[Action, int], ...]
    needs: tuple[Action, ...]
    compute: PlannedCompute | None
    communicates: bool = field(init=False)
    received: tuple[tuple[Action, Key, bool], ...] = field(init=False)  # (need, its key, RECV_ACT?)

    def __post_init__(self) -> None:
        object.__setattr__(self, "communicates", bool(self.sends or self.posts or self.ahead or self.needs))
        object.__setattr__(self, "received", tuple((a, (a.microbatch, a.chunk), a.kind == "RECV_ACT")
                                                   for a in self.needs))


def compile_plan(actions: Sequence[Action], stage: int, place: ChunkPlacement, chunks: Sequence[nn.Module],
                 prefetch: int, peer: Callable[[Action], int]) -> list[PlannedStep]:
    """``stage``'s actions as ``PlannedStep``s (``chunks[c]`` runs local chunk ``c``; ``peer``: an
    action's peer rank)."""
    last_of: dict[tuple[str, int], Action] = {(a.kind, a.chunk): a for a in actions if a.kind in ("B", "W")}
    completing = set(last_of.values())
    split = split_backwards(actions)
    total = place.total
    plan = []
    for step in comm_plan(actions, prefetch):
        compute = None
        a = step.compute
        if a is not None:
            vs = place.model_chunk(stage, a.chunk)
            before, after = place.local_previous(stage, a.chunk), place.local_next(stage, a.chunk)
            compute = PlannedCompute(
                action=a, kind=a.kind, key=(a.microbatch, a.chunk), microbatch=a.microbatch, module=chunks[a.chunk],
                first=vs == 0, last=vs == total - 1,
                local_input=(a.microbatch, before) if a.kind == "F" and before is not None else None,
                local_grad=(a.microbatch, after) if a.kind == "B" and after is not None else None,
                sends_output=a.kind == "F" and vs < total - 1 and after is None,
                completes=a in completing,
                split=a.kind == "B" and (a.microbatch, a.chunk) in split,
            )
        sends = tuple((s, (s.microbatch, s.chunk), peer(s)) for s in step.batch if s.kind.startswith("SEND"))
        posts = tuple((r, peer(r)) for r in step.batch if r.kind.startswith("RECV"))
        plan.append(PlannedStep(sends, posts, tuple((r, peer(r)) for r in step.ahead), step.needs, compute))
    return plan
