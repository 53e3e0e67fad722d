"""Attention on one block of queries and keys, in plain torch, returning the log-sum-exp.

The math path of blockwise (context-parallel) attention and the oracle of the Triton
flash-attention kernel (``kernels.flash_attention``). Imports no triton.

Layout (every function here): ``q [b, hq, sq, d]``, ``k``/``v [b, hk, sk, d]`` with
``hq % hk == 0`` (grouped-query attention: query head ``j`` reads key/value head
``j // (hq // hk)``; kv heads are broadcast, never copied). The block's mask:

- ``causal``: key ``j`` is visible to query ``i`` iff ``k_start + j <= q_start + i``
  (global positions; ``q_start``/``k_start`` place the block in the sequence);
- ``q_doc [b, sq]`` / ``k_doc [b, sk]`` (document ids, both or neither): visible only
  within the same document (packed sequences).

Scores, softmax and the log-sum-exp ``lse [b, hq, sq]`` are computed in fp32 (fp64 for
fp64 inputs). A query row that sees no key of the block gets ``lse = -inf`` and output 0,
so merging it (``merge_partial``) changes nothing.

Backward takes the *final* (merged over all blocks) ``out``/``lse`` of the queries: with
``P = exp(S - lse_final)`` each block's gradient is exact on its own (the flash-attention
identity), so blocks can be differentiated in any order and on any rank.
"""

from __future__ import annotations

import math

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types and fp32, fp64 for fp64: the precision of scores and accumulators."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def block_mask(
    sq: int, sk: int, *, q_start: int = 0, k_start: int = 0, causal: bool = False,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, device: torch.device | None = None,
) -> torch.Tensor | None:
    """Visibility ``[b or 1, sq, sk]`` (True = attend), or None when every key is visible."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("block_mask: give document ids for both queries and keys, or for neither")
    allowed = None
    if causal:
        q_pos = torch.arange(q_start, q_start + sq, device=device)
        k_pos = torch.arange(k_start, k_start + sk, device=device)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None]
    if q_doc is not None:
        same_doc = q_doc[:, :, None] == k_doc[:, None, :]
        allowed = same_doc if allowed is None else allowed & same_doc
    return allowed


def _grouped(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[b, hq, s, d] -> [b, hk, g, s, d]`` (query heads grouped by the kv head they read)."""
    b, hq, s, d = x.shape
    return x.reshape(b, hk, hq // hk, s, d)


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None, scale: float, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities ``[b, hk, g, sq, sk]`` and the lse ``[b, hk, g, sq]`` they use.

    ``lse`` given (backward): probabilities relative to it; None: this block's own lse.
    """
    ct = compute_dtype(q.dtype)
    hk = k.shape[1]
    scores = torch.einsum("bhgqd,bhkd->bhgqk", _grouped(q, hk).to(ct), k.to(ct)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        lse = _grouped(lse.unsqueeze(-1), hk).squeeze(-1).to(ct)
    # A fully masked row has lse = -inf: exp(-inf - -inf) would be NaN, its probabilities are 0.
    finite = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(finite, lse, 0.0).unsqueeze(-1))
    if allowed is not None:
        p = p.masked_fill(~allowed[:, None, None], 0.0)
    return p, lse


def attention_forward_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, hq, sq, d], lse [b, hq, sq])`` of one block, both in the compute dtype."""
    b, hq, sq, d = q.shape
    p, lse = _probabilities(q, k, allowed, scale, None)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(p.dtype))
    return out.reshape(b, hq, sq, v.shape[-1]), lse.reshape(b, hq, sq)


def attention_backward_math(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, *, scale: float, allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block in the compute dtype, from the final ``lse`` and
    ``delta = rowsum(dout * out_final)`` ``[b, hq, sq]`` of its queries."""
    b, hq, sq, d = q.shape
    hk = k.shape[1]
    p, _ = _probabilities(q, k, allowed, scale, lse)
    ct = p.dtype
    dout_g = _grouped(dout, hk).to(ct)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dout_g)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dout_g, v.to(ct))
    ds = p * (dp - _grouped(delta.unsqueeze(-1), hk).to(ct))
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(ct)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, _grouped(q, hk).to(ct)) * scale
    return dq.reshape(b, hq, sq, d), dk, dv


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
    document_ids: torch.Tensor | None = None, scale: float | None = None,
) -> torch.Tensor:
    """Whole-sequence attention ``[b, s, hq, d]`` from ``[b, s, h, d]`` inputs through torch's own
    ``scaled_dot_product_attention`` (kv heads repeated for GQA): the independent oracle tests use."""
    hq, hk = q.shape[2], k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(hq // hk, dim=1), vh.repeat_interleave(hq // hk, dim=1)
    s = q.shape[1]
    mask = block_mask(s, s, causal=causal, q_doc=document_ids, k_doc=document_ids, device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=None if mask is None else mask[:, None], scale=scale
    )
    return out.transpose(1, 2)
