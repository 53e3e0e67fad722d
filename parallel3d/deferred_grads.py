"""Weight-gradient work deferred from a backward to later: the mechanism zero-bubble schedules run on.

A zero-bubble pipeline splits a backward in two (Qi et al. 2023): ``B`` computes the
input gradient the previous stage waits for, ``W`` the weight gradients nobody waits
for. As in the authors' Megatron fork, the layers make the split, not a walk over the
autograd graph: during ``B`` a layer's autograd ``Function`` computes its input
gradient and, instead of its weight-gradient GEMMs, queues a closure over what those
need (its saved input and its output gradient); ``W`` runs the queue. ``B`` + ``W`` is
then one backward's work.

Protocol (any layer with weights and its own ``autograd.Function`` can join; the
linear layers of ``parallel3d.tensor_parallel`` do, and so can ring attention or
grouped-GEMM experts):

- The layer marks each parameter it alone reads ``wgrad_deferrable``
  (``param_meta.set_meta``). ``B`` accumulates only the unmarked parameters' gradients
  (``backward_inputs``): marked ones never reach their ``AccumulateGrad`` in ``B``, so
  their hooks do not fire there.
- ``ParallelState.weight_grads`` is this process's ``WeightGradDeferral``. It is idle
  except inside ``with deferral.collecting() as work:``, which the pipeline engine
  opens around a ``B``.
- In ``backward`` the layer calls ``deferral.defer(params, compute, holds)``:
  ``compute()`` returns one gradient (or ``None``) per entry of ``params``; ``holds``
  are the tensors the closure keeps alive (memory accounting; and the engine keeps a stage
  input's data for ``W`` only when it is listed there, ``step_run._spent``: list every one). True: queued, the layer
  returns ``None`` for those inputs. False (no ``B`` open, or unmarked parameters): the
  layer calls ``compute()`` itself, so outside a split backward nothing changes.
- ``work.run()`` (``W``) calls the queued closures, last queued first, and hands every
  gradient to its parameter as autograd's ``AccumulateGrad`` would after a plain backward,
  so ``.grad`` accumulation, tensor and post-accumulate-grad hooks (ZeRO's buckets, fp32 main
  grads) and tied-embedding copies see it unchanged, during ``W``. Directly by default
  (``parallel3d.leaf_grads``: each closure's gradients accumulated, their hooks called, right
  after its GEMMs), without entering autograd's engine, whose entry is a fixed cost per ``W``.
  Through autograd when a parameter is one ``leaf_grads`` does not take (a non-leaf, a
  non-contiguous one, one listed twice) or with ``direct=False``: one small
  backward whose single node returns every gradient to its parameter's ``AccumulateGrad``
  (inside ``deferral.reusing_graphs()``, which the engine opens around a step, that graph is
  built once per list of parameters, i.e. per chunk, and rerun; ``_Anchors``). Which of the two
  a list takes is likewise worked out once per step (``_Route``).

Unmarked parameters (norms, embeddings, a row-parallel bias added after its
reduction) get their gradients in ``B``, as cheap non-GEMM work. A closure may
communicate (sequence parallel re-gathers its input): every rank of the group runs
``W`` at the same point of the same schedule. Exactness: a closure computes the same
expression as the undeferred backward would, and each gradient is accumulated once,
so ``B`` + ``W`` leaves bitwise the gradients of one backward.

Why last in, first out: ``B`` walks the layers backwards, so the last closures it queued
read the tensors it touched last (the chunk's first layers' inputs and output gradients),
which are still in cache when ``W`` starts; first in, first out would begin with the
tensors touched longest ago. The order of independent weight gradients changes no value,
and every rank of a data-parallel group runs the same order (hooks launch the same
collectives in the same order).
"""

from __future__ import annotations

import enum
from contextlib import contextmanager
from itertools import repeat
from operator import is_
from typing import Callable, Iterable, Iterator, Sequence

import torch

from parallel3d.host_heap import retain_freed_memory
from parallel3d.leaf_grads import accumulate_each, all_accepted
from parallel3d.param_meta import is_wgrad_deferrable

__all__ = ["DeferredWeightGrads", "WeightGradDeferral", "backward_inputs"]

GradCompute = Callable[[], Sequence["torch.Tensor | None"]]
Params = Sequence["torch.Tensor | None"]
Key = tuple[tuple[int, ...], ...]  # a queue's key: one ``_key_of`` part per closure, in queued order


def backward_inputs(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters a ``B`` must accumulate itself: those needing grads and not deferrable."""
    return [p for p in params if p.requires_grad and not is_wgrad_deferrable(p)]


class DeferredWeightGrads:
    """The weight-gradient work one ``B`` queued; ``run`` it exactly once (``W``).

    Also the ``B`` block itself (``WeightGradDeferral.collecting``): entering it opens its deferral
    on it, leaving closes it. A plain class, not a generator context manager, and slots: a ``B`` pays
    for every object and frame it makes, at several times their warm price (module doc of ``leaf_grads``).
    """

    __slots__ = ("_queue", "_key", "held", "_anchors", "direct", "_owner")

    def __init__(self, anchors: "_Anchors | None" = None, direct: bool = True,
                 owner: "WeightGradDeferral | None" = None) -> None:
        self._queue: list[tuple[Params, GradCompute]] = []
        # The queue's key (``_key_of`` of its parameters, in queued order), built as ``B`` queues: there each
        # parameter was just read by its layer's input-gradient GEMM; at ``W``, reading them cold cost about
        # 12 us per W (2026-12-07, hidden 128, a middle chunk, one thread; docs/benchmarks.md, "A leaner split path").
        # One part per closure: the closure boundaries are part of the key (``_key_of``).
        self._key: list[tuple[int, ...]] = []
        self.held: list[torch.Tensor] = []  # what the queued closures keep alive
        self._anchors = anchors if anchors is not None else _Anchors(0)
        self.direct = direct
        self._owner = owner  # the deferral this B block opens (collecting)

    def __len__(self) -> int:
        return len(self._queue)

    def __enter__(self) -> "DeferredWeightGrads":
        owner = self._owner
        if owner is None:
            raise RuntimeError("a DeferredWeightGrads opened as a B block needs its WeightGradDeferral")
        if owner._open is not None:
            raise RuntimeError("WeightGradDeferral.collecting() is already open (B blocks do not nest)")
        owner._open = self
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner._open = None  # type: ignore[union-attr]

    def add(self, params: Params, compute: GradCompute, key_part: tuple[int, ...],
            holds: Sequence[torch.Tensor]) -> None:
        """Queue one closure, with its part of the queue's key (``_key_of``) and the tensors it keeps alive."""
        self._queue.append((params, compute))
        self._key.append(key_part)
        self.held.extend(holds)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether a queued closure keeps ``tensor`` itself (the object, not an equal one) alive."""
        return any(map(is_, self.held, repeat(tensor)))

    def run(self) -> None:
        """Compute every queued gradient and accumulate each into its parameter as autograd would
        (hooks fire now): directly where ``leaf_grads`` takes every parameter, else through autograd."""
        queue, key = self._queue, tuple(self._key)
        self._queue, self._key, self.held = [], [], []
        anchors = self._anchors
        route = anchors.route(key, queue)
        if route is _Route.NONE:
            return
        if self.direct and route is _Route.ACCEPTED:
            _run_direct(queue)
        else:
            anchors.run(queue, key)


def _params(queue: list[tuple[Params, GradCompute]]) -> list["torch.Tensor | None"]:
    """The queue's parameters in W's order (last in, first out: see the module doc)."""
    return [p for ps, _ in reversed(queue) for p in ps]


def _key_of(params: Params) -> tuple[int, ...] | None:
    """One closure's part of its queue's key: each parameter's identity and whether it requires grad
    (0: no parameter; negative: no grad needed); None where no parameter is ``wgrad_deferrable`` (the
    layer computes its own gradients). A queue's key, the tuple of its parts in queued order, is
    what ``_Anchors`` keys a W's graph and its route on. The parts stay apart because the key must fix
    ``_params``' order (the last closure first; a kept graph's inputs): ``(a, b)`` in one closure and
    ``(a,)``, ``(b,)`` in two list the same parameters in queued order but are (a, b) and (b, a) there.

    One loop for the marks and the key: ``defer`` runs it in ``B``, right after each deferring layer's
    input-gradient GEMM, where every Python frame costs several times its warm price (a list
    comprehension is a frame of its own in Python 3.11; docs/benchmarks.md, session 44)."""
    part = [0] * len(params)
    present = marked = 0
    for i, p in enumerate(params):
        if p is None:
            continue
        present += 1
        if is_wgrad_deferrable(p):
            marked += 1
        part[i] = id(p) if p.requires_grad else -id(p)
    if not marked:
        return None
    if marked != present:
        # B accumulates only unmarked parameters: a marked one computed here would be lost
        raise ValueError("one deferred weight-gradient computation mixes wgrad_deferrable and other parameters")
    return tuple(part)


class _Route(enum.Enum):
    """How W hands a queue's gradients over: nothing needs one; ``leaf_grads`` takes every parameter
    (``all_accepted``: W may go direct); or only autograd can (W's one-node graph)."""

    NONE = 0
    ACCEPTED = 1
    AUTOGRAD = 2


def _take(params: Params, compute: GradCompute) -> Sequence["torch.Tensor | None"]:
    got = compute()
    if len(got) != len(params):
        raise ValueError(f"a deferred weight-gradient closure returned {len(got)} gradients for {len(params)} parameters")
    return got


def _run_direct(queue: list[tuple[Params, GradCompute]]) -> None:
    """W without autograd's engine (``leaf_grads``): each closure, last queued first, then its gradients
    accumulated and their hooks called at once, in the closure's parameter order, with grad mode off as
    in a backward. Every rank runs the same queue, so hooks launch the same collectives in the same order."""
    with torch.no_grad():
        while queue:
            # Off the queue before it runs: its input and output gradient go as soon as its GEMMs are done,
            # and its gradients once accumulated (the next closure reuses that memory).
            params, compute = queue.pop()
            got = _take(params, compute)
            del compute
            accumulate_each(params, got)
            got = None  # an added (not adopted) gradient's memory is free for the next closure


class _RunQueue(torch.autograd.Function):
    """A one-node graph whose backward runs the queue in ``slot[0]`` and returns each parameter's gradient.

    Autograd hands those gradients straight to the parameters' ``AccumulateGrad`` nodes, as
    in a plain backward (``torch.autograd.backward`` on gradient edges would keep a reference
    to each, so the first accumulation of a step could not adopt it and would copy it).
    """

    @staticmethod
    def forward(ctx, slot, *params):  # type: ignore[override]
        ctx.slot = slot
        return torch.zeros(())

    @staticmethod
    def backward(ctx, _):  # type: ignore[override]
        queue, ctx.slot[0] = ctx.slot[0], None
        grads: list[torch.Tensor | None] = []
        while queue:
            # Taken off the queue (the last queued first): each closure's input and output gradient
            # are freed as soon as its GEMMs are done, so the next gradients reuse that memory (a whole
            # queue freed at W's end left the allocator trimming its heap and faulting pages back in).
            params, compute = queue.pop()
            grads.extend(_take(params, compute))
            del compute
        return (None, *grads)


class _Anchors:
    """What W works out per parameter list and reuses while ``keep`` is set
    (``WeightGradDeferral.reusing_graphs``: one pipeline step): its ``_Route``, and its ``_RunQueue``
    graph (kept with ``retain_graph`` and rerun; the most recent ``size`` of them).

    Why: both were a fixed cost of each ``W``. Building the one-node graph (a Python
    ``Function.apply`` over every parameter) cost as much as a small layer's GEMM; the route
    (``leaf_grads.all_accepted`` over every parameter: five attribute reads each) 10-20 us of thread
    CPU time per ``W`` at hidden 128 (2026-12-06, ``scripts/profile_split_backward.py``). Within a step
    a chunk queues the same parameters in the same order every microbatch, so each is worked out once
    per step. The key (``_key_of``) is the parameters' identities and whether each requires grad (the
    edges a graph was built with); a kept graph or route holds its parameters, so an identity cannot
    be reused while cached. Forgotten at the step's end: a
    parameter's ``.data`` set to another dtype, device or layout between steps gets a new
    ``AccumulateGrad`` node, which a graph kept from before would not reach, and may change its route.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.keep = False
        self._kept: dict[Key, tuple[torch.Tensor, list]] = {}
        self._routes: dict[Key, tuple[_Route, list]] = {}

    def forget(self) -> None:
        self._kept.clear()
        self._routes.clear()

    def route(self, key: Key, queue: list[tuple[Params, GradCompute]]) -> _Route:
        """``key``'s route (``key``: the queue's, ``DeferredWeightGrads._key``), worked out once per step
        while ``keep``."""
        known = self._routes.get(key) if self.keep else None
        if known is not None:
            return known[0]
        params = _params(queue)
        route = (_Route.NONE if not any(k > 0 for part in key for k in part)
                 else _Route.ACCEPTED if all_accepted(params) else _Route.AUTOGRAD)
        if self.keep:
            self._routes[key] = (route, params)  # holding the parameters keeps their identities unique
        return route

    def run(self, queue: list[tuple[Params, GradCompute]], key: Key) -> None:
        """W through autograd: the queue's graph (``key``: the queue's), kept per step or built now."""
        keep = self.keep and self.size > 0
        kept = self._kept.pop(key, None) if keep else None
        if kept is None:
            slot: list = [None]
            with torch.enable_grad():
                kept = (_RunQueue.apply(slot, *_params(queue)), slot)
        root, slot = kept
        if keep:
            self._kept[key] = kept  # most recently used last
            while len(self._kept) > self.size:
                del self._kept[next(iter(self._kept))]
        slot[0] = queue
        try:
            root.backward(retain_graph=keep)
        finally:
            slot[0] = None


class WeightGradDeferral:
    """Where layers send weight-gradient work while a ``B`` is open (see the module doc).

    Invariant: at most one ``collecting`` block is open at a time; outside one, ``defer``
    declines and layers compute their weight gradients in their own backward.
    """

    def __init__(self, kept_graphs: int = 8, direct: bool = True) -> None:
        self._open: DeferredWeightGrads | None = None
        # Whether W accumulates without autograd's engine where it can (``leaf_grads``); False: always
        # through W's one-node graph (for hooks on AccumulateGrad nodes, which leaf_grads cannot see).
        self.direct = direct
        # W's graphs, reused per chunk within a step (``_Anchors``): enough for every chunk of a stage.
        self._anchors = _Anchors(kept_graphs)
        self._heap_retained = False  # host_heap.retain_freed_memory done (once per process suffices)

    @property
    def active(self) -> bool:
        return self._open is not None

    @contextmanager
    def reusing_graphs(self) -> Iterator[None]:
        """Within (one pipeline step): each ``W``'s one-node graph is kept per parameter list and
        rerun (``_Anchors``); forgotten on exit. Outside, every ``W`` builds its own.

        The first time, the process's C heap is told to keep what it frees (``host_heap``): a split
        backward holds ``W``'s tensors across actions, and glibc returning the freed heap top to the
        kernel made the next ``B`` fault its pages back in."""
        if self._anchors.keep:
            raise RuntimeError("WeightGradDeferral.reusing_graphs() is already open")
        if not self._heap_retained:
            retain_freed_memory()
            self._heap_retained = True
        self._anchors.keep = True
        try:
            yield
        finally:
            self._anchors.keep = False
            self._anchors.forget()

    def collecting(self) -> DeferredWeightGrads:
        """``with deferral.collecting() as work:`` queues every deferrable weight gradient of the
        backwards run inside the block on ``work`` (a ``B``)."""
        return DeferredWeightGrads(self._anchors, self.direct, self)

    def defer(self, params: Params, compute: GradCompute, holds: Sequence[torch.Tensor]) -> bool:
        """Queue ``compute`` for ``params`` if a ``B`` is open and they are deferrable (True); else False."""
        work = self._open
        if work is None:
            return False
        part = _key_of(params)
        if part is None:
            return False
        work.add(params, compute, part, holds)
        return True
