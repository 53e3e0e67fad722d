"""One candidate way to run a model: parallel degrees plus per-step batch settings.

A ``Layout`` uses the same key names as the training config (``parallel.*`` and
``train.*``), so a layout the planner prints can be pasted as Hydra overrides. Its
values are those of the options the training job is built from (``ParallelDims``,
``PipelineOptions``, ``ZeroOptions``, ``TrainOptions``): the same defaults, the same
allowed values, validated by them (``dims`` / ``pipeline`` / ``zero`` / ``train``).
Two differences, both because a layout is concrete: ``dp`` is a number (1 unless given;
"auto" needs a world size), and ``global_batch_size=None`` means one microbatch per
data-parallel rank. ``sequence_parallel`` at tp = 1 is accepted and dropped, so tp sweeps
can keep the flag on.
Invariant: a constructed ``Layout`` is self-consistent (valid values, ``global_batch_size``
divisible by ``dp * micro_batch_size``); whether it fits a *model* is checked separately by
``check_fits_model``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from models.config import ModelConfig
from parallel3d.context_parallel.options import ContextParallelOptions
from parallel3d.option_checks import ConfigError, check_choice, check_int
from parallel3d.parallel_dims import ParallelDims
from parallel3d.pipeline.options import PipelineOptions
from parallel3d.pipeline.placement import ChunkPlacement, placement_for
from parallel3d.topology import LayoutError, Topology
from parallel3d.train_options import TrainOptions
from parallel3d.zero.options import ZeroOptions, resolve_reshard

# offload=disk is priced without a directory; the one the job will use is chosen at launch.
UNCHOSEN_OFFLOAD_DIR = "<parallel.offload_dir>"


@dataclass(frozen=True)
class Layout:
    tp: int = ParallelDims.tp
    pp: int = ParallelDims.pp
    dp: int = 1
    cp: int = ParallelDims.cp
    cp_comm: str = ContextParallelOptions.cp_comm
    cp_a2a_size: int | None = ContextParallelOptions.cp_a2a_size
    ep: int = ParallelDims.ep
    etp: int | None = ParallelDims.etp  # None: the dense tp
    expert_zero_stage: int | None = ZeroOptions.expert_zero_stage  # None: the dense zero_stage (experts shard over edp)
    zero_stage: int = ZeroOptions.zero_stage
    sequence_parallel: bool = ParallelDims.sequence_parallel
    schedule: str = PipelineOptions.schedule
    virtual_stages: int = PipelineOptions.virtual_stages
    split_drain: bool | str = PipelineOptions.split_drain  # auto | true | false (``splits_drain``: resolved)
    micro_batch_size: int = TrainOptions.micro_batch_size
    seq_len: int = TrainOptions.seq_len
    global_batch_size: int | None = None  # None: one microbatch per data-parallel rank
    recompute: str = TrainOptions.recompute
    precision: str = TrainOptions.precision
    grad_reduce_dtype: str = ZeroOptions.grad_reduce_dtype  # fp32 main grads, or the precision's own
    offload: str = ZeroOptions.offload  # where master weights + Adam moments live (none | cpu | disk)
    zero3_prefetch: int = ZeroOptions.zero3_prefetch  # units gathered ahead (stage 3)
    zero3_reshard: str = ZeroOptions.zero3_reshard  # microbatch | step (auto: step if pp > 1)

    def __post_init__(self) -> None:
        if self.sequence_parallel is True and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)
        check_int("parallel.dp", self.dp, 1)
        if self.expert_zero_stage is not None:
            check_choice("parallel.expert_zero_stage", self.expert_zero_stage, (0, 1, 2, 3))
        dims, pipeline = self.dims, self.pipeline
        self.context_parallel  # validates cp_comm / cp_a2a_size
        if self.global_batch_size is None:
            mbs = check_int("train.micro_batch_size", self.micro_batch_size, 1)
            object.__setattr__(self, "global_batch_size", self.dp * mbs)
        train = self.train
        self.zero.check_precision(train.precision)
        pipeline.check_layout(dims.pp)
        pipeline.check_microbatches(dims.pp, train.grad_accum(self.dp))
        pipeline.splits_drain(train.recompute)  # split_drain=true with recompute=full: refused

    # ---- the options this layout stands for ----------------------------------------------
    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, ep=self.ep, etp=self.etp,
                            sequence_parallel=self.sequence_parallel)

    @property
    def context_parallel(self) -> ContextParallelOptions:
        return ContextParallelOptions(cp_comm=self.cp_comm, cp_a2a_size=self.cp_a2a_size)

    @property
    def expert_zero(self) -> int:
        """The ZeRO stage of the routed experts' parameters (sharded over edp)."""
        return self.zero_stage if self.expert_zero_stage is None else self.expert_zero_stage

    @property
    def pipeline(self) -> PipelineOptions:
        return PipelineOptions(schedule=self.schedule, virtual_stages=self.virtual_stages,
                               split_drain=self.split_drain)

    @property
    def splits_drain(self) -> bool:
        """Whether this layout's 1F1B splits its drain backwards (``pipeline.options.drain_is_split``)."""
        return self.pipeline.splits_drain(self.recompute)

    @property
    def zero(self) -> ZeroOptions:
        return ZeroOptions(zero_stage=self.zero_stage, expert_zero_stage=self.expert_zero_stage,
                           grad_reduce_dtype=self.grad_reduce_dtype, offload=self.offload,
                           offload_dir=UNCHOSEN_OFFLOAD_DIR if self.offload == "disk" else None,
                           zero3_prefetch=self.zero3_prefetch, zero3_reshard=self.zero3_reshard)

    @property
    def train(self) -> TrainOptions:
        return TrainOptions(micro_batch_size=self.micro_batch_size, seq_len=self.seq_len,
                            global_batch_size=self.global_batch_size, recompute=self.recompute,
                            precision=self.precision)

    @property
    def topology(self) -> Topology:
        return self.dims.build_topology()

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        """Microbatches per pipeline per step."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def zero3_mode(self) -> str:
        """When stage 3 frees gathered parameters: ``microbatch`` or ``step`` (``auto``: step if pp > 1)."""
        return resolve_reshard(self.zero3_reshard, self.pp)

    @property
    def placement(self) -> ChunkPlacement:
        """Which stage runs each model chunk (``pipeline.placement``: zbv's V puts the head on stage 0)."""
        return placement_for(self.schedule, self.pp, self.virtual_stages)

    @property
    def num_chunks(self) -> int:
        """Model chunks in the whole pipeline (pp * virtual_stages)."""
        return self.pp * self.virtual_stages

    def replace(self, **changes: Any) -> "Layout":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def overrides(self) -> str:
        """The layout as Hydra overrides for scripts/train.py, estimate_memory.py and plan.py."""
        def text(value: Any) -> str:
            return str(value).lower() if isinstance(value, bool) else str(value)

        keys = [k for k in PARALLEL_KEYS if k not in OPTIONAL_PARALLEL_KEYS]
        if self.offload != "none":  # offload=disk also needs parallel.offload_dir (a fast local disk)
            keys.append("offload")
        if self.zero_stage == 3:
            keys += ["zero3_prefetch", "zero3_reshard"]
        if self.cp > 1:
            keys += ["cp_comm"] + (["cp_a2a_size"] if self.cp_a2a_size is not None else [])
        keys += [k for k in ("etp", "expert_zero_stage") if getattr(self, k) is not None]
        if self.split_drain != PipelineOptions.split_drain:
            keys.append("split_drain")
        parts = [f"parallel.{k}={text(getattr(self, k))}" for k in keys]
        parts += [f"train.{k}={text(getattr(self, k))}" for k in TRAIN_KEYS]
        return " ".join(parts)

    def short(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        sp = " sp" if self.sequence_parallel else ""
        off = f" offload={self.offload}" if self.offload != "none" else ""
        cp = f" cp={self.cp}({self.cp_comm})" if self.cp > 1 else ""
        ep = f" ep={self.ep}" + (f" etp={self.etp}" if self.etp is not None else "") if self.ep > 1 else ""
        return (
            f"tp={self.tp}{cp}{ep} pp={self.pp} dp={self.dp}{v} mbs={self.micro_batch_size} "
            f"zero={self.zero_stage}{off} rc={self.recompute}{sp}"
        )


PARALLEL_KEYS: tuple[str, ...] = ("tp", "cp", "cp_comm", "cp_a2a_size", "ep", "etp", "pp", "dp", "zero_stage",
                                  "expert_zero_stage", "sequence_parallel", "schedule", "virtual_stages",
                                  "split_drain", "grad_reduce_dtype", "offload", "zero3_prefetch", "zero3_reshard")
OPTIONAL_PARALLEL_KEYS: tuple[str, ...] = ("offload", "zero3_prefetch", "zero3_reshard", "cp_comm", "cp_a2a_size",
                                           "etp", "expert_zero_stage", "split_drain")  # printed when they matter
TRAIN_KEYS: tuple[str, ...] = ("micro_batch_size", "seq_len", "global_batch_size", "recompute", "precision")


def layout_keys() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Layout))


def check_fits_model(config: ModelConfig, layout: Layout) -> None:
    """Raise ``LayoutError`` if ``config`` cannot be split by ``layout`` (heads, layers, sequence)."""
    layout.topology.check_model(**config.layout_sizes(), virtual_stages=layout.virtual_stages)
    if layout.sequence_parallel and layout.seq_len % layout.tp:
        raise LayoutError(
            f"train.seq_len={layout.seq_len} is not divisible by parallel.tp={layout.tp} "
            f"(sequence parallel splits the sequence over the tensor-parallel group)"
        )
    try:
        layout.context_parallel.check_layout(cp=layout.cp, tp=layout.tp, seq_len=layout.seq_len,
                                             num_heads=config.num_heads, num_kv_heads=config.kv_heads,
                                             sequence_parallel=layout.sequence_parallel)
    except ConfigError as exc:
        raise LayoutError(str(exc)) from None
    if layout.seq_len > config.max_seq_len:
        raise LayoutError(f"train.seq_len={layout.seq_len} exceeds model.max_seq_len={config.max_seq_len}")
