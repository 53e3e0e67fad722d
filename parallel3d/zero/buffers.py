"""Flat parameter / gradient buffers cut into buckets, and each data-parallel rank's share of them.

Layout (shared by ZeRO stages 0-3, one layout per parameter dtype and replica group):

- A layout names the group kind its parameters are replicated over (``reduce_kind``:
  ``dp_cp`` for dense parameters, later ``edp`` for experts): gradients are reduced,
  and optimizer states sharded, over that group of ``replicas`` ranks, never an
  assumed ``dp``.

- Parameters are packed into one contiguous buffer in *reverse* registration
  order, which approximates the order backward produces gradients, so the
  first bucket filled during backward is the first one reduced.
- The buffer is cut into buckets of at most ``bucket_numel`` elements (a
  parameter is never split; one larger than a bucket gets a bucket of its own),
  except that a bucket still holding less than a quarter of the size takes the
  next parameter even when it overflows (so at most ``max(bucket_numel, largest
  parameter) + bucket_numel / 4``): cutting before it would leave a small
  leftover bucket (e.g. a LayerNorm and a bias before a large weight) paying a
  whole collective's latency, where DDP's buckets would hold the whole layer.
  The first bucket (the first gradients backward produces) is limited to
  ``first_bucket_numel`` (DDP's 1 MiB), so the first reduction starts early.
  Every bucket is padded with zeros to a multiple of
  ``replicas`` so it divides evenly.
- In bucket ``b`` (flat range ``[start, start + size)``), replica ``r`` owns the
  contiguous piece ``[start + r*size/n, start + (r+1)*size/n)``, ``n = replicas``. The rank's
  *shard* is the concatenation of its pieces over all buckets, in bucket order;
  fp32 master weights, Adam moments (and the stage-2 gradient shard) are flat
  tensors in these shard coordinates. Gradient buffers and staging buffers use
  the same layout in the gradient dtype (fp32 main grads or the parameters').
- With ``owner_count == 1`` (stage 0, plain data parallel) a rank owns every
  bucket whole; the layout, padding and collectives' sizes stay the same.
- With ``unit_of`` (ZeRO stage 3), a bucket never holds parameters of two
  gather units: a unit's full parameters are then exactly some whole buckets,
  which stage 3 gathers and frees together (``params_sharded``).

Tied-embedding copies get buckets of their own (one copy per bucket), after all
others, so the two copies (on the first and last pipeline stage, same tp/dp
coordinates, or both on one stage with ZB-V) have identical tied buckets and pieces:
``grad_sync`` sums their replica-reduced pieces element-wise, over the ``embedding`` group
or on the one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from parallel3d import param_meta


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat buffer."""

    param: torch.nn.Parameter = field(repr=False, compare=False)
    name: str
    start: int  # flat offset of element 0
    numel: int
    decay: bool  # subject to weight decay
    norm_counted: bool  # this rank counts it in the global grad norm
    tied: bool

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Segment:
    """A run of the local shard that lies inside one parameter.

    ``[shard_start, shard_end)`` in shard coordinates maps to elements
    ``[param_start, param_start + length)`` of ``slot``'s flattened parameter.
    """

    slot: ParamSlot
    shard_start: int
    shard_end: int
    param_start: int

    @property
    def length(self) -> int:
        return self.shard_end - self.shard_start


@dataclass
class Bucket:
    """A padded range of the flat buffer that is reduced with one collective."""

    index: int
    start: int
    size: int  # padded numel, a multiple of the layout's replicas
    slots: list[ParamSlot]
    tied: bool
    piece_start: int = 0  # flat offset of the piece this rank owns
    piece_size: int = 0
    shard_offset: int = 0  # offset of that piece in the local shard
    segments: list[Segment] = field(default_factory=list)

    @property
    def used(self) -> int:
        """Elements holding parameters (the rest of ``size`` is zero padding)."""
        return sum(s.numel for s in self.slots)


def _param_name(param: torch.nn.Parameter, fallback: str) -> str:
    return getattr(param, "global_name", None) or fallback


class BufferLayout:
    """Offsets of a list of same-dtype parameters in a padded, bucketed flat buffer.

    ``named_params`` is in registration order; ``reduce_kind`` is the group kind
    the parameters are replicated over and ``replicas`` its size (the padding
    multiple); ``owner_count``/``owner_index`` say how buckets are split among
    owners (``replicas`` and this rank's index in the group for stages 1-3,
    ``1``/``0`` for stage 0). ``count_in_norm(param)`` says whether this rank
    counts a parameter in the global gradient norm. ``unit_of(param)``, if given,
    names the parameter's gather unit: a new bucket starts wherever it changes.
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        *,
        bucket_numel: int,
        reduce_kind: str,
        replicas: int,
        owner_count: int,
        owner_index: int,
        count_in_norm,
        unit_of: Callable[[torch.nn.Parameter], Hashable] | None = None,
        first_bucket_numel: int | None = None,
    ) -> None:
        if bucket_numel <= 0:
            raise ValueError(f"bucket_numel={bucket_numel} must be > 0")
        if not named_params:
            raise ValueError("BufferLayout needs at least one parameter")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"one BufferLayout holds one dtype, got {sorted(map(str, dtypes))}")
        self.dtype: torch.dtype = next(iter(dtypes))
        self.reduce_kind = reduce_kind
        self.replicas = replicas
        self.buckets: list[Bucket] = []
        ordered = list(reversed(named_params))
        plain = [(n, p) for n, p in ordered if not param_meta.is_tied_embedding(p)]
        tied = [(n, p) for n, p in ordered if param_meta.is_tied_embedding(p)]
        offset = 0
        for group, is_tied in ((plain, False), (tied, True)):
            current: list[tuple[str, torch.nn.Parameter]] = []
            current_numel = 0
            for name, p in group:
                # Each tied copy gets buckets of its own: two copies on one rank (ZB-V) then have
                # identical pieces, which grad_sync sums element-wise.
                new_unit = bool(current) and (is_tied or (unit_of is not None and unit_of(current[-1][1]) != unit_of(p)))
                limit = bucket_numel if self.buckets or first_bucket_numel is None else first_bucket_numel
                overflows = current_numel + p.numel() > limit and current_numel >= limit // 4
                if current and (new_unit or overflows):
                    offset = self._add_bucket(current, offset, is_tied, count_in_norm)
                    current, current_numel = [], 0
                current.append((name, p))
                current_numel += p.numel()
            if current:
                offset = self._add_bucket(current, offset, is_tied, count_in_norm)
        self.numel = offset
        self._assign_pieces(owner_count, owner_index)

    def _add_bucket(self, named, offset: int, tied: bool, count_in_norm) -> int:
        slots, cursor = [], offset
        for name, p in named:
            slots.append(
                ParamSlot(
                    param=p,
                    name=name,
                    start=cursor,
                    numel=p.numel(),
                    decay=not param_meta.no_weight_decay(p),
                    norm_counted=bool(count_in_norm(p)),
                    tied=tied,
                )
            )
            cursor += p.numel()
        used = cursor - offset
        size = -(-used // self.replicas) * self.replicas
        self.buckets.append(Bucket(index=len(self.buckets), start=offset, size=size, slots=slots, tied=tied))
        return offset + size

    def _assign_pieces(self, owner_count: int, owner_index: int) -> None:
        shard = 0
        for b in self.buckets:
            b.piece_size = b.size // owner_count
            b.piece_start = b.start + owner_index * b.piece_size
            b.shard_offset = shard
            piece_end = b.piece_start + b.piece_size
            for s in b.slots:
                lo, hi = max(s.start, b.piece_start), min(s.end, piece_end)
                if lo < hi:
                    b.segments.append(
                        Segment(slot=s, shard_start=shard + lo - b.piece_start,
                                shard_end=shard + hi - b.piece_start, param_start=lo - s.start)
                    )
            shard += b.piece_size
        self.shard_numel = shard

    @property
    def slots(self) -> list[ParamSlot]:
        return [s for b in self.buckets for s in b.slots]

    @property
    def max_bucket_size(self) -> int:
        return max(b.size for b in self.buckets)


class FlatBuffer:
    """A zero-initialised flat tensor laid out by ``layout``, with per-parameter views."""

    def __init__(self, layout: BufferLayout, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.data = torch.zeros(layout.numel, dtype=dtype, device=device)

    def view_of(self, slot: ParamSlot) -> torch.Tensor:
        return self.data[slot.start : slot.end].view(slot.param.shape)

    def bucket_view(self, bucket: Bucket) -> torch.Tensor:
        return self.data[bucket.start : bucket.start + bucket.size]

    def piece_view(self, bucket: Bucket) -> torch.Tensor:
        return self.data[bucket.piece_start : bucket.piece_start + bucket.piece_size]

    def adopt_params(self) -> None:
        """Copy every parameter into the buffer and make the parameter a view of it."""
        with torch.no_grad():
            for slot in self.layout.slots:
                view = self.view_of(slot)
                view.copy_(slot.param.detach())
                slot.param.data = view


def shard_slice(t: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """``bucket``'s piece inside a flat tensor in shard coordinates."""
    return t[bucket.shard_offset : bucket.shard_offset + bucket.piece_size]
