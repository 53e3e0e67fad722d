"""GPT-2 / GPT-3 pieces: learned position embeddings and the GELU MLP.

The rest of a GPT (pre-LayerNorm blocks, tied output head) is the shared
``models.transformer.TransformerLM`` reading ``config.spec`` (``models.spec``): LayerNorm, no
rotary, and the head reusing ``embedding.word.weight`` when ``tie_embeddings`` is set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.blocks import BuildContext
from models.spec import MLPSpec
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel import VocabParallelEmbedding, copy_to_tp_region
from parallel3d.tensor_parallel.mappings import tp_chunk_start
from parallel3d.tensor_parallel.init import normal_shard


class GeluMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``; fc1 column-parallel (h -> ffn/tp), fc2 row-parallel (ffn/tp -> h).

    GELU uses the tanh approximation, as GPT-2 ("gelu_new") does.
    """

    def __init__(self, ctx: BuildContext, layer: int, spec: MLPSpec) -> None:
        super().__init__()
        h = ctx.config.hidden_size
        self.fc1 = ctx.column(h, spec.ffn_size, f"layers.{layer}.mlp.fc1", spec.bias)
        self.fc2 = ctx.row(spec.ffn_size, h, f"layers.{layer}.mlp.fc2", spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Embedding(nn.Module):
    """Token (vocab-parallel) plus, with learned positions, position embeddings: ``[b, s] -> [b, s_local, h]``.

    ``with_positions=False`` builds only ``word`` (the tied-head copy on a last pipeline stage).
    The position table is replicated over tp; with sequence parallel each rank adds the rows of
    its own sequence chunk, so its gradient is partial and ``copy_to_tp_region`` sums it.
    """

    def __init__(self, ctx: BuildContext, *, with_positions: bool) -> None:
        super().__init__()
        c = ctx.config
        self.pstate, self.sequence_parallel = ctx.pstate, ctx.sequence_parallel
        self.word = VocabParallelEmbedding(c.vocab_size, c.hidden_size, ctx.pstate, global_name="embedding.word",
                                           seed=ctx.seed, init_std=c.init_std, sequence_parallel=ctx.sequence_parallel,
                                           dtype=ctx.dtype, device=ctx.device)
        self.position = None
        if with_positions:
            self.position = nn.Module()
            self.position.weight = nn.Parameter(
                torch.empty(c.max_seq_len, c.hidden_size, dtype=ctx.dtype, device=ctx.device))
            normal_shard(self.position.weight, seed=ctx.seed, global_name="embedding.position.weight",
                         std=c.init_std, split_dim=None, tp_rank=0, tp_size=1)
            set_meta(self.position.weight, global_name="embedding.position.weight")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: of the tokens in ``input_ids`` (``[s]`` or ``[b, s]``: context parallel's
        share, per-document positions); None = 0..s-1."""
        out = self.word(input_ids)
        if self.position is None:
            return out
        s_local = out.shape[1]
        start = tp_chunk_start(s_local, self.pstate) if self.sequence_parallel else 0
        if positions is None:
            positions = torch.arange(start, start + s_local, device=input_ids.device)
        else:
            positions = positions[..., start:start + s_local]
        table = self.position.weight
        if self.sequence_parallel:
            table = copy_to_tp_region(table, self.pstate)
        added = F.embedding(positions, table)
        return out + (added if added.dim() == 3 else added.unsqueeze(0))
