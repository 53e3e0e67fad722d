"""Parameters and gradient synchronisation of layouts that use different ZeRO stages.

``parallel.expert_zero_stage`` lets the routed experts' layout (reduced over ``edp``) use
another stage than the dense layout (``dp_cp``). Each stage's layouts get their own
``params`` / ``grad_sync`` strategy object (built on a sub-list of the layouts); ``MixedParams``
and ``MixedGradSync`` present them to ``ZeroOptimizer`` under the optimizer's global layout
indices. Invariant: global layout ``g`` is layout ``local[g]`` of part ``part[g]``; every call
the optimizer, the engine or a checkpoint makes reaches each part in part order on every rank,
so all ranks issue the same collectives in the same order.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch

from parallel3d.zero.buffers import Bucket, BufferLayout


class _Index:
    """Global layout index -> (part, local index)."""

    def __init__(self, groups: list[list[int]]) -> None:
        self.where = {g: (k, i) for k, members in enumerate(groups) for i, g in enumerate(members)}
        self.groups = groups


class MixedParams:
    """Several ``ReplicatedParams`` / ``ShardedParams`` as one (module doc)."""

    def __init__(self, parts: list[Any], groups: list[list[int]], layouts: list[BufferLayout]) -> None:
        self.parts, self._index, self.layouts = parts, _Index(groups), layouts

    def piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        k, i = self._index.where[group]
        return self.parts[k].piece(i, bucket)

    def publish(self, *, asynchronous: bool = False) -> None:
        for p in self.parts:
            p.publish(asynchronous=asynchronous)

    def finish(self) -> None:
        for p in self.parts:
            p.finish()

    @property
    def gathers_in_flight(self) -> int:
        return sum(p.gathers_in_flight for p in self.parts)

    def release_all(self) -> None:
        for p in self.parts:
            p.release_all()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        with ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.gathered())
            yield

    def storage_tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.storage_tensors()]

    def global_key(self, part: Any, key: tuple[int, int]) -> tuple[int, int]:
        """A part's (local layout, bucket) key in global layout indices."""
        return self._index.groups[self.parts.index(part)][key[0]], key[1]

    def grad_consumed(self, param: torch.nn.Parameter, is_last_microbatch: bool) -> None:
        for p in self.parts:
            if hasattr(p, "grad_consumed"):
                p.grad_consumed(param, is_last_microbatch)

    def grads_finalized(self) -> None:
        for p in self.parts:
            if hasattr(p, "grads_finalized"):
                p.grads_finalized()


class MixedGradSync:
    """Several ``GradSync`` strategies as one; observers hear of every part's gradients and of
    ``finalize`` once, after every part has finalized."""

    def __init__(self, parts: list[Any], groups: list[list[int]]) -> None:
        self.parts, self._index = parts, _Index(groups)
        self._observers: list[Any] = []
        self._told = False

    def prepare(self, is_last_microbatch: bool) -> None:
        for p in self.parts:
            p.prepare(is_last_microbatch)

    def finalize(self) -> None:
        for p in self.parts:
            p.finalize()
        if not self._told:
            self._told = True
            for obs in self._observers:
                obs.grads_finalized()

    @property
    def finalized(self) -> bool:
        return all(p.finalized for p in self.parts)

    def add_observer(self, observer: Any) -> None:
        """``observer`` hears of every part's consumed gradients (stage 3 counts a unit's gradients
        whichever stage reduces them) and of ``finalize``."""
        self._observers.append(observer)
        relay = _ConsumedRelay(observer)
        for p in self.parts:
            p.add_observer(relay)

    def reset(self) -> None:
        self._told = False
        for p in self.parts:
            p.reset()

    def zero_grad(self) -> None:
        self._told = False
        for p in self.parts:
            p.zero_grad()

    def remove_hooks(self) -> None:
        for p in self.parts:
            p.remove_hooks()

    def grad_piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        k, i = self._index.where[group]
        return self.parts[k].grad_piece(i, bucket)

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.gradient_tensors()]

    def staging_buffers(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.staging_buffers()]

    def main_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        for p in self.parts:
            if p.holds(param):
                return p.main_grad(param)
        raise KeyError("main_grad: the parameter is not in this optimizer")


class _ConsumedRelay:
    """Passes a part's consumed gradients on; ``finalize`` is told by ``MixedGradSync`` itself."""

    def __init__(self, observer: Any) -> None:
        self.observer = observer

    def grad_consumed(self, param: torch.nn.Parameter, is_last_microbatch: bool) -> None:
        self.observer.grad_consumed(param, is_last_microbatch)

    def grads_finalized(self) -> None:
        pass
