"""Packed documents: which document each token belongs to, and its position inside it.

A packed sequence ``tokens [b, s]`` holds documents back to back, each ending with the
end-of-document token ``eod_id``. The EOD token belongs to the document it ends; the
next token starts a new document. Document ids count the EODs strictly before a token,
so they are non-decreasing along the sequence and start at 0 in every row.

With ``data.document_mask=true`` attention stays inside a document and positions (RoPE)
restart at 0 at each document's first token. Compute both on the whole sequence, then
split positions with the tokens (``load_balance.split_for_cp``) and give the attention
the whole ``document_ids`` (every rank needs the document of every key it receives).
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """``[b, s]`` int64: number of EOD tokens before each position (EOD ends its own document)."""
    is_eod = (tokens == eod_id).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod


def document_position_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """``[b, s]`` int64 positions that restart at 0 after every EOD token."""
    s = tokens.shape[-1]
    idx = torch.arange(s, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[..., 1:] = tokens[..., :-1] == eod_id
    starts[..., 0] = True
    # Index of the latest document start at or before each position.
    start_idx = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - start_idx


def position_ids(batch: int, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """``[b, s]`` plain positions 0..s-1 (no document mask)."""
    return torch.arange(seq_len, device=device).expand(batch, seq_len)
