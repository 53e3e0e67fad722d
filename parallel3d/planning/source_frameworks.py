"""What each published run's source measured: its framework's cost options, its FLOPs convention, and the
layouts its framework could run (``published_runs.yaml``'s ``source`` citation decides; nothing per row).

Invariant: a rule here is keyed on the source's citation prefix and stated with the framework code behind it,
never fitted; ``validation`` prices and ranks with these, ``fit`` calibrates with the same ones.
"""

from __future__ import annotations

from dataclasses import replace

from models.config import ModelConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.cost_options import MCORE_BUCKET_PARAMS, CostOptions
from parallel3d.planning.published_schema import PublishedRun

# Sources that measured 2021-22 Megatron-LM (no distributed optimizer, unfused attention, gradients
# all-reduced after the backward); every other run is priced as Megatron-Core / torchtitan-style
# overlapped data parallelism. Chosen by the framework the source states, not fitted per row.
MEGATRON_2021_SOURCES: tuple[str, ...] = ("Narayanan et al.", "Korthikanti et al.")


# Sources that state they ran Megatron-Core's --tp-comm-overlap (TP collectives behind the GEMMs).
TP_OVERLAP_SOURCES: tuple[str, ...] = ("NVIDIA Megatron-LM README",)


# Sources that measured Megatron-LM before commit 0fda386c04 (2024-04-11, "Tune DDP bucket size to improve speed
# at large DP counts"): its DistributedDataParallel cut the gradients into buckets of a fixed 40,000,000
# parameters (the constructor's ``bucket_size`` default, which training.py did not override), each one NCCL
# ring call whose latency grows with the nodes in the ring; that commit made it max(4e7, 1e6 x dp)
# (``CostOptions.megatron_core``). The Nemotron-4 15B report is arXiv:2402.16819 v1 of 2024-02-26, so its
# runs predate the change. (Nemotron-4 340B's report, June 2024, does not date its runs: not listed.)
FIXED_BUCKET_SOURCES: tuple[str, ...] = ("NVIDIA, Nemotron-4 15B",)

# Sources that measured torchtitan, whose selective checkpointing recomputes every second matmul and whose FSDP2
# gathers and reduce-scatters each block in one call (``CostOptions.zero3_unit_calls``).
TORCHTITAN_SOURCES: tuple[str, ...] = ("torchtitan",)

# Sources whose framework split the layers evenly: Megatron-LM asserts num_layers % pp == 0 (and, when
# interleaving, layers per stage % layers per virtual stage == 0) in arguments.py, from 2021 until uneven
# first/last stages (--decoder-first/last-pipeline-num-layers) arrived after Megatron-Core r0.8. The rank
# search for these runs tries only even splits, as their source could have run; every other source (Llama 3
# and BLOOM state uneven stages; 2025 Megatron-Core has them) is searched with uneven stages too.
EVEN_SPLIT_SOURCES: tuple[str, ...] = MEGATRON_2021_SOURCES + ("NVIDIA Megatron-LM README", "NVIDIA, Nemotron-4")

# Sources whose framework interleaved only at pp > 2: Megatron-LM's arguments.py asserted it with
# --num-layers-per-virtual-pipeline-stage from commit 182841f7d (2021-03-20, before SC21) until
# overlap_p2p_comm (2023) kept the assertion for runs without P2P overlap only (Megatron-Core r0.8 overlaps).
INTERLEAVE_ABOVE_PP2_SOURCES: tuple[str, ...] = MEGATRON_2021_SOURCES


def run_options(run: PublishedRun) -> CostOptions:
    """The ``CostOptions`` of the framework the source measured."""
    if any(run.source.citation.startswith(s) for s in MEGATRON_2021_SOURCES):
        return CostOptions.megatron_sc21()
    options = CostOptions.megatron_core()
    if any(run.source.citation.startswith(s) for s in TP_OVERLAP_SOURCES):
        options = replace(options, tp_comm_overlap=True)
    if any(run.source.citation.startswith(s) for s in TORCHTITAN_SOURCES):
        options = replace(options, selective_recompute="alternate_matmuls", zero3_unit_calls=True)
    if any(run.source.citation.startswith(s) for s in FIXED_BUCKET_SOURCES):
        options = replace(options, grad_bucket=(MCORE_BUCKET_PARAMS, 0.0))
    return options


def source_flops_per_token(run: PublishedRun, config: ModelConfig) -> float:
    """FLOPs per token as the source counts them (module docstring)."""
    implied = run.implied_flops_per_token
    if implied is not None:
        return implied
    conv = run.flops_convention
    attention = conv.attention if conv.attention in ("full", "causal", "none") else "full"
    recompute = run.layout.recompute if conv.recompute_counted == "yes" else "none"
    flops = config.shape.flops_per_token(run.batch.seq_len, attention=attention, recompute=recompute)
    return flops.hardware if recompute != "none" else flops.model


def source_peak_flops(run: PublishedRun, cluster: ClusterSpec) -> float:
    """The peak FLOP/s per GPU the source divides by: its stated peak, else the device's datasheet peak."""
    return (run.flops_convention.peak_tflops or cluster.device.peak_flops / 1e12) * 1e12


def uneven_splits_allowed(run: PublishedRun, config: ModelConfig) -> bool:
    """Whether the run's framework could split layers unevenly: not for ``EVEN_SPLIT_SOURCES``, unless
    the published layout itself is uneven."""
    lay = run.layout
    if config.num_layers % (lay.pp * lay.vp):
        return True
    return not any(run.source.citation.startswith(s) for s in EVEN_SPLIT_SOURCES)


def interleaved_min_pp(run: PublishedRun) -> int:
    """The fewest pipeline stages the run's framework could interleave at (``INTERLEAVE_ABOVE_PP2_SOURCES``)."""
    return 3 if any(run.source.citation.startswith(s) for s in INTERLEAVE_ABOVE_PP2_SOURCES) else 2


def rank_fixed_degrees(run: PublishedRun) -> tuple[tuple[str, int], ...]:
    """The degrees the source states its experiment held fixed (``rank_fixed``), at their published values."""
    return tuple((path.split(".", 1)[1], getattr(run.layout, path.split(".", 1)[1]))
                 for path in sorted(run.rank_fixed or {}))
