"""Keep the two copies of a tied input/output embedding identical under pipeline parallelism.

With pp > 1 and tied embeddings (GPT), the first stage holds the word embedding
and the last stage a copy used by the head; both parameters carry
``tied_embedding=True`` (see ``parallel3d.param_meta``). Summing their
gradients over the topology's ``embedding`` group (first + last stage of each
pipeline) every step gives both copies the full gradient, so identical
optimizer updates keep them identical. With pp == 1 the group has one rank and
this is a no-op.

``TiedGradFinalizer`` is the pipeline engine's gradient finaliser when no ZeRO
optimizer provides one (ZeRO's ``GradSync.finalize`` does the same sum on its
reduced pieces): one owner, called once per step after the last send.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from parallel3d import comm
from parallel3d.param_meta import is_tied_embedding

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def tied_embedding_params(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Parameters flagged ``tied_embedding`` in ``modules``, each once, in a fixed order."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for _, param in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if is_tied_embedding(param) and id(param) not in seen:
                seen.add(id(param))
                out.append(param)
    return out


def sync_tied_embedding_grads(modules: Iterable[torch.nn.Module], pstate: "ParallelState") -> int:
    """Sum ``.grad`` of tied-embedding parameters over the ``embedding`` group; returns how many.

    Call on every rank of the job after the step's backwards; middle stages (not in
    an embedding group) and pp == 1 return at once. A missing ``.grad`` counts as zero.
    """
    if not pstate.in_embedding_group or comm.group_size(pstate, "embedding") == 1:
        return 0
    params = tied_embedding_params(modules)
    if not params:
        return 0  # untied model (llama): nothing to keep in step
    if len(params) > 1:
        raise ValueError(
            f"rank {pstate.rank} (stage {pstate.coord('pp')}) holds {len(params)} tied-embedding parameters; "
            f"an end stage of a tied model must hold exactly one (the word embedding or its copy)"
        )
    param = params[0]
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    comm.all_reduce(param.grad, pstate, "embedding")
    return 1


class TiedGradFinalizer:
    """The engine's ``grad_sync`` without ZeRO: nothing to prepare; ``finalize`` sums tied-embedding grads."""

    def __init__(self, modules: Iterable[torch.nn.Module], pstate: "ParallelState") -> None:
        self.modules = list(modules)
        self.pstate = pstate

    def prepare(self, is_last_microbatch: bool) -> None:
        """Plain ``.grad`` accumulation needs no announcement."""

    def finalize(self) -> None:
        sync_tied_embedding_grads(self.modules, self.pstate)
