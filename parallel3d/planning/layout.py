"""One candidate way to run a model: parallel degrees plus per-step batch settings.

A ``Layout`` uses the same key names as the training config (``parallel.*`` and
``train.*``), so a layout the planner prints can be pasted as Hydra overrides.
Invariant: a constructed ``Layout`` is self-consistent (valid enum values,
``global_batch_size`` divisible by ``dp * micro_batch_size``); whether it fits a
*model* is checked separately by ``check_fits_model``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from models.config import ModelConfig
from parallel3d.topology import LayoutError, Topology

RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp32")
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
OFFLOAD_MODES: tuple[str, ...] = ("none", "cpu", "disk")
ZERO3_RESHARD: tuple[str, ...] = ("auto", "microbatch", "step")
# Schedule names as parallel3d.pipeline.schedules and the training config spell them.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch_size: int = 1
    seq_len: int = 2048
    global_batch_size: int | None = None  # None: one microbatch per data-parallel rank
    recompute: str = "none"
    precision: str = "bf16"
    grad_reduce_dtype: str = "fp32"  # parallel.grad_reduce_dtype: fp32 main grads, or the precision's own
    offload: str = "none"  # parallel.offload: where master weights + Adam moments live (none | cpu | disk)
    zero3_prefetch: int = 1  # parallel.zero3_prefetch: units gathered ahead (stage 3)
    zero3_reshard: str = "auto"  # parallel.zero3_reshard: microbatch | step (auto: step if pp > 1)

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "virtual_stages", "micro_batch_size", "seq_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_qualified(key)}={value!r} must be an integer >= 1")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"parallel.zero_stage={self.zero_stage!r} is not one of {ZERO_STAGES}")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"parallel.offload={self.offload!r} is not one of {OFFLOAD_MODES}")
        if self.offload != "none" and self.zero_stage == 0:
            raise ValueError(f"parallel.offload={self.offload!r} needs parallel.zero_stage >= 1")
        if isinstance(self.zero3_prefetch, bool) or not isinstance(self.zero3_prefetch, int) or self.zero3_prefetch < 0:
            raise ValueError(f"parallel.zero3_prefetch={self.zero3_prefetch!r} must be an integer >= 0")
        if self.zero3_reshard not in ZERO3_RESHARD:
            raise ValueError(f"parallel.zero3_reshard={self.zero3_reshard!r} is not one of {ZERO3_RESHARD}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"train.recompute={self.recompute!r} is not one of {RECOMPUTE_MODES}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r} is not one of {PRECISIONS}")
        if self.grad_reduce_dtype not in ("fp32", self.precision):
            raise ValueError(f"parallel.grad_reduce_dtype={self.grad_reduce_dtype!r} must be fp32 or "
                             f"train.precision={self.precision!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"parallel.schedule={self.schedule!r} is not one of {SCHEDULES}")
        if self.schedule == "interleaved_1f1b" and (self.virtual_stages < 2 or self.pp < 2):
            raise ValueError(
                f"parallel.schedule='interleaved_1f1b' needs parallel.pp >= 2 and parallel.virtual_stages >= 2, "
                f"got pp={self.pp}, virtual_stages={self.virtual_stages}"
            )
        if self.schedule != "interleaved_1f1b" and self.virtual_stages != 1:
            raise ValueError(
                f"parallel.virtual_stages={self.virtual_stages} needs parallel.schedule='interleaved_1f1b', "
                f"got {self.schedule!r}"
            )
        if self.sequence_parallel and self.tp == 1:
            # Harmless but meaningless; accepted so tp sweeps can keep the flag on.
            object.__setattr__(self, "sequence_parallel", False)
        gbs = self.global_batch_size
        if gbs is None:
            object.__setattr__(self, "global_batch_size", self.dp * self.micro_batch_size)
        elif isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
            raise ValueError(f"train.global_batch_size={gbs!r} must be an integer >= 1")
        elif gbs % (self.dp * self.micro_batch_size):
            raise ValueError(
                f"train.global_batch_size={gbs} is not divisible by parallel.dp * train.micro_batch_size "
                f"= {self.dp} * {self.micro_batch_size}"
            )
        if self.schedule == "interleaved_1f1b" and self.num_microbatches % self.pp:
            raise ValueError(
                f"parallel.schedule='interleaved_1f1b' needs the microbatch count {self.num_microbatches} "
                f"(train.global_batch_size / (dp * micro_batch_size)) to be a multiple of parallel.pp={self.pp}"
            )

    @property
    def topology(self) -> Topology:
        return Topology(tp=self.tp, pp=self.pp, dp=self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        """Microbatches per pipeline per step."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def zero3_mode(self) -> str:
        """When stage 3 frees gathered parameters: ``microbatch`` or ``step`` (``auto``: step if pp > 1)."""
        if self.zero3_reshard != "auto":
            return self.zero3_reshard
        return "step" if self.pp > 1 else "microbatch"

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
        parts = [f"parallel.{k}={text(getattr(self, k))}" for k in keys]
        parts += [f"train.{k}={text(getattr(self, k))}" for k in TRAIN_KEYS]
        return " ".join(parts)

    def short(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        sp = " sp" if self.sequence_parallel else ""
        off = f" offload={self.offload}" if self.offload != "none" else ""
        return (
            f"tp={self.tp} pp={self.pp} dp={self.dp}{v} mbs={self.micro_batch_size} "
            f"zero={self.zero_stage}{off} rc={self.recompute}{sp}"
        )


PARALLEL_KEYS: tuple[str, ...] = ("tp", "pp", "dp", "zero_stage", "sequence_parallel", "schedule", "virtual_stages",
                                  "grad_reduce_dtype", "offload", "zero3_prefetch", "zero3_reshard")
OPTIONAL_PARALLEL_KEYS: tuple[str, ...] = ("offload", "zero3_prefetch", "zero3_reshard")  # printed when they matter
TRAIN_KEYS: tuple[str, ...] = ("micro_batch_size", "seq_len", "global_batch_size", "recompute", "precision")


def _qualified(key: str) -> str:
    return f"parallel.{key}" if key in PARALLEL_KEYS else f"train.{key}"


def layout_keys() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Layout))


def check_fits_model(config: ModelConfig, layout: Layout) -> None:
    """Raise ``LayoutError`` if ``config`` cannot be split by ``layout`` (heads, layers, sequence)."""
    layout.topology.check_model(
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.kv_heads,
        hidden_size=config.hidden_size,
        virtual_stages=layout.virtual_stages,
    )
    if layout.sequence_parallel and layout.seq_len % layout.tp:
        raise LayoutError(
            f"train.seq_len={layout.seq_len} is not divisible by parallel.tp={layout.tp} "
            f"(sequence parallel splits the sequence over the tensor-parallel group)"
        )
    if layout.seq_len > config.max_seq_len:
        raise LayoutError(f"train.seq_len={layout.seq_len} exceeds model.max_seq_len={config.max_seq_len}")
