"""``TrainOptions``: the run itself (``train.*`` except checkpointing and stopping: those are
``checkpoint_io.options.CheckpointOptions`` and ``preemption.StopOptions``).

Invariant: a constructed ``TrainOptions`` holds valid values; ``grad_accum`` and
``check_sequence`` add the batch arithmetic and the model/tensor-parallel limits on the
sequence. Errors are ``ConfigError`` naming ``train.<key>``. Which device ``auto`` means
is the environment's answer (``parallel3d.preflight``).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.transformer import RECOMPUTE_MODES
from parallel3d.option_checks import ConfigError, check_bool, check_choice, check_int, check_path, check_range
from parallel3d.zero.options import PRECISIONS

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
# What a non-finite gradient norm does (``parallel3d.divergence``): end the job, or skip the step and go on.
NONFINITE_POLICIES: tuple[str, ...] = ("stop", "skip")


@dataclass(frozen=True)
class TrainOptions:
    steps: int = 200
    global_batch_size: int = 8  # = micro_batch_size * grad_accum * dp
    micro_batch_size: int = 4
    seq_len: int = 128
    seed: int = 1234
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 uses dynamic loss scaling)
    recompute: str = "none"  # activation recompute: none | selective | full
    out_dir: str = "runs/default"  # run directory: metrics.jsonl, checkpoints/, .hydra/
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    timeout_s: float = 600.0  # collective timeout
    peak_tflops: float | None = None  # per-device peak for MFU; null = detect known GPUs
    stop_after: int | None = None  # stop (and checkpoint) after this step, as if killed; resumable
    # Validation (parallel3d/eval.py): eval_iters global batches of the validation set, forward
    # only, every eval_every steps (0 = only at the end); eval_iters=0 = no evaluation.
    eval_every: int = 0
    eval_iters: int = 0
    # Megatron's --skip-train (parallel3d/eval_only.py): evaluate the weights train.resume / train.init_from give
    # (or the seed's init) once, log it like a training run's evaluation, and stop; nothing trained or saved.
    eval_only: bool = False
    on_nonfinite: str = "stop"  # stop (exit 1, no checkpoint of the diverged run) | skip (skip the step, go on)

    def __post_init__(self) -> None:
        check_int("train.global_batch_size", self.global_batch_size, 1)
        check_int("train.micro_batch_size", self.micro_batch_size, 1)
        check_int("train.steps", self.steps, 1)
        check_int("train.seq_len", self.seq_len, 1)
        check_int("train.seed", self.seed, 0)
        check_choice("train.precision", self.precision, PRECISIONS)
        check_choice("train.recompute", self.recompute, RECOMPUTE_MODES)
        if self.stop_after is not None:
            check_int("train.stop_after", self.stop_after, 1)
        check_path("train.out_dir", self.out_dir)
        check_range("train.timeout_s", self.timeout_s, 0.0, lo_open=True)
        if self.peak_tflops is not None:
            check_range("train.peak_tflops", self.peak_tflops, 0.0, lo_open=True)
        check_choice("train.device", self.device, DEVICES)
        check_int("train.eval_every", self.eval_every, 0)
        check_int("train.eval_iters", self.eval_iters, 0)
        check_bool("train.eval_only", self.eval_only)
        if self.eval_only and not self.eval_iters:
            raise ConfigError("train.eval_only=true: needs train.eval_iters > 0, the validation batches to evaluate")
        check_choice("train.on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)

    def last_step(self) -> int:
        """The step this run trains to: ``steps``, or ``stop_after`` when it comes first."""
        return self.steps if self.stop_after is None else min(self.steps, self.stop_after)

    def grad_accum(self, dp: int) -> int:
        """Micro-batches per step per data-parallel rank: global = micro * grad_accum * dp."""
        gbs, mbs = self.global_batch_size, self.micro_batch_size
        if gbs % (mbs * dp):
            raise ConfigError(
                f"train.global_batch_size={gbs} is not divisible by train.micro_batch_size*dp = {mbs}*{dp} = "
                f"{mbs * dp}; global_batch = micro_batch * grad_accum * dp needs an integer grad_accum"
            )
        return gbs // (mbs * dp)

    def check_sequence(self, max_seq_len: int, tp: int, sequence_parallel: bool) -> None:
        """The model takes ``seq_len`` tokens, and sequence parallelism can split them over tp."""
        if self.seq_len > max_seq_len:
            raise ConfigError(f"train.seq_len={self.seq_len}: must be <= model.max_seq_len={max_seq_len}")
        if sequence_parallel and self.seq_len % tp:
            raise ConfigError(f"train.seq_len={self.seq_len}: sequence parallel needs it divisible by "
                              f"parallel.tp={tp}")

    def check_eval(self, has_valid_set: bool) -> None:
        """Evaluation needs a validation set."""
        if self.eval_iters and not has_valid_set:
            raise ConfigError(f"train.eval_iters={self.eval_iters}: needs a validation set: data.valid_fraction > 0 "
                              f"(held out of the training data) or data.valid_paths (or train.eval_iters=0)")
