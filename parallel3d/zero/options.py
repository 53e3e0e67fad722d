"""The ``zero`` package's options: how optimizer state is sharded and stored (``ZeroOptions``,
``parallel.*``) and the AdamW / learning-rate hyper-parameters (``OptimizerOptions``, ``optimizer.*``).

The allowed values (``ZERO_STAGES``, ``OFFLOAD_MODES``, ``ZERO3_RESHARD``, ``PRECISIONS``) and
the defaults are stated here only: the config schema, ``ZeroOptimizer`` and the planner's
``Layout`` read them. Invariant: a constructed options object holds valid values (what needs
another section, the training precision or step count, is ``check_precision`` /
``check_steps``); errors are ``ConfigError`` naming the config key. Whether ``offload_dir``
can be written is the environment's question (``parallel3d.preflight``), not a value's.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.option_checks import ConfigError, check_bool, check_choice, check_int, check_path, check_range

ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
OFFLOAD_MODES: tuple[str, ...] = ("none", "cpu", "disk")
ZERO3_RESHARD: tuple[str, ...] = ("auto", "microbatch", "step")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")  # train.precision, and the gradient dtypes


def resolve_reshard(mode: str, pp: int) -> str:
    """When stage 3 frees gathered parameters: ``auto`` -> ``step`` with pipeline parallelism
    (a stage's units are used again by every microbatch), else ``microbatch``."""
    check_choice("parallel.zero3_reshard", mode, ZERO3_RESHARD)
    if mode == "auto":
        return "step" if pp > 1 else "microbatch"
    return mode


@dataclass(frozen=True)
class ZeroOptions:
    # 0: plain DP all-reduce; 1: sharded optimizer state; 2: + sharded grads; 3: + sharded params
    zero_stage: int = 0
    # The routed experts' stage (their parameters, grads and optimizer state over edp); None: zero_stage.
    expert_zero_stage: int | None = None
    bucket_size_mb: float = 25.0  # gradient bucket size for DP/ZeRO reduction
    # dtype gradients are accumulated over microbatches and reduced over DP in: fp32 (main
    # grads, the default) or the model's own bf16/fp16 (half the reduction bytes).
    grad_reduce_dtype: str = "fp32"
    # Optimizer state (fp32 master weights + Adam moments) on the device (none), in host memory
    # with the update on the CPU (cpu), or in files under offload_dir (disk); zero_stage >= 1.
    offload: str = "none"
    offload_dir: str | None = None  # offload=disk: directory for the state files (fast local disk)
    offload_buffer_mb: float = 256.0  # offload=disk: host memory the state streams through
    zero3_prefetch: int = 1  # zero_stage=3: gather units issued ahead of the one computing
    zero3_reshard: str = "auto"  # zero_stage=3: free gathered params per microbatch | per step (auto: step if pp > 1)
    # zero_stage=1/2: the post-step parameter all-gather runs while the next forward computes
    # (each bucket waited for right before its first layer) instead of blocking in step().
    overlap_param_gather: bool = True

    def __post_init__(self) -> None:
        stage = check_choice("parallel.zero_stage", self.zero_stage, ZERO_STAGES)
        expert = stage if self.expert_zero_stage is None else \
            check_choice("parallel.expert_zero_stage", self.expert_zero_stage, ZERO_STAGES)
        check_range("parallel.bucket_size_mb", self.bucket_size_mb, 0.0, lo_open=True)
        check_choice("parallel.grad_reduce_dtype", self.grad_reduce_dtype, PRECISIONS)
        offload = check_choice("parallel.offload", self.offload, OFFLOAD_MODES)
        if offload != "none" and stage > 0 and expert == 0:
            raise ConfigError(f"parallel.expert_zero_stage=0: parallel.offload={offload} needs every stage >= 1 "
                              f"(offload covers the experts' optimizer state too)")
        if offload != "none" and stage == 0:
            raise ConfigError(
                f"parallel.offload={offload}: needs parallel.zero_stage >= 1 (with stage 0 every rank would keep and "
                f"update the whole optimizer state on its host; stage 1 shards it at the same communication volume)"
            )
        if offload == "disk" and self.offload_dir is not None:
            check_path("parallel.offload_dir", self.offload_dir)  # '' would write the state files here
        if offload == "disk" and not self.offload_dir:
            raise ConfigError("parallel.offload_dir=null: parallel.offload=disk needs a directory for the optimizer "
                              "state files (a fast local disk)")
        if offload != "disk" and self.offload_dir is not None:
            raise ConfigError(f"parallel.offload_dir={self.offload_dir!r}: only used with parallel.offload=disk "
                              f"(offload is {offload!r})")
        check_range("parallel.offload_buffer_mb", self.offload_buffer_mb, 0.0, lo_open=True)
        check_int("parallel.zero3_prefetch", self.zero3_prefetch, 0)
        check_choice("parallel.zero3_reshard", self.zero3_reshard, ZERO3_RESHARD)
        check_bool("parallel.overlap_param_gather", self.overlap_param_gather)
        if 3 not in (stage, expert) and self.zero3_reshard != "auto":
            raise ConfigError(f"parallel.zero3_reshard={self.zero3_reshard}: only used with parallel.zero_stage=3 "
                              f"(zero_stage is {stage})")

    @property
    def expert_stage(self) -> int:
        """The ZeRO stage of the routed experts (``expert_zero_stage``, or ``zero_stage`` when null)."""
        return self.zero_stage if self.expert_zero_stage is None else self.expert_zero_stage

    def check_precision(self, precision: str) -> None:
        """Gradients are reduced in fp32 or in the training precision itself."""
        if self.grad_reduce_dtype not in ("fp32", precision):
            raise ConfigError(
                f"parallel.grad_reduce_dtype={self.grad_reduce_dtype!r}: must be fp32 or the training precision "
                f"(train.precision={precision!r})"
            )

    def zero3_mode(self, pp: int) -> str:
        """``zero3_reshard`` with ``auto`` resolved for ``pp`` pipeline stages."""
        return resolve_reshard(self.zero3_reshard, pp)


@dataclass(frozen=True)
class OptimizerOptions:
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # cosine decay floor, reached at train.steps
    warmup_steps: int = 20  # linear warm-up from 0
    weight_decay: float = 0.1  # AdamW decoupled decay (not on norms/biases)
    clip_grad: float = 1.0  # max global grad norm; 0 = no clipping
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # train.precision=fp16: the dynamic loss scale's start (halved at each overflow, the step skipped).
    loss_scale_init: float = 2.0**16

    def __post_init__(self) -> None:
        lr = check_range("optimizer.lr", self.lr, 0.0, lo_open=True)
        check_range("optimizer.min_lr", self.min_lr, 0.0, lr)
        check_int("optimizer.warmup_steps", self.warmup_steps, 0)
        check_range("optimizer.weight_decay", self.weight_decay, 0.0)
        check_range("optimizer.clip_grad", self.clip_grad, 0.0)
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ConfigError(f"optimizer.{key}={value!r}: must be in [0, 1)")
        check_range("optimizer.eps", self.eps, 0.0, lo_open=True)
        check_range("optimizer.loss_scale_init", self.loss_scale_init, 0.0, lo_open=True)

    def check_steps(self, steps: int) -> None:
        """The warm-up fits in the run."""
        if self.warmup_steps > steps:
            raise ConfigError(f"optimizer.warmup_steps={self.warmup_steps}: must be <= train.steps={steps}")

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)
