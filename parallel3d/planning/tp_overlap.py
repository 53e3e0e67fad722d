"""Exposed tensor-parallel communication under TransformerEngine's userbuffers comm-GEMM overlap.

Megatron-Core's ``--tp-comm-overlap`` (sequence parallel) hands each layer's TP collectives to TE's
userbuffers (``initialize_ub``; with no ``ub_cfgs``, TE's defaults in ``module/base.py``
``get_default_config``): forward, the all-gather in front of the column-parallel GEMMs (qkv, fc1) as a
``ring_exchange`` (``num_splits = tp``, 1 SM, copy engine), the reduce-scatter after the row-parallel
ones (proj, fc2) as a ``pipeline`` (4 splits, 16 SMs); backward, the grad all-gather in front of the
row-parallel dgrad GEMMs as a ring exchange and the dgrad reduce-scatter alongside the column-parallel
wgrad GEMMs as a ``bulk`` overlap (16 SMs). What that leaves exposed, per collective:

- while a communication kernel runs beside a GEMM it holds ``num_sm`` of the device's SMs, so the GEMM
  runs ``num_sm / sms`` slower for that long; if the communication is the longer, the GEMM waits for it
  (``concurrent_exposed``);
- a ring exchange moves ``tp - 1`` chunks, each behind the GEMM of one of ``tp`` row slices (the local
  slice's GEMM needs no transfer); a pipelined reduce-scatter sends each of its slices after that slice's
  GEMM, so the last slice's share is never hidden;
- optionally (``UbConfig.price_slices``), the sliced GEMMs at their own, thinner shapes on the GEMM
  curve (``gemm.tp_split_gemms``);
- a collective with no GEMM to hide behind stays whole.

Invariant: the exposed time is never below a pipelined reduce-scatter's last slice, grows with fewer
splits or more SMs taken, and with nothing to overlap (``tp`` 1 aside) equals the unoverlapped price.
Not priced (as without the overlap): the backward's bulk all-gather of the saved input for wgrad.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig
from parallel3d.planning.gemm import GemmCurve, tp_split_gemms


@dataclass(frozen=True)
class UbConfig:
    """TE's default userbuffers settings (``get_default_config``); SMs per GPU are the device's
    (``DeviceSpec.compute_units``)."""

    ring_sm: int = 1  # ring_exchange: copy-engine P2P, one SM for the flags
    pipeline_sm: int = 16  # pipeline reduce-scatter kernels
    pipeline_splits: int = 4
    bulk_sm: int = 16  # bulk overlaps in backward
    # Price each GEMM slice at its own shape on the GEMM curve. Off: that curve, fitted on whole-layer
    # GEMMs, prices a 512-row slice of a 7,680 x 20,480 GEMM (462B, tp8, 1 x 4,096 tokens) 23% slower,
    # although its 128 x 256 tiles still fill about a wave of 132 SMs; so priced the overlap cost more
    # than no overlap on the 1-sequence microbatch rows (calibration GPT 314B -9.8%, docs/planner.md).
    price_slices: bool = False


def concurrent_exposed(comm: float, gemm: float, comm_sm: int, sms: int) -> float:
    """Time a ``comm``-second collective adds to a ``gemm``-second GEMM it runs beside: the GEMM's lost
    SMs while they share the device, or the wait for a collective longer than the slowed GEMM."""
    return max(comm * comm_sm / sms, comm - gemm)


def ring_exchange_exposed(comm: float, gemm: float, gemm_sliced: float, splits: int, comm_sm: int,
                          sms: int) -> float:
    """An all-gather of ``comm`` seconds as ``splits - 1`` point-to-point steps, each behind one of
    ``splits`` GEMM slices (together ``gemm_sliced``, vs ``gemm`` unsliced)."""
    if splits <= 1:
        return comm
    step, slice_t = comm / (splits - 1), gemm_sliced / splits
    return (splits - 1) * concurrent_exposed(step, slice_t, comm_sm, sms) + (gemm_sliced - gemm)


def pipelined_exposed(comm: float, gemm: float, gemm_sliced: float, splits: int, comm_sm: int, sms: int) -> float:
    """A reduce-scatter in ``splits`` slices, each sent after its GEMM slice: all but the last behind the
    next slice's GEMM, the last one exposed."""
    step, slice_t = comm / splits, gemm_sliced / splits
    return (splits - 1) * concurrent_exposed(step, slice_t, comm_sm, sms) + step + (gemm_sliced - gemm)


def _groups(gemms: list[tuple[int, float]]) -> list[tuple[float, float]]:
    """(column-parallel seconds, row-parallel seconds) of each column...row run of a layer, in order: one
    all-gather feeds the run's column GEMMs, one reduce-scatter follows its row GEMM."""
    out, col = [], 0.0
    for dim, t in gemms:
        if dim == 0:
            col += t
        else:
            out.append((col, t))
            col = 0.0
    return out


def tp_overlap_exposed(collective: float, pairs: int, config: ModelConfig, curve: GemmCurve, *, tp: int, cp: int,
                       micro_batch_size: int, seq_len: int, sms: int, ub: UbConfig = UbConfig()) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's ``pairs`` all-gather + reduce-scatter pairs per
    direction, each collective ``collective`` seconds, under the overlap (module docstring)."""
    if tp <= 1:
        return 0.0, 0.0
    shape = dict(tp=tp, cp=cp, micro_batch_size=micro_batch_size, seq_len=seq_len)
    whole = tp_split_gemms(config, curve, **shape)
    fwd_sliced, bwd_sliced = whole, whole
    if ub.price_slices:
        fwd_sliced = tp_split_gemms(config, curve, chunks=(tp, ub.pipeline_splits), **shape)
        bwd_sliced = tp_split_gemms(config, curve, chunks=(1, tp), **shape)
    fwd = bwd = 0.0
    for (share, g), (_, gf), (_, gb) in zip(whole, fwd_sliced, bwd_sliced):
        runs = list(zip(_groups(g), _groups(gf), _groups(gb)))
        f = b = 2 * collective * max(0, pairs - len(runs))  # collectives with no GEMM beside them
        for (col, row), (col_f, row_f), (_, row_b) in runs[:pairs]:
            f += ring_exchange_exposed(collective, col, col_f, tp, ub.ring_sm, sms)
            f += pipelined_exposed(collective, row, row_f, ub.pipeline_splits, ub.pipeline_sm, sms)
            # Backward: dgrad of a GEMM ~ its forward; the grad all-gather feeds the row GEMM's dgrad,
            # the dgrad's reduce-scatter runs in bulk beside the column GEMMs' wgrad.
            b += ring_exchange_exposed(collective, row, row_b, tp, ub.ring_sm, sms)
            b += concurrent_exposed(collective, col, ub.bulk_sm, sms)
        fwd, bwd = fwd + share * f, bwd + share * b
    return fwd, bwd
