"""Types of a published training run (``published_runs.yaml``), as frozen dataclasses.

A run is what its source states (see the data file's header for each field's meaning);
derived quantities (tokens per step, micro-batches, implied FLOPs per token) are properties.
Parsing and checks live in ``published`` and ``published_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class MoEShape:
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int
    shared_expert_ffn: int
    dense_layers: int  # leading layers with a dense MLP of width ``ModelShape.ffn``
    capacity_factor: float | None  # None: dropless


@dataclass(frozen=True)
class MLAShape:
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    params_b: float | None
    layers: int
    hidden: int
    heads: int
    kv_heads: int | None  # None: heads (multi-head attention)
    head_dim: int | None  # None: hidden // heads
    ffn: int
    mlp: str
    vocab: int
    tied_embeddings: bool
    attention: str
    moe: MoEShape | None
    mla: MLAShape | None = None

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def query_head_dim(self) -> int:
        return self.hidden // self.heads if self.head_dim is None else self.head_dim


@dataclass(frozen=True)
class Hardware:
    device: str
    gpus: int
    gpus_per_node: int
    network: str


@dataclass(frozen=True)
class RunLayout:
    tp: int
    pp: int
    vp: int
    cp: int
    ep: int
    etp: int
    dp: int
    micro_batch: int
    sequence_parallel: bool
    recompute: str
    zero_stage: int
    schedule: str
    precision: str
    cp_comm: str = "p2p"  # how the cp ranks exchange K/V (``parallel3d.context_parallel``): p2p ring, allgather, a2a


@dataclass(frozen=True)
class Batch:
    global_batch: int
    seq_len: int


@dataclass(frozen=True)
class Published:
    primary: str
    mfu_percent: float | None = None
    hfu_percent: float | None = None
    tflops_per_gpu: float | None = None
    tokens_per_s_per_gpu: float | None = None
    step_time_s: float | None = None


@dataclass(frozen=True)
class FlopsConvention:
    recompute_counted: str
    attention: str
    gqa_accounted: str
    logits_counted: str
    peak_tflops: float | None
    formula: str


@dataclass(frozen=True)
class Source:
    citation: str
    location: str
    url: str
    verified: str


@dataclass(frozen=True)
class PublishedRun:
    """One published run; fields not named in ``inferred`` are as the source states them."""

    id: str
    split: str
    model: ModelShape
    hardware: Hardware
    layout: RunLayout
    batch: Batch
    published: Published
    flops_convention: FlopsConvention
    source: Source
    inferred: Mapping[str, str]
    notes: str = ""
    # Rank check only (``validation.rank_run``; the data file's header states the rule): layout fields the
    # source does not state, which the check completes at the planner's best allowed choice instead of the
    # placeholder written here; and parallel degrees the source states its experiment held fixed, with the
    # source's words, which the search then holds at the published value.
    unstated: tuple[str, ...] = ()
    rank_fixed: Mapping[str, str] | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.batch.global_batch * self.batch.seq_len

    @property
    def microbatches(self) -> int:
        """Micro-batches per data-parallel rank per step."""
        return self.batch.global_batch // (self.layout.micro_batch * self.layout.dp)

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """As published, else from the published step time."""
        if self.published.tokens_per_s_per_gpu is not None:
            return self.published.tokens_per_s_per_gpu
        if self.published.step_time_s is not None:
            return self.tokens_per_step / (self.published.step_time_s * self.hardware.gpus)
        return None

    @property
    def mfu(self) -> float | None:
        """The published MFU as a fraction, else TFLOP/s over the convention's peak."""
        if self.published.mfu_percent is not None:
            return self.published.mfu_percent / 100
        if self.published.tflops_per_gpu is not None and self.flops_convention.peak_tflops:
            return self.published.tflops_per_gpu / self.flops_convention.peak_tflops
        return None

    @property
    def implied_flops_per_token(self) -> float | None:
        """FLOPs per token the source counted (its convention), where its numbers pin it down."""
        rate = self.tokens_per_s_per_gpu
        if rate is None:
            return None
        if self.published.tflops_per_gpu is not None:
            return self.published.tflops_per_gpu * 1e12 / rate
        if self.published.mfu_percent is not None and self.flops_convention.peak_tflops:
            return self.published.mfu_percent / 100 * self.flops_convention.peak_tflops * 1e12 / rate
        return None
