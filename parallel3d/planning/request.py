"""What a planner search is asked for (``PlanRequest``): batch, sequence, precision and the options searched.

Invariant: a ``PlanRequest`` that exists is valid; every field is checked on construction against the
runtime's own allowed values (``ZERO_STAGES``, ``SCHEDULES``, ``RECOMPUTE_MODES``, ``OFFLOAD_MODES``), so the
search never meets a value the runtime would refuse, and a value the runtime adds is searchable unless it is
named here as not searched (``UNSEARCHED_SCHEDULES``, ``UNSEARCHED_OFFLOAD``). Errors name the ``plan.*`` key.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.transformer import RECOMPUTE_MODES
from parallel3d.pipeline.options import SCHEDULES
from parallel3d.zero.options import OFFLOAD_MODES, ZERO_STAGES

RECOMPUTE_ORDER: tuple[str, ...] = RECOMPUTE_MODES  # cheapest first
FIXABLE_DEGREES: tuple[str, ...] = ("tp", "cp", "pp", "dp", "ep")
# Runtime values the search never tries, and why: GPipe is 1F1B's time with more memory; disk offload needs a
# directory, and the planner does not model host or disk capacity (it is estimated, not searched).
UNSEARCHED_SCHEDULES: tuple[str, ...] = ("gpipe",)
UNSEARCHED_OFFLOAD: tuple[str, ...] = ("disk",)
SEARCHED_SCHEDULES: tuple[str, ...] = tuple(s for s in SCHEDULES if s not in UNSEARCHED_SCHEDULES)
SEARCHED_OFFLOAD: tuple[str, ...] = tuple(o for o in OFFLOAD_MODES if o not in UNSEARCHED_OFFLOAD)


@dataclass(frozen=True)
class PlanRequest:
    global_batch_size: int
    seq_len: int
    precision: str = "bf16"
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_virtual_stages: int = 4  # 1 = no interleaving; above 1 one layer per chunk is also tried
    zero_stages: tuple[int, ...] = (1, 2, 3)
    offload_modes: tuple[str, ...] = ("none",)
    recompute_modes: tuple[str, ...] = RECOMPUTE_ORDER
    # Share of device memory the estimate may use; the rest is CUDA context, NCCL
    # buffers, allocator fragmentation and temporaries the estimator does not model.
    memory_fraction: float = 0.9
    top_k: int = 10
    simulate_top: int = 24  # layouts ranked: exactly the fastest by the full price (``plan``)
    # Also try pipeline depths that do not divide num_layers (the engine's balanced split,
    # stages at most ~10% apart), e.g. pp=16 for Llama 3.1 405B's 126 layers.
    uneven_stages: bool = True
    # Schedules searched (any of the runtime's ``SCHEDULES`` but gpipe). zbv is priced by the same
    # simulator but off by default: the memory estimator builds its action list per stage, ~1 s a
    # layout, too slow for a default search (plan.schedules=[1f1b,interleaved_1f1b,zb_h1,zbv]).
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b", "zb_h1")
    # Largest context-parallel degree searched (powers of two); 1 turns CP off.
    max_cp: int = 1
    # MoE models: also try experts unsplit (etp = 1) when tp > 1, and each expert ZeRO stage of
    # ``zero_stages`` beside the dense one (memory only: the experts' own shard stage).
    search_expert_options: bool = True
    # Sequence parallelism on every tp > 1 layout (the runtime's recommended setting); False prices
    # frameworks without it (Megatron-LM before Korthikanti et al. 2022).
    sequence_parallel: bool = True
    # Parallel degrees held at given values, e.g. (("dp", 4),): the rank check holds what a published
    # experiment held fixed (``validation.rank_run``); empty for a user's search.
    fixed_degrees: tuple[tuple[str, int], ...] = ()
    # Fewest stages interleaved 1F1B is searched at: 2 for parallel3d; 3 prices Megatron-LM without P2P
    # overlap, whose arguments.py asserts pp > 2 with interleaving (the published-run rank check).
    min_interleaved_pp: int = 2
    # The job's ``data.document_mask``: every microbatch carries document ids and per-sequence positions and rotary
    # tables (memory only: ``ActivationAssumptions.document_ids``).
    document_mask: bool = False

    def __post_init__(self) -> None:
        for key in ("global_batch_size", "seq_len", "max_virtual_stages", "top_k", "simulate_top", "max_cp",
                    "min_interleaved_pp"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"plan.{key}={value!r} must be an integer >= 1")
        if not self.micro_batch_sizes or any(
            isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.micro_batch_sizes
        ):
            raise ValueError(f"plan.micro_batch_sizes={list(self.micro_batch_sizes)!r} must be integers >= 1")
        if not isinstance(self.document_mask, bool):
            raise ValueError(f"data.document_mask={self.document_mask!r} must be true or false")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"plan.memory_fraction={self.memory_fraction!r} must be in (0, 1]")
        bad = [z for z in self.zero_stages if z not in ZERO_STAGES]
        if not self.zero_stages or bad:
            raise ValueError(f"plan.zero_stages={list(self.zero_stages)!r} must be a non-empty subset of "
                             f"{list(ZERO_STAGES)}")
        if not self.offload_modes or any(o not in SEARCHED_OFFLOAD for o in self.offload_modes):
            raise ValueError(f"plan.offload={list(self.offload_modes)!r} must be a non-empty subset of "
                             f"{list(SEARCHED_OFFLOAD)} ({', '.join(UNSEARCHED_OFFLOAD)} offload is estimated, not searched)")
        bad_s = [n for n in self.schedules if n not in SEARCHED_SCHEDULES]
        if not self.schedules or bad_s:
            raise ValueError(f"plan.schedules={list(self.schedules)!r} must be a non-empty subset of "
                             f"{list(SEARCHED_SCHEDULES)}")
        bad_fixed = [(k, v) for k, v in self.fixed_degrees if k not in FIXABLE_DEGREES
                     or isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad_fixed:
            raise ValueError(f"plan.fixed_degrees={list(self.fixed_degrees)!r}: names must be in "
                             f"{list(FIXABLE_DEGREES)}, values integers >= 1")
        bad_rc = [r for r in self.recompute_modes if r not in RECOMPUTE_ORDER]
        if not self.recompute_modes or bad_rc:
            raise ValueError(f"plan.recompute_modes={list(self.recompute_modes)!r} must be a subset of {list(RECOMPUTE_ORDER)}")
