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
  accumulates into ``.grad``. The common cut nodes get their off-path gradient
  without an autograd call (``_direct_weight_grads``: a matrix multiply's weight
  operand, a bias add; the same formula autograd uses), so ``W`` costs about the
  weight-gradient FLOPs plus one ``backward`` rather than one graph task per cut node. That is exact when the subgraphs hanging off ``P``
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

__all__ = ["WeightGrad", "input_grad", "full_backward", "plain_unpack"]


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


def plain_unpack(t: torch.Tensor) -> torch.Tensor:
    """The identity unpack hook: a caller that observes saved tensors (e.g. counts their bytes) and
    uses this as its unpack hook keeps ``W``'s direct formulas (they read saved tensors)."""
    return t


def _saved(node: Any, name: str) -> torch.Tensor | None:
    """``node``'s saved tensor ``name`` if reading it is free: no unpack hook, or ``plain_unpack``
    (recompute's hooks would re-run the forward region on every read: those nodes go generic)."""
    raw = getattr(node, "_raw_saved_" + name, None)
    if raw is None or raw.unpack_hook not in (None, plain_unpack):
        return None
    t = getattr(node, "_saved_" + name)
    return t if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_complex() else None


def _mat2_grad(node: Any, grad: torch.Tensor, mat1: torch.Tensor) -> torch.Tensor:
    """d(mat1 @ mat2)/d mat2 for a real strided mm; laid out column-major when mat2 was (as autograd does)."""
    sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
    if strides[0] == 1 and strides[1] == sizes[0]:
        return grad.t().mm(mat1).t()
    return mat1.t().mm(grad)


def _leaf_shape(node: Any, k: int, grad: torch.Tensor) -> torch.Tensor | None:
    """``grad`` summed to the shape of the leaf parameter behind edge ``k`` (autograd reduces a
    broadcast gradient the same way), or None if that edge is not a leaf of matching dtype."""
    leaf = node.next_functions[k][0]
    var = getattr(leaf, "variable", None)
    if var is None or var.dtype != grad.dtype:
        return None
    return grad if grad.shape == var.shape else grad.sum_to_size(var.shape)


def _direct_weight_grads(node: Any, off: list[int], into: tuple) -> list[tuple[int, torch.Tensor]] | None:
    """The off-path gradients of a cut node computed by formula, or None (then ``W`` asks autograd).

    Covered: ``mm`` whose weight operand is off the path, ``addmm`` with its bias and/or weight off
    the path (alpha = beta = 1), ``add`` of a bias (alpha = 1). Exactly what autograd computes.
    """
    name = node.name()
    if name not in ("MmBackward0", "AddmmBackward0", "AddBackward0") or len(into) != 1 or into[0] is None:
        return None
    grad = into[0]
    if grad.layout != torch.strided or grad.is_complex():
        return None
    out: list[tuple[int, torch.Tensor]] = []
    if name == "MmBackward0":
        mat1 = _saved(node, "self") if off == [1] else None
        if mat1 is None:
            return None
        return [(1, _mat2_grad(node, grad, mat1))]
    if name == "AddmmBackward0":
        if not set(off) <= {0, 2} or node._saved_alpha != 1 or node._saved_beta != 1:
            return None
        for k in off:
            if k == 0:
                g = _leaf_shape(node, 0, grad)
            else:
                mat1 = _saved(node, "mat1")
                g = None if mat1 is None else _mat2_grad(node, grad, mat1)
            if g is None:
                return None
            out.append((k, g))
        return out
    if len(off) != 1 or (off[0] == 1 and node._saved_alpha != 1):  # AddBackward0
        return None
    g = _leaf_shape(node, off[0], grad)
    return None if g is None else [(off[0], g)]


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
            direct = _direct_weight_grads(node, off, into)
            if direct is not None:
                for k, g in direct:
                    edges.append(GradientEdge(*node.next_functions[k]))
                    grads.append(g)
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
