"""The top-k router: which experts each token goes to, and with what weight.

``TopKRouter(tokens [T, h]) -> Routing`` computes in fp32 whatever the model dtype (fp64 for a
float64 model):

1. ``logits = tokens @ weight^T`` (``weight [E, h]``, replicated on every rank: its
   gradient is a dense one, reduced like any replicated parameter; ``weight_fn``, if given,
   is applied to the weight at use time, e.g. the caller's identity-forward / all-reduce-the-
   gradient map when the ranks of a group hold different tokens of one micro-batch);
2. ``scores = softmax(logits)`` or ``sigmoid(logits)`` (``score_function``);
3. selection on ``scores + expert_bias`` (the bias, DeepSeek-V3's aux-loss-free balancing,
   chooses experts but never weights them). Group-limited routing (DeepSeek-V3's
   node-limited top-k): experts form ``num_groups`` equal groups; a group's score is the
   sum of its two best selection scores (its best one if groups have one expert); a
   token keeps its ``topk_groups`` best groups and picks its top-k experts inside them;
4. ``weights`` = the selected experts' ``scores``, divided by their sum if
   ``normalize_topk`` (+1e-20, so sigmoid scores near 0 stay finite), times ``scaling_factor``.

The expert bias is a buffer (saved with checkpoints, replicated on every rank), changed
only by ``update_bias(tokens_per_expert)`` at the optimizer step from the step's load
over every token of the global batch: ``bias += rate * sign(mean_load - load)``, so every
layout and every micro-batch split that sees the same global batch makes the same update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.moe.options import MoEOptions
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel.init import normal_shard


@dataclass
class Routing:
    """One micro-batch's routing of ``T`` tokens (fp32 tensors keep their autograd graph).

    ``logits``/``scores`` ``[T, E]``; ``weights`` ``[T, k]`` combine weights; ``indices``
    ``[T, k]`` global expert ids (int64); ``selected_scores`` ``[T, k]`` the raw scores of
    the chosen experts (detached; what capacity's "probs" policy ranks by).
    """

    logits: torch.Tensor
    scores: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    selected_scores: torch.Tensor

    def balance_scores(self, score_function: str) -> torch.Tensor:
        """``[T, E]`` per-token probabilities the aux loss averages (sigmoid scores normalised per token)."""
        if score_function == "softmax":
            return self.scores
        return self.scores / (self.scores.sum(-1, keepdim=True) + 1e-20)


def select_experts(selection: torch.Tensor, top_k: int, num_groups: int, topk_groups: int) -> torch.Tensor:
    """``[T, E]`` selection scores -> ``[T, k]`` chosen expert ids (group-limited if ``num_groups > 1``)."""
    if num_groups > 1:
        t, e = selection.shape
        grouped = selection.view(t, num_groups, e // num_groups)
        best = min(2, e // num_groups)
        group_score = grouped.topk(best, dim=-1).values.sum(-1)  # [T, G]
        chosen = group_score.topk(topk_groups, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, chosen, True)
        selection = selection.masked_fill(~allowed.repeat_interleave(e // num_groups, dim=1), float("-inf"))
    return selection.topk(top_k, dim=-1).indices


class TopKRouter(nn.Module):
    """Routes ``[T, h]`` tokens to ``top_k`` of ``num_experts`` experts; see the module docstring.

    Parameters: ``weight [E, h]`` named ``{global_name}.weight`` (init normal(0, ``init_std``)
    from ``(seed, name)``); buffer ``expert_bias [E]`` fp32 when ``bias_update_rate > 0``.
    ``weight_fn``: applied to ``weight`` at every use (None: the weight itself).
    """

    def __init__(self, options: MoEOptions, hidden: int, *, global_name: str, seed: int = 0,
                 init_std: float = 0.02, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 weight_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.options, self.weight_fn = options, weight_fn
        self.weight = nn.Parameter(torch.empty(options.num_experts, hidden, dtype=dtype, device=device))
        normal_shard(self.weight, seed=seed, global_name=f"{global_name}.weight", std=init_std, split_dim=None,
                     tp_rank=0, tp_size=1)
        set_meta(self.weight, global_name=f"{global_name}.weight")
        self.expert_bias: torch.Tensor | None
        if options.uses_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(options.num_experts, dtype=torch.float32, device=device))
        else:
            self.expert_bias = None

    def forward(self, tokens: torch.Tensor) -> Routing:
        o = self.options
        compute = torch.promote_types(tokens.dtype, torch.float32)  # fp32, or fp64 for a float64 model
        weight = self.weight if self.weight_fn is None else self.weight_fn(self.weight)
        logits = F.linear(tokens.to(compute), weight.to(compute))
        scores = torch.softmax(logits, dim=-1) if o.score_function == "softmax" else torch.sigmoid(logits)
        selection = scores.detach()
        if self.expert_bias is not None:
            selection = selection + self.expert_bias
        indices = select_experts(selection, o.top_k, o.num_groups, o.topk_groups)
        chosen = scores.gather(1, indices)
        weights = chosen
        if o.normalize_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if o.scaling_factor != 1.0:
            weights = weights * o.scaling_factor
        return Routing(logits, scores, weights, indices, chosen.detach())

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3's update from the step's load ``[E]`` over the whole global batch (call once per step)."""
        if self.expert_bias is None:
            return
        load = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        self.expert_bias += self.options.bias_update_rate * torch.sign(load.mean() - load)
