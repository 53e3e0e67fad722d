"""Llama 2 / 3 pieces: rotary position tables and the SwiGLU MLP.

The rest of a Llama (RMSNorm pre-norm blocks, grouped-query attention with
``num_kv_heads``, untied head) is the shared ``models.transformer.TransformerLM``
reading ``config.spec`` (``models.spec``).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import dispatch
from models.blocks import BuildContext
from models.spec import MLPSpec
from parallel3d.tensor_parallel import column_parallel_linears


def rotary_tables(seq_len: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[seq_len, head_dim/2]`` in float32 (the HF Llama frequencies)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate/up column-parallel (h -> ffn/tp), down row-parallel."""

    def __init__(self, ctx: BuildContext, layer: int, spec: MLPSpec) -> None:
        super().__init__()
        h = ctx.config.hidden_size
        self.backend = ctx.config.backend
        self.gate = ctx.column(h, spec.ffn_size, f"layers.{layer}.mlp.gate", spec.bias)
        self.up = ctx.column(h, spec.ffn_size, f"layers.{layer}.mlp.up", spec.bias)
        self.down = ctx.row(spec.ffn_size, h, f"layers.{layer}.mlp.down", spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up read the same input: make it whole once (one all-gather / one f), not twice.
        gate, up = column_parallel_linears(x, [(self.gate.weight, self.gate.bias), (self.up.weight, self.up.bias)],
                                           self.gate.pstate, sequence_parallel=self.gate.sequence_parallel)
        return self.down(dispatch.swiglu(gate, up, backend=self.backend))
