"""Shared pieces of the HF conversion tests: perturbed transformers models, token ids, relative error."""

from __future__ import annotations

import torch

from models.config import ModelConfig


@torch.no_grad()
def perturb(hf: torch.nn.Module, buffer_scale: dict[str, float] | None = None) -> torch.nn.Module:
    """Move every parameter off its init (norms off 1, routers and gates away from 0: a misplaced
    tensor shows); buffers whose name ends with a ``buffer_scale`` key get N(0, scale) values."""
    for p in hf.parameters():
        p.add_(0.1 * torch.randn_like(p))
    for name, b in hf.named_buffers():
        for suffix, scale in (buffer_scale or {}).items():
            if name.endswith(suffix):
                b.copy_(scale * torch.randn_like(b))
    return hf


def token_ids(cfg: ModelConfig, length: int) -> torch.Tensor:
    """A fixed [2, length] batch of ids in the model's vocabulary."""
    return torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-norm error of ``a`` relative to ``b``'s max-norm."""
    return float((a - b).abs().max() / b.abs().max())
