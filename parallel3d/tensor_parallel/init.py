"""Layout-independent parameter initialisation.

Invariant: the *full* (unsharded, unpadded) value of a parameter depends only on
``(seed, global_name, full shape, std)``; a rank keeps its tp shard of it. So
for a given seed every tp / pp / dp layout holds the same model, bit for bit.

The full tensor, viewed as ``[rows, cols]`` (rows = dim 0), is generated in
blocks of ``rows_per_block(cols)`` rows; block ``i`` comes from its own
``torch.Generator`` seeded with a stable hash of ``(seed, global_name, i)``.
The block size depends only on the full shape, never on tp, and a shard split
along dim 0 generates only the blocks it overlaps, so memory stays bounded
(one block) and big embeddings are not generated whole on every rank.
Random numbers are drawn on the CPU in float32 and then cast and moved, so the
values are the same whatever the device or the parameter dtype.
"""

from __future__ import annotations

import hashlib

import torch

BLOCK_ELEMENTS = 1 << 22  # 16 MiB of float32 per generated block


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a stable hash of ``parts`` (never Python's salted ``hash``)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


def rows_per_block(cols: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(cols, 1))


def _normal_rows(seed: int, name: str, full_rows: int, cols: int, start: int, stop: int, std: float) -> torch.Tensor:
    """Rows ``[start, stop)`` of the full ``[full_rows, cols]`` normal(0, std) tensor."""
    per = rows_per_block(cols)
    out = torch.empty(stop - start, cols, dtype=torch.float32)
    block = start // per
    while block * per < stop:
        b0, b1 = block * per, min((block + 1) * per, full_rows)
        gen = torch.Generator().manual_seed(stable_seed(seed, name, block))
        values = torch.randn(b1 - b0, cols, generator=gen, dtype=torch.float32).mul_(std)
        lo, hi = max(b0, start), min(b1, stop)
        out[lo - start : hi - start] = values[lo - b0 : hi - b0]
        block += 1
    return out


def normal_shard(
    param: torch.Tensor,
    *,
    seed: int,
    global_name: str,
    std: float,
    split_dim: int | None,
    tp_rank: int,
    tp_size: int,
    logical_rows: int | None = None,
) -> None:
    """Fill ``param`` (this rank's shard) in place with its slice of the full normal(0, std) tensor.

    ``logical_rows``: the unpadded size of dim 0 (vocabulary padding); rows past it are zero.
    The padded full dim-0 size is ``param.shape[0] * tp_size`` when ``split_dim == 0``.
    """
    if param.is_meta:
        return
    local = tuple(param.shape)
    full = list(local)
    if split_dim is not None:
        full[split_dim] *= tp_size
    padded_rows = full[0]
    rows = padded_rows if logical_rows is None else logical_rows
    if rows > padded_rows:
        raise ValueError(f"{global_name}: logical_rows={rows} exceeds the padded size {padded_rows}")
    cols = 1
    for d in full[1:]:
        cols *= d
    if split_dim == 0:
        start, stop = tp_rank * local[0], (tp_rank + 1) * local[0]
    else:
        start, stop = 0, padded_rows
    value = torch.zeros(stop - start, cols, dtype=torch.float32)
    real_stop = min(stop, rows)
    if real_stop > start:
        value[: real_stop - start] = _normal_rows(seed, global_name, rows, cols, start, real_stop, std)
    value = value.reshape(stop - start, *full[1:])
    if split_dim is not None and split_dim != 0:
        value = value.chunk(tp_size, dim=split_dim)[tp_rank]
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype))
