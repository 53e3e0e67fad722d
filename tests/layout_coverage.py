"""What the layout matrix's CI sample must always cover: named predicates over a drawn layout.

Invariant: ``COVER_BASE + k`` is the id of the layout drawn under the k-th property of ``CI_MUST_COVER``,
so a property is only ever appended (the ones before keep their ids and their CI cases). A predicate
reads only a case's ``parallel``, ``train``, ``model``, ``emulate_nccl`` and ``document_mask`` (``LayoutCase``'s
fields: ``tests/layout_matrix.py`` draws the cases and builds the sample from these).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from parallel3d.pipeline.options import AUTO, INTERLEAVED, SPLIT_DRAIN_SCHEDULES, drain_is_split


class DrawnLayout(Protocol):
    """The fields of ``layout_matrix.LayoutCase`` the predicates read (no import of the drawing module)."""

    model: str
    parallel: dict[str, Any]
    train: dict[str, Any]
    emulate_nccl: bool
    document_mask: bool

def _splits(c: DrawnLayout) -> bool:
    """Whether the case's pipeline splits its drain backwards (the engine's own rule)."""
    return drain_is_split(c.parallel["schedule"], c.parallel.get("split_drain", AUTO), c.train["recompute"])


# Properties CI must always cover (the gaps that once hid every pp >= 3 failure).
CI_MUST_COVER: dict[str, Callable[[DrawnLayout], bool]] = {
    "pp3_dp>1_zero2": lambda c: c.parallel["pp"] == 3 and c.parallel["dp"] > 1 and c.parallel["zero_stage"] == 2,
    "pp4_dp>1_zero2": lambda c: c.parallel["pp"] == 4 and c.parallel["dp"] > 1 and c.parallel["zero_stage"] == 2,
    "1f1b_pp>=3_dp>1": lambda c: c.parallel["schedule"] == "1f1b" and c.parallel["pp"] >= 3 and c.parallel["dp"] > 1,
    "interleaved_pp>=3": lambda c: c.parallel["schedule"] == "interleaved_1f1b" and c.parallel["pp"] >= 3,
    "nccl_semantics_pp>=3": lambda c: c.emulate_nccl and c.parallel["pp"] >= 3,
    "tp4_sequence_parallel": lambda c: c.parallel["tp"] == 4 and c.parallel["sequence_parallel"],
    "uneven_pp_layers_pp>=3": lambda c: c.parallel["pp_layers"] is not None and c.parallel["pp"] >= 3,
    "zb_h1_pp>=3_dp>1": lambda c: c.parallel["schedule"] == "zb_h1" and c.parallel["pp"] >= 3 and c.parallel["dp"] > 1,
    "zb_h1_pp>=2_tp>1": lambda c: c.parallel["schedule"] == "zb_h1" and c.parallel["pp"] >= 2 and c.parallel["tp"] > 1,
    # ZB-V: both ends of the tied gpt on stage 0, summed there (and in ZeRO's pieces)
    "zbv_pp>=2_tied_zero>=1": lambda c: c.parallel["schedule"] == "zbv" and c.parallel["pp"] >= 2
    and c.model == "gpt" and c.parallel["zero_stage"] >= 1,
    "zero3_pp>1_dp>1": lambda c: c.parallel["zero_stage"] == 3 and c.parallel["pp"] > 1 and c.parallel["dp"] > 1,
    "offload_disk_dp>1": lambda c: c.parallel["offload"] == "disk" and c.parallel["dp"] > 1,
    "zero0_dp>1": lambda c: c.parallel["zero_stage"] == 0 and c.parallel["dp"] > 1,
    "gpipe_pp>=2": lambda c: c.parallel["schedule"] == "gpipe" and c.parallel["pp"] >= 2,
    "llama_pp>=3": lambda c: c.model == "llama" and c.parallel["pp"] >= 3,
    "cp_pp>=3": lambda c: c.parallel["cp"] > 1 and c.parallel["pp"] >= 3,
    "cp_tp_sequence_parallel": lambda c: c.parallel["cp"] > 1 and c.parallel["sequence_parallel"],
    "cp_zero3": lambda c: c.parallel["cp"] > 1 and c.parallel["zero_stage"] == 3,
    "cp_a2a+p2p": lambda c: c.parallel["cp_comm"] == "a2a+p2p" and c.parallel["cp_a2a_size"] not in (1, c.parallel["cp"]),
    "cp_document_mask": lambda c: c.parallel["cp"] > 1 and c.document_mask,
    # Mixtures of experts (drawn by _draw_moe): a pipeline stage without MoE layers must not hang or
    # skew the expert reduction; experts in their own ZeRO-3 layout over edp; the router's gradient summed
    # over tp under sequence parallel; expert tp folded apart from tp; cp's tokens in the capacity/loss set.
    "moe_ep>1_pp>=3_stage_without_moe": lambda c: c.parallel.get("ep", 1) > 1 and c.parallel["pp"] >= 3
    and c.model == "deepseek" and (c.parallel["pp_layers"] or [0])[0] == 1,
    "moe_ep>1_tp>1_sequence_parallel": lambda c: c.parallel.get("ep", 1) > 1 and c.parallel["tp"] > 1
    and c.parallel["sequence_parallel"],
    "moe_ep>1_etp!=tp": lambda c: c.parallel.get("ep", 1) > 1 and c.parallel.get("etp", c.parallel["tp"]) != c.parallel["tp"],
    "moe_ep>1_cp>1": lambda c: c.parallel.get("ep", 1) > 1 and c.parallel.get("cp", 1) > 1,
    "moe_ep>1_zero3": lambda c: c.parallel.get("ep", 1) > 1 and c.parallel["zero_stage"] == 3,
    # parallel.expert_zero_stage: experts and dense parameters at different ZeRO stages (ep > 1: edp != dp_cp).
    "moe_ep>1_expert_zero_stage!=zero_stage": lambda c: c.parallel.get("ep", 1) > 1
    and c.parallel.get("expert_zero_stage") not in (None, c.parallel["zero_stage"]),
    # Last, so the properties above keep their coverage ids (COVER_BASE + k).
    # Both end chunks without a layer (embedding alone; final norm, head and loss alone), across stages.
    "empty_first_and_last_chunk_pp>=2": lambda c: (c.parallel["pp_layers"] or [1])[0] == 0
    and c.parallel["pp_layers"][-1] == 0 and c.parallel["pp"] >= 2,
    # parallel.split_drain (drawn by _draw_pipe): interleaved 1F1B's split drain on uneven stages (the default
    # since session 40; the interleaved cases above all ran recompute=full, where it does not split), and a
    # plain drain where the default would split (split_drain=false).
    "pipe_interleaved_split_drain_uneven_pp>=3": lambda c: c.parallel["schedule"] == INTERLEAVED
    and c.parallel["pp"] >= 3 and c.parallel["pp_layers"] is not None and _splits(c),
    "pipe_plain_drain_pp>=3": lambda c: c.parallel["schedule"] in SPLIT_DRAIN_SCHEDULES and c.parallel["pp"] >= 3
    and c.parallel.get("split_drain", AUTO) is False and c.train["recompute"] != "full",
}


COVER_BASE = 10_000  # id COVER_BASE + k: a layout drawn under property k of CI_MUST_COVER
