"""A tiny stand-in for ``models.build_model`` used by the pipeline tests.

Same contract as the real models (layer_range, pre/post_process, global layer
names, tied embedding copy flagged ``tied_embedding``), small enough that a
whole pipeline step takes milliseconds. Weights depend only on (seed, global
name), so any split of the layers builds the same model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.deferred_grads import WeightGradDeferral
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel.deferrable_linear import deferrable_linear

VOCAB, HIDDEN = 32, 16


def _init(shape: tuple[int, ...], seed: int, name: str) -> nn.Parameter:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(ord(c) * 31**i for i, c in enumerate(name)) % 2**31)
    return nn.Parameter(torch.randn(shape, generator=gen) * 0.3)


class ToyLayer(nn.Module):
    def __init__(self, index: int, seed: int, deferral: WeightGradDeferral | None) -> None:
        super().__init__()
        self.weight = set_meta(_init((HIDDEN, HIDDEN), seed, f"layers.{index}.weight"), wgrad_deferrable=True)
        self.bias = set_meta(_init((HIDDEN,), seed, f"layers.{index}.bias"), wgrad_deferrable=True)
        self.deferral = deferral

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(deferrable_linear(x, self.weight, self.bias, self.deferral))


class ToyModel(nn.Module):
    """Embedding -> residual tanh layers -> (tied or own) head -> mean cross entropy."""

    def __init__(
        self,
        num_layers: int,
        layer_range: tuple[int, int] | None = None,
        *,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        tied: bool = False,
        seed: int = 0,
        deferral: WeightGradDeferral | None = None,
    ) -> None:
        super().__init__()
        self.deferral = deferral  # pipeline runs pass ParallelState.weight_grads: zero-bubble B defers the GEMMs
        a, b = layer_range or (0, num_layers)
        self.pre_process = a == 0 if pre_process is None else pre_process
        self.post_process = b == num_layers if post_process is None else post_process
        self.tied = tied
        split = not (self.pre_process and self.post_process)
        if self.pre_process:
            self.embedding = _init((VOCAB, HIDDEN), seed, "embedding.word.weight")
            if tied and split:
                set_meta(self.embedding, tied_embedding=True)
        self.layers = nn.ModuleDict({str(i): ToyLayer(i, seed, deferral) for i in range(a, b)})
        if self.post_process:
            if not tied:
                self.head = set_meta(_init((VOCAB, HIDDEN), seed, "head.weight"), wgrad_deferrable=True)
            elif not self.pre_process:
                # The last stage's copy of the tied embedding (same initial values), read by the head only.
                self.head = set_meta(_init((VOCAB, HIDDEN), seed, "embedding.word.weight"), tied_embedding=True,
                                     tied_head_copy=True, wgrad_deferrable=True)

    def head_weight(self) -> torch.Tensor:
        return self.embedding if self.tied and self.pre_process else self.head

    def forward(self, x, labels=None, *, sample_ids=None, step=0):
        if self.pre_process:
            x = F.embedding(x, self.embedding)
        for layer in self.layers.values():
            x = layer(x)
        if not self.post_process:
            return x
        logits = deferrable_linear(x, self.head_weight(), None, self.deferral)
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def toy_batch(num_microbatches: int, micro_batch_size: int, seq_len: int, seed: int = 1,
              vocab: int = VOCAB) -> list[dict]:
    """Microbatches of random token ids in ``[0, vocab)`` (the toy model's by default), labels shifted by one."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_microbatches):
        ids = torch.randint(0, vocab, (micro_batch_size, seq_len + 1), generator=gen)
        out.append(
            {
                "input_ids": ids[:, :-1].contiguous(),
                "labels": ids[:, 1:].contiguous(),
                "sample_ids": torch.arange(i * micro_batch_size, (i + 1) * micro_batch_size),
            }
        )
    return out
