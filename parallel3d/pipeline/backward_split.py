"""A backward split in two: the input gradient now (``B``), the weight gradients later (``W``).

Zero-bubble schedules (Qi et al. 2023) send a stage's input gradient upstream as soon
as it exists and run the weight-gradient work when the stage would otherwise idle.
The layers make the split (``parallel3d.deferred_grads``): ``split_backward`` is one
ordinary backward of the chunk, run while the deferral collects, that accumulates only
the input and the parameters no layer defers (norms, embeddings: cheap, non-GEMM), and
frees the graph; the deferring layers (the tensor-parallel linears, the LM head) queue
their weight-gradient GEMMs. ``W`` is ``run()`` on what ``B`` returned: the queued GEMMs,
each result accumulated into ``.grad`` as autograd would (hooks fire there; ``deferred_grads``).
Between ``B`` and ``W`` a microbatch-chunk holds only what the queue holds (``held``: each
deferring layer's input and output gradient), not its graph.

``FullBackward`` is the ``W`` of a chunk with no input gradient to send (the first model
chunk): its whole backward, run at ``W``; its graph lives until then.
"""

from __future__ import annotations

from typing import Sequence

import torch

from parallel3d.deferred_grads import DeferredWeightGrads, WeightGradDeferral

__all__ = ["FullBackward", "split_backward"]


class FullBackward:
    """A ``W`` that is the whole backward of ``out`` (nothing ran at ``B``). Run exactly once."""

    def __init__(self, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        self.held: tuple[torch.Tensor, ...] = ()  # nothing beyond the graph (counted at the forward)
        self._out: torch.Tensor | None = out
        self._grad = grad

    def run(self) -> None:
        out, grad = self._out, self._grad
        self._out = self._grad = None
        torch.autograd.backward(out, grad_tensors=grad)


def split_backward(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor,
                   deferral: WeightGradDeferral, undeferred: Sequence[torch.Tensor]
                   ) -> tuple[torch.Tensor, DeferredWeightGrads]:
    """``B``: the gradient of ``inp`` and the ``W`` still owed; the graph is freed.

    ``undeferred``: this chunk's parameters that ``B`` accumulates (``deferred_grads.backward_inputs``).
    """
    if inp.grad is not None:
        raise RuntimeError("the chunk's input already has a gradient")
    with deferral.collecting() as work:
        torch.autograd.backward(out, grad_tensors=grad, inputs=[inp, *undeferred])
    if inp.grad is None:
        raise RuntimeError("the chunk's output does not depend on its input")
    return inp.grad, work
