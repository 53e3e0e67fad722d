"""A backward split in two: the input gradient now (``B``), the weight gradients later (``W``).

Zero-bubble schedules (Qi et al. 2023) send a stage's input gradient upstream as
soon as it exists and run the parameter-gradient work when the stage would
otherwise idle. ``input_grad`` runs the first half on an autograd graph that
``forward`` built, ``WeightGrad.run`` the second; together they leave exactly the
``.grad`` a single ``torch.autograd.backward(out, grad)`` leaves, in the same
places, because every parameter gradient still arrives through its own
``AccumulateGrad`` node (so post-accumulate-grad hooks, i.e. the DP gradient
buckets, fire as usual: during ``W``, never during ``B``).

How the graph is cut (no model cooperation needed, so it holds for TP layers,
custom ``autograd.Function``s, tied weights and non-reentrant recompute):

- the *input path* ``P`` is every graph node reachable from ``out`` that leads
  to ``inp``; ``B`` is ``torch.autograd.grad(out, inp, retain_graph=True)``,
  which runs only ``P`` and, inside each node, only the outputs ``P`` needs (so
  a linear layer computes ``dX`` and skips ``dW``);
- a node of ``P`` with an edge leaving ``P`` (towards parameters only: a node
  off ``P`` cannot reach ``inp``) is a *cut node*; a pre-hook records the
  gradient flowing into each cut node during ``B``;
- ``W`` re-runs each cut node on its recorded gradient asking only for its
  off-path edges (one ``autograd.grad`` per node: one call for all nodes would
  also push gradient down ``P`` into later cut nodes and count it twice), then
  back-propagates all off-path gradients in one ``backward``, which
  accumulates into ``.grad``. That is exact when the subgraphs hanging off ``P``
  share no node; when they do (one weight used at two places of a chunk), ``B``
  does the whole backward and ``W`` nothing. The two halves together do one backward's work
  (a cut node runs twice, each time computing only its own half); with activation
  recompute, a recomputed region is recomputed again for each graph walk that
  reads it.

The graph (and the activations it saves) lives from ``F`` until ``W``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightGrad", "input_grad", "full_backward"]


def _input_path(root: Any, target: Any) -> tuple[list[Any], set[int]]:
    """Nodes reachable from ``root`` (in a fixed DFS order) and the ids of those leading to ``target``."""
    order: list[Any] = []
    leads: set[int] = {id(target)}
    seen: set[int] = {id(root)}
    stack: list[tuple[Any, Any]] = [(root, iter(root.next_functions))]
    order.append(root)
    while stack:  # iterative post-order DFS: a deep graph must not hit the recursion limit
        node, children = stack[-1]
        for child, _ in children:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                order.append(child)
                stack.append((child, iter(child.next_functions)))
                break
        else:  # every child is finished: it leads to target if one of its children does
            stack.pop()
            if id(node) not in leads and any(c is not None and id(c) in leads for c, _ in node.next_functions):
                leads.add(id(node))
    return order, leads


def _disjoint_off_paths(cuts: list[tuple[Any, list[int]]], leads: set[int]) -> bool:
    """Whether the subgraphs hanging off the input path share no node.

    Only then does re-running one cut node for its off-path edges reach no other cut
    node's parameters (a weight used twice in one chunk, e.g. ``x * s * s``, fails this).
    """
    owner: set[int] = set()
    for node, off in cuts:
        for k in off:
            stack, mine = [node.next_functions[k][0]], set()
            while stack:
                n = stack.pop()
                if n is None or id(n) in mine or id(n) in leads:
                    continue
                if id(n) in owner:
                    return False
                mine.add(id(n))
                stack.extend(m for m, _ in n.next_functions)
            owner |= mine
    return True


class WeightGrad:
    """The deferred weight-gradient half of one backward (see the module doc). Run exactly once."""

    def __init__(self, cuts: list[tuple[Any, list[int]]], captured: dict[int, tuple]) -> None:
        self._cuts = cuts  # (cut node, indices of its off-path edges)
        self._captured = captured  # id(cut node) -> gradients flowing into it during B
        self._full: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @classmethod
    def full(cls, out: torch.Tensor, grad: torch.Tensor | None) -> "WeightGrad":
        """A ``W`` that is the whole backward (a chunk with no input gradient to send)."""
        work = cls([], {})
        work._full = (out, grad)
        return work

    def run(self) -> None:
        if self._full is not None:
            out, grad = self._full
            self._full = None
            torch.autograd.backward(out, grad_tensors=grad)
            return
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        for node, off in self._cuts:
            into = self._captured.pop(id(node), None)
            if into is None:  # no gradient reached this node in B (e.g. a branch unused by the loss)
                continue
            outputs = [GradientEdge(node, i) for i, g in enumerate(into) if g is not None]
            if not outputs:
                continue
            targets = [GradientEdge(*node.next_functions[k]) for k in off]
            got = torch.autograd.grad(outputs, targets, grad_outputs=[g for g in into if g is not None],
                                      allow_unused=True, retain_graph=True)
            for edge, g in zip(targets, got):
                if g is not None:
                    edges.append(edge)
                    grads.append(g)
        self._cuts = []
        if edges:
            torch.autograd.backward(edges, grad_tensors=grads)


def input_grad(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor) -> tuple[torch.Tensor, WeightGrad]:
    """``B``: the gradient of ``inp`` (to send upstream) and the ``W`` still owed; keeps the graph."""
    if out.grad_fn is None:
        raise RuntimeError("the chunk's output has no autograd graph")
    target = get_gradient_edge(inp).node
    order, leads = _input_path(out.grad_fn, target)
    if id(target) not in {id(n) for n in order}:
        raise RuntimeError("the chunk's output does not depend on its input")
    cuts: list[tuple[Any, list[int]]] = []
    for node in order:
        if id(node) not in leads or node is target:
            continue
        off = [k for k, (n, _) in enumerate(node.next_functions) if n is not None and id(n) not in leads]
        if off:
            cuts.append((node, off))
    if not _disjoint_off_paths(cuts, leads):
        # A parameter reached from two cut nodes: no exact split; do the whole backward now.
        torch.autograd.backward(out, grad_tensors=grad, inputs=None)
        if inp.grad is None:
            raise RuntimeError("the chunk's output does not depend on its input")
        return inp.grad, WeightGrad([], {})
    captured: dict[int, tuple] = {}
    handles = []
    for node, _ in cuts:
        def record(grad_outputs: tuple, key: int = id(node)) -> None:
            captured[key] = grad_outputs

        handles.append(node.register_prehook(record))
    try:
        (g_inp,) = torch.autograd.grad(out, inp, grad_outputs=grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return g_inp, WeightGrad(cuts, captured)


def full_backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """An unsplit backward (``B`` of schedules without ``W``)."""
    torch.autograd.backward(out, grad_tensors=grad)
