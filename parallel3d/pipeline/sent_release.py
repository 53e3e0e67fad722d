"""Which sent activations a stage has freed, computation by computation, where sends complete only when waited.

The engine swaps a sent chunk output's data for a placeholder as its batch is posted (``step_run.communicate``);
the storage goes once the p2p layer drops the batch, which ``PipelineP2P.release_sent`` does after every ``F``
for the batches known complete. On a backend whose Works say they are done only from a blocking ``wait`` (plain
gloo, and the dry run's fake backend without NCCL's semantics), a batch is known complete once a receive of it was
taken (its whole batch waited). Interleaved and ZB-V stages therefore free a sent output only when a later receive
shares its batch: ZB-V's first chunk sends in the same batch as the head chunk's receive, which its ``F`` waits for
(fuzz case 2044). Single-chunk schedules block on their activation sends after each forward instead
(``engine._wait_for_sent_activations``): not modelled here, the planner's own rule counts them.

Invariant: the batches are ``actions.comm_plan``'s for the same actions and ``prefetch`` (what the engine posts:
``step_plan.compile_plan``); nothing here decides a batch. NCCL's asynchronous completion is not modelled (the
planner keeps its own rule there: ``planning.activations.kept_chunk_outputs``).
"""

from __future__ import annotations

from typing import Sequence

from parallel3d.pipeline.actions import Action, comm_plan

__all__ = ["released_sends"]

Key = tuple[int, int]  # (microbatch, local chunk)


def released_sends(actions: Sequence[Action], prefetch: int) -> list[tuple[Key, ...]]:
    """Per computation of ``actions`` (one stage's list of a multi-chunk schedule), in order: the ``(microbatch,
    chunk)`` whose activation send the engine's ``release_sent`` after it releases (empty after a ``B`` or ``W``:
    the engine releases after forwards only). ``prefetch``: the engine's ``prefetch_recvs``."""
    batch_of: dict[Action, int] = {}  # a posted receive -> its batch
    sending: dict[int, list[Key]] = {}  # a batch with activation sends not yet released -> their keys
    complete: set[int] = set()
    batches = 0
    out: list[tuple[Key, ...]] = []
    for step in comm_plan(actions, prefetch):
        if step.batch:
            sent = [(a.microbatch, a.chunk) for a in step.batch if a.kind == "SEND_ACT"]
            if sent:
                sending[batches] = sent
            batch_of.update((a, batches) for a in step.batch if a.kind.startswith("RECV"))
            batches += 1
        for receive in step.ahead:  # each a batch of its own
            batch_of[receive] = batches
            batches += 1
        complete.update(batch_of.pop(a) for a in step.needs)  # taking a receive waits for its whole batch
        if step.compute is None:
            continue
        if step.compute.kind != "F":
            out.append(())
            continue
        done = [b for b in sending if b in complete]
        out.append(tuple(key for b in done for key in sending.pop(b)))
    return out
