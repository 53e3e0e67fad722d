"""An independent float64 mixture-of-experts, written token by token from the definitions.

Nothing here imports ``parallel3d.moe`` beyond reading option values: routing, capacity,
the expert FFNs, the combine and the balancing losses are recomputed with plain loops and
``torch.float64`` tensors, so the tests compare the fused / distributed layer against the
formulas rather than against itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

F64 = torch.float64


def route(x: torch.Tensor, w: torch.Tensor, o, bias: torch.Tensor | None = None):
    """``x [T, h]`` -> (weights [T, k], indices [T, k] (list of lists), logits [T, E], scores [T, E])."""
    logits = x @ w.t()
    scores = torch.softmax(logits, -1) if o.score_function == "softmax" else torch.sigmoid(logits)
    e = w.shape[0]
    per_group = e // o.num_groups
    indices, weights = [], []
    for t in range(x.shape[0]):
        sel = [float(scores[t, i].detach()) + (float(bias[i]) if bias is not None else 0.0) for i in range(e)]
        allowed = set(range(e))
        if o.num_groups > 1:
            gscore = []
            for g in range(o.num_groups):
                members = sorted((sel[i] for i in range(g * per_group, (g + 1) * per_group)), reverse=True)
                gscore.append((sum(members[:min(2, per_group)]), g))
            best = [g for _, g in sorted(gscore, key=lambda p: -p[0])[:o.topk_groups]]
            allowed = {i for g in best for i in range(g * per_group, (g + 1) * per_group)}
        chosen = sorted(allowed, key=lambda i: -sel[i])[:o.top_k]
        indices.append(chosen)
        wt = torch.stack([scores[t, i] for i in chosen])
        if o.normalize_topk:
            wt = wt / (wt.sum() + 1e-20)
        weights.append(wt * o.scaling_factor)
    return torch.stack(weights), indices, logits, scores


def keep_mask(indices: list[list[int]], scores: torch.Tensor, ids: list[int], o, num_experts: int) -> list[list[bool]]:
    """The capacity definition, by sorting each expert's slots in Python."""
    n, k = len(indices), o.top_k
    cap = math.ceil(o.capacity_factor * n * k / num_experts)
    keep = [[False] * k for _ in range(n)]
    for e in range(num_experts):
        slots = [(t, j) for t in range(n) for j in range(k) if indices[t][j] == e]
        if o.drop_policy == "probs":
            slots.sort(key=lambda p: (-float(scores[p[0], e]), ids[p[0]], p[1]))
        else:
            slots.sort(key=lambda p: (ids[p[0]], p[1]))
        for t, j in slots[:cap]:
            keep[t][j] = True
    return keep


def swiglu_ffn(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def balance_probs(scores: torch.Tensor, o) -> torch.Tensor:
    return scores if o.score_function == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)


def aux_loss(indices: list[list[int]], probs: torch.Tensor, o, num_experts: int) -> torch.Tensor:
    """Switch: E * sum_i f_i P_i over one set of tokens."""
    n = len(indices)
    total = probs.new_zeros(())
    for i in range(num_experts):
        f_i = sum(row.count(i) for row in indices) / (n * o.top_k)
        total = total + f_i * probs[:, i].mean()
    return num_experts * total


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, -1).square().mean()


def moe_forward(x: torch.Tensor, params: dict[str, torch.Tensor], o, prefix: str, token_ids: list[int],
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch ``x [b, s, h]`` (float64) -> (out [b, s, h], aux, z, weighted loss term)."""
    b, s, h = x.shape
    tokens = x.reshape(b * s, h)
    e = o.num_experts
    weights, indices, logits, scores = route(tokens, params[f"{prefix}.router.weight"], o, bias)
    keep = [[True] * o.top_k for _ in indices]
    if o.capacity_factor is not None:
        keep = keep_mask(indices, scores.detach(), token_ids, o, e)
    rows = []
    for t in range(b * s):
        acc = tokens.new_zeros(h)
        for j, ex in enumerate(indices[t]):
            if keep[t][j]:
                p = f"{prefix}.experts.{ex}"
                ffn = swiglu_ffn(tokens[t], params[f"{p}.w1"], params[f"{p}.w3"], params[f"{p}.w2"])
                acc = acc + weights[t, j] * ffn
        rows.append(acc)
    out = torch.stack(rows)
    if o.num_shared_experts:
        p = f"{prefix}.shared_experts"
        shared = swiglu_ffn(tokens, params[f"{p}.w1"], params[f"{p}.w3"], params[f"{p}.w2"])
        if o.shared_expert_gate:
            shared = shared * torch.sigmoid(tokens @ params[f"{prefix}.shared_expert_gate.weight"].t())
        out = out + shared
    probs = balance_probs(scores, o)
    if o.aux_loss_scope == "sequence":
        per_sequence = [aux_loss(indices[i * s:(i + 1) * s], probs[i * s:(i + 1) * s], o, e) for i in range(b)]
        aux = torch.stack(per_sequence).mean()
    else:
        aux = aux_loss(indices, probs, o, e)
    z = z_loss(logits)
    return out.view(b, s, h), aux, z, o.aux_loss_coeff * aux + o.z_loss_coeff * z
