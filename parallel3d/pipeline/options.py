"""``PipelineOptions``: which schedule runs the pipeline and how the layers are split into chunks.

``SCHEDULES`` is the one list of schedule names: the config (``parallel.schedule``),
``build_schedule`` and the planner's ``Layout`` all read it. Invariant: a constructed
``PipelineOptions`` holds valid values on its own; ``check_layout`` / ``check_microbatches``
add what needs the pipeline depth, the model or the batch. Errors are ``ConfigError``
naming ``parallel.<key>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.option_checks import ConfigError, as_tuples, check_choice, check_int

# zb_h1: zero bubble (Qi et al. 2023), backwards split into input and weight gradients;
# zbv: ZB-V, two chunks per stage placed in a V, split backwards.
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zbv")
INTERLEAVED = "interleaved_1f1b"  # any number (>= 2) of model chunks per stage
ZBV = "zbv"  # exactly two chunks per stage (its V)
MULTI_CHUNK = (INTERLEAVED, ZBV)  # the schedules that run more than one model chunk per stage
SPLIT_DRAIN_SCHEDULES = ("1f1b", INTERLEAVED)  # the schedules ``parallel.split_drain`` applies to (schedules.build_schedule)
AUTO = "auto"  # parallel.split_drain's default: split wherever ``drain_is_split`` allows it


def drain_is_split(schedule: str, split_drain: bool | str, recompute: str = "none") -> bool:
    """Whether ``schedule`` runs with its drain backwards split (``parallel.split_drain``): the one rule.

    ``auto`` (the default): split where it applies (``SPLIT_DRAIN_SCHEDULES`` without
    ``train.recompute=full``), plain elsewhere, so the default never refuses a config that is
    otherwise valid. ``true``: split, and a ``ConfigError`` where it does not apply. ``false``: plain.
    It does not apply to other schedules (zb_h1 and zbv split every backward already; gpipe is not built
    with it), nor to ``train.recompute=full``, where a split ``B``
    would keep what its weight-gradient GEMMs read (every linear's input and output gradient,
    ``deferred_grads``) until its ``W``, far more than the chunk input a fully recomputed microbatch keeps.

    On by default since the planner prices what a split ``B`` holds until its ``W`` (the last stage's
    logits gradient: +3.3% on llama_tiny's last stage, tp 2, bf16; ``planning.split_memory``). The one
    place that resolves the option: the engine, the dry run and the planner's ``Layout`` all build their
    schedule with this answer."""
    if split_drain != AUTO and not isinstance(split_drain, bool):
        raise ConfigError(f"parallel.split_drain={split_drain!r}: must be true, false or {AUTO}")
    applies = schedule in SPLIT_DRAIN_SCHEDULES and recompute != "full"
    if split_drain is True and not applies:
        raise ConfigError(f"parallel.split_drain=true: only parallel.schedule in {list(SPLIT_DRAIN_SCHEDULES)} "
                          f"without train.recompute=full splits its drain backwards (schedule is {schedule!r}, "
                          f"recompute {recompute!r}; {AUTO}, the default, splits only where it applies)")
    return applies and split_drain is not False


@dataclass(frozen=True)
class PipelineOptions:
    schedule: str = "1f1b"  # 1f1b | gpipe | interleaved_1f1b | zb_h1 | zbv (zero bubble, split backward)
    virtual_stages: int = 1  # model chunks per stage (interleaved_1f1b: >= 2; zbv: 2, its V)
    pp_layers: tuple[int, ...] | None = None  # layers per pipeline chunk; null = balanced split
    # 1f1b, interleaved_1f1b: split the backwards each stage runs after its last forward (not the model's
    # first chunk's), sending the input gradient before the weight-gradient GEMMs (docs/benchmarks.md);
    # auto | true | false (drain_is_split).
    split_drain: bool | str = AUTO

    def __post_init__(self) -> None:
        as_tuples(self)
        check_choice("parallel.schedule", self.schedule, SCHEDULES)
        drain_is_split(self.schedule, self.split_drain)
        v = check_int("parallel.virtual_stages", self.virtual_stages, 1)
        if v > 1 and self.schedule not in MULTI_CHUNK:
            raise ConfigError(
                f"parallel.virtual_stages={v}: only parallel.schedule={INTERLEAVED} or {ZBV} uses more than one "
                f"chunk per stage (schedule is {self.schedule!r})"
            )
        if self.schedule == ZBV and v != 2:
            raise ConfigError(f"parallel.schedule={ZBV} runs two chunks per stage: set parallel.virtual_stages=2 "
                              f"(got {v})")

    def splits_drain(self, recompute: str) -> bool:
        """``parallel.split_drain`` resolved for this schedule and ``train.recompute`` (``drain_is_split``)."""
        return drain_is_split(self.schedule, self.split_drain, recompute)

    def num_chunks(self, pp: int) -> int:
        """Model chunks in the whole pipeline."""
        return pp * self.virtual_stages

    def check_layout(self, pp: int, num_layers: int | None = None) -> None:
        """The schedule fits ``pp`` stages; ``pp_layers`` lists one count per chunk summing to ``num_layers``."""
        v = self.virtual_stages
        if self.schedule == INTERLEAVED and (v < 2 or pp < 2):
            raise ConfigError(
                f"parallel.schedule={INTERLEAVED} needs parallel.pp >= 2 and parallel.virtual_stages >= 2 "
                f"(got pp={pp}, virtual_stages={v})"
            )
        if self.pp_layers is None:
            return
        layers = list(self.pp_layers)
        # The first chunk may hold the embedding alone and the last the final norm and head alone
        # (pipeline.partition); a middle chunk without a layer would only pass its input on.
        if len(layers) != self.num_chunks(pp) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                                                     for n in layers) or any(n < 1 for n in layers[1:-1]):
            raise ConfigError(
                f"parallel.pp_layers={layers}: must list {self.num_chunks(pp)} positive layer counts "
                f"(one per pipeline chunk = pp*virtual_stages = {pp}*{v}; the first and the last may be 0), or be null"
            )
        if num_layers is not None and sum(layers) != num_layers:
            raise ConfigError(f"parallel.pp_layers={layers}: sums to {sum(layers)} but model.num_layers={num_layers}")

    def check_microbatches(self, pp: int, microbatches: int) -> None:
        """Interleaved 1F1B advances microbatches in groups of ``pp``."""
        if self.schedule == INTERLEAVED and microbatches % pp:
            raise ConfigError(
                f"parallel.schedule={INTERLEAVED}: grad_accum={microbatches} micro-batches must be a multiple of "
                f"parallel.pp={pp} (grad_accum = global_batch_size / (micro_batch_size*dp))"
            )
