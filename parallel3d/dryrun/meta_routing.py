"""MoE layers on meta tensors: routing assumed balanced, so the step's token counts exist.

A MoE layer's token exchange sizes depend on the routing (data): the per-expert counts are
exchanged over ep and etp and read to the host once per dispatch (``parallel3d.moe.collectives.
to_host``), and those host integers size the all-to-alls and the expert GEMMs. On meta tensors
there are no counts, so the dry run assumes **balanced routing**: each rank routes its
``T * k`` slots evenly over the ``E`` experts (expert ``g`` gets ``floor(N(g+1)/E) - floor(Ng/E)``
of ``N = T k``, so they sum to ``N``), every rank of the grid holds the same ``T`` tokens, and
nothing is dropped (a capacity factor >= 1 keeps every slot of a balanced routing; below 1 the
dry run still moves every slot, an over-count it states). A real step's counts differ from step
to step; the count exchanges themselves (their sizes are fixed) are the real ones.

``balanced_routing_on_meta()``, for the duration of a dry-run step:
- ``AllToAllDispatcher.dispatch`` / ``AllGatherDispatcher.dispatch`` on meta indices run their own
  code, collectives and all, with the host read answered by the balanced counts in the layout
  that dispatcher reads (sent ``[E]`` then received ``[member][src][e]``; or
  ``[member][src][1 + E]``), checked against the length it reads;
- the capacity path's token-count gather (``gather_sizes``) answers ``T`` for every member;
- ``aten.bincount`` on meta (no meta kernel in torch) gives a meta ``[minlength]`` tensor; a copy of
  a meta tensor to the host gives zeros (the step's load metrics read them); ``torch._grouped_mm``'s
  meta kernel, which takes only CUDA's bf16, gets fp32 operands as bf16 (the shapes are the same).
Invariant: calls on real tensors run unchanged; everything is restored on exit.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel3d.moe import capacity as capacity_module
from parallel3d.moe import dispatcher_allgather, dispatcher_alltoall
from parallel3d.moe.collectives import all_gather_counts, group_size

_aten = torch.ops.aten
ASSUMPTION = "MoE token counts: balanced routing assumed (every expert gets T*k/E slots of every rank, no drops)"


def balanced_split(slots: int, experts: int) -> list[int]:
    """``slots`` spread evenly over ``experts`` (the first ones get no more than one extra)."""
    return [slots * (g + 1) // experts - slots * g // experts for g in range(experts)]


def alltoall_host_counts(layout: Any, tokens: int, top_k: int) -> list[int]:
    """What ``AllToAllDispatcher`` reads to the host under balanced routing: sent ``[E]``, received
    ``[member][src][e]`` (every source sends this rank's experts what this rank sends them)."""
    split = balanced_split(tokens * top_k, layout.num_experts)
    mine = split[layout.first_expert:layout.first_expert + layout.local_experts]
    return split + mine * (layout.ep * layout.etp)


def allgather_host_counts(layout: Any, tokens: int, top_k: int) -> list[int]:
    """What ``AllGatherDispatcher`` reads: ``[member][src][1 + E]`` (tokens, then per-expert slots)."""
    return ([tokens] + balanced_split(tokens * top_k, layout.num_experts)) * (layout.ep * layout.etp)


class _MetaCounts(TorchDispatchMode):
    """``bincount`` on meta -> meta ``[minlength]``; a meta tensor copied to the host -> zeros."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is _aten.bincount.default and args[0].device.type == "meta":
            length = int(kwargs.get("minlength", args[2] if len(args) > 2 else 0))
            if length < 1:
                raise RuntimeError("dry run: bincount on meta needs minlength (its length is data otherwise)")
            dtype = torch.float64 if (kwargs.get("weights", args[1] if len(args) > 1 else None)) is not None \
                else torch.int64
            return torch.empty(length, dtype=dtype, device="meta")
        if func is _aten._grouped_mm.default and args[0].device.type == "meta" and args[0].dtype != torch.bfloat16:
            # The meta kernel checks CUDA's dtype rule (bf16); CPU runs fp32 too. Shapes do not depend on it.
            a, b, *rest = args
            return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs).to(a.dtype)
        if func is _aten._to_copy.default and args[0].device.type == "meta" \
                and torch.device(kwargs.get("device") or "meta").type != "meta":
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        return func(*args, **kwargs)


def _answering_to_host(module: Any, values: list[int]) -> Callable:
    def to_host(t: torch.Tensor, syncs: Any) -> list[int]:
        if t.device.type != "meta":
            return original(t, syncs)
        if t.numel() != len(values):
            raise RuntimeError(f"dry run: {module.__name__} reads {t.numel()} counts, the balanced routing has "
                               f"{len(values)} (the dispatcher's count layout changed; update dryrun.meta_routing)")
        if syncs is not None:
            syncs.count += 1
        return list(values)

    original = module.to_host
    return to_host


def _balanced_dispatch(original: Callable, module: Any, counts: Callable[[Any, int, int], list[int]]) -> Callable:
    def dispatch(self, tokens, indices, keep=None, capacity=None):
        if indices.device.type != "meta" or getattr(self, "pad_to_capacity", False):
            return original(self, tokens, indices, keep, capacity)  # pad-to-capacity: sizes known, no host read
        saved = module.to_host
        module.to_host = _answering_to_host(module, counts(self.layout, indices.shape[0], indices.shape[1]))
        try:
            return original(self, tokens, indices, keep, capacity)
        finally:
            module.to_host = saved

    return dispatch


def _balanced_gather_sizes(original: Callable) -> Callable:
    def gather_sizes(local: int, group, device, *, kind: str, syncs=None) -> list[int]:
        if torch.device(device).type != "meta" or group_size(group) == 1:
            return original(local, group, device, kind=kind, syncs=syncs)
        all_gather_counts(torch.tensor([local], dtype=torch.int64, device=device), group, kind=kind)  # its message
        if syncs is not None:
            syncs.count += 1
        return [local] * group_size(group)

    return gather_sizes


@contextmanager
def balanced_routing_on_meta() -> Iterator[None]:
    """Inside: MoE layers run on meta tensors with balanced routing (module doc)."""
    patches = [(dispatcher_alltoall.AllToAllDispatcher, "dispatch",
                _balanced_dispatch(dispatcher_alltoall.AllToAllDispatcher.dispatch, dispatcher_alltoall,
                                   alltoall_host_counts)),
               (dispatcher_allgather.AllGatherDispatcher, "dispatch",
                _balanced_dispatch(dispatcher_allgather.AllGatherDispatcher.dispatch, dispatcher_allgather,
                                   allgather_host_counts)),
               (capacity_module, "gather_sizes", _balanced_gather_sizes(capacity_module.gather_sizes))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    with ExitStack() as stack:
        for obj, name, new in patches:
            setattr(obj, name, new)
        stack.callback(lambda: [setattr(obj, name, old) for obj, name, old in reversed(saved)])
        stack.enter_context(_MetaCounts())
        yield
