"""A gradient handed to a leaf tensor without autograd's engine, as its ``AccumulateGrad`` node would.

Why: a zero-bubble ``W`` (``parallel3d.deferred_grads``) computes its weight gradients outside
any graph. Handing them to the parameters through a backward of a one-node graph (to reach
each parameter's ``AccumulateGrad``) costs a fixed amount per ``W`` (the engine's entry and
graph task, a Python ``Function.backward``, every gradient through an input buffer; 2026-12-06,
one CPU thread: 2-8% of ``W`` at hidden 128, ``scripts/profile_split_backward.py --w-paths``).
``accumulate`` does to one gradient what that backward did, directly.

Invariant: for a tensor ``accepts`` admits, ``accumulate(p, g)`` run with grad mode off leaves
``p.grad`` bitwise as autograd delivering ``g`` to ``p`` in a backward without
``create_graph`` would, runs the same aten ops, and calls the same Python hooks in the same
order, each exactly once:

1. Autograd's check of the producing node's output: the gradient must be dense, with ``p``'s
   shape and device; it is cast to ``p``'s dtype if it differs.
2. ``p.register_hook`` hooks (torch keeps them in ``p._backward_hooks``), in registration
   order; one that returns a tensor replaces the gradient, which must keep its dtype, shape
   and device (autograd runs a leaf's tensor hooks right before its accumulator).
3. ``AccumulateGrad``: no ``p.grad`` yet: ``p.grad`` adopts the gradient's memory (``detach``)
   when its strides are ``p``'s, else gets a copy with ``p``'s strides (autograd also copies
   when something else holds the gradient; our callers hand over fresh GEMM outputs, and a view
   is always copied here); ``p.grad`` set: ``p.grad += g`` in place (a ``.grad`` bound to a ZeRO
   bucket's view keeps accumulating into the bucket).
4. ``p.register_post_accumulate_grad_hook`` hooks (``p._post_accumulate_grad_hooks``: ZeRO's
   buckets and fp32 main grads, and anyone else's), in registration order.

Not seen: hooks registered on ``p``'s ``AccumulateGrad`` node itself (``Node.register_hook`` or
``register_prehook`` on ``p.view_as(p).grad_fn.next_functions[0][0]``, as torch's DDP does):
torch offers no way to list them. Nothing in parallel3d registers one; a program that does
must keep ``W`` on the autograd path (``WeightGradDeferral(direct=False)``).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["accepts", "accumulate", "accumulate_each", "all_accepted"]


def accepts(p: torch.Tensor) -> bool:
    """Whether ``accumulate`` stands in exactly for ``p``'s ``AccumulateGrad`` (module invariant):
    a leaf (a non-leaf's gradient flows on into its graph), dense and contiguous (the only layout
    whose ``AccumulateGrad`` copy ``accumulate`` reproduces), whose hooks torch keeps where this
    module reads them (a torch that moved them must not silently lose them)."""
    return (p.grad_fn is None and p.layout is torch.strided and p.is_contiguous()
            and hasattr(p, "_backward_hooks") and hasattr(p, "_post_accumulate_grad_hooks"))


def all_accepted(params: Sequence["torch.Tensor | None"]) -> bool:
    """Whether every parameter needing a gradient is ``accepts``-ed and appears once.

    A parameter listed twice gets its gradients summed by autograd before its one accumulation
    (one hook call); ``accumulate`` per entry would accumulate (and call its hooks) twice.
    """
    seen: set[int] = set()
    for p in params:
        if p is None or not p.requires_grad:
            continue
        if id(p) in seen or not accepts(p):
            return False
        seen.add(id(p))
    return True


def accumulate(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``p.grad`` and call ``p``'s hooks exactly as autograd would (module doc);
    call with grad mode off, on a ``p`` that ``accepts`` admits and that requires grad."""
    accumulate_each((p,), (grad,))


def accumulate_each(params: Sequence["torch.Tensor | None"], grads: Sequence["torch.Tensor | None"]) -> None:
    """``accumulate(p, grad)`` for each pair in order, skipping a missing gradient or parameter and a
    parameter that needs no gradient (autograd: no edge, no gradient). Call with grad mode off; every
    parameter needing a gradient must be ``accepts``-ed.

    Why one call per list, not per parameter: a zero-bubble ``W`` hands over one closure's gradients at
    a time, between GEMMs that push the interpreter's own data out of cache, where each Python frame
    and attribute read costs several times its warm price (2026-12-07, hidden 128, one thread: docs/benchmarks.md,
    "A leaner split path")."""
    for p, grad in zip(params, grads):
        if grad is None or p is None or not p.requires_grad:
            continue
        # 1. autograd's check of the producing node's output
        if grad.layout is not torch.strided or grad.shape != p.shape or grad.device != p.device:
            raise RuntimeError(f"a {grad.layout} gradient of shape {tuple(grad.shape)} on {grad.device} for a "
                               f"parameter of shape {tuple(p.shape)} on {p.device}")
        if grad.dtype != p.dtype:
            grad = grad.to(p.dtype)
        pre = p._backward_hooks
        if pre:  # 2. tensor hooks
            for hook in tuple(pre.values()):  # a hook may register or remove hooks: iterate a snapshot
                new = hook(grad)
                if new is not None:
                    if (not isinstance(new, torch.Tensor) or new.layout is not torch.strided
                            or new.dtype != grad.dtype or new.shape != grad.shape or new.device != grad.device):
                        raise RuntimeError("a tensor hook returned a gradient of another type, shape or device")
                    grad = new
        current = p.grad  # 3. AccumulateGrad
        if current is None:
            if grad._base is None and grad.stride() == p.stride():
                p.grad = grad.detach()  # adopt the memory, as AccumulateGrad steals an unshared gradient
            else:
                p.grad = grad.new_empty_strided(p.size(), p.stride()).copy_(grad)
        else:
            current += grad  # in place, as AccumulateGrad outside create_graph: .grad keeps its identity
        post = p._post_accumulate_grad_hooks
        if post:  # 4. post-accumulate-grad hooks
            for hook in tuple(post.values()):
                if hook(p) is not None:
                    raise RuntimeError("a post-accumulate-grad hook returned a value (torch requires None)")
