"""``ZeroOptimizer``: AdamW over flat buffers sharded over each parameter's replicas (ZeRO 0-3, offload).

Which ranks are replicas: every ``BufferLayout`` names its group kind (``reduce_kind``);
dense parameters are replicated over ``dp_cp`` (``DENSE_REDUCE_KIND``: data and
context parallel ranks hold the same weights), so ZeRO never assumes ``dp``. Routed experts
(``EXPERT_REDUCE_KIND``, ``edp``) use ``expert_zero_stage`` (None: ``zero_stage``); each stage in use
gets its own params / grad-sync strategy over its layouts (``mixed``), the states, norm and
checkpoint views are per layout, so the table below holds per kind with its own N.

Who holds what, per rank, at the peak of a step (Ψ = this model-parallel rank's
parameter count, N = the replica group's size (dp * cp), g = bytes per gradient element: 4 for fp32 main grads,
the default, or 2 with ``grad_reduce_dtype`` equal to bf16/fp16):

| stage | model weights                          | gradients (g bytes each)          | fp32 master + Adam moments |
|-------|----------------------------------------|-----------------------------------|----------------------------|
| 0     | Ψ (all)                                | Ψ (flat buffer)                   | Ψ (replicated)             |
| 1     | Ψ (all)                                | Ψ (flat buffer)                   | Ψ/N (own shard)            |
| 2     | Ψ (all)                                | Ψ/N (own shard), every microbatch | Ψ/N (own shard)            |
| 3     | Ψ/N (own shard) + the gathered units   | Ψ/N (own shard), every microbatch | Ψ/N (own shard)            |

In bytes with mixed precision and stage 3: 2Ψ/N + gΨ/N + 12Ψ/N (16Ψ/N with
bf16 gradients), plus the gather window (``params_sharded``: the chunk's root
unit and 1 + ``zero3_prefetch`` units whole at a time, or the whole stage during
a step with ``zero3_reshard=step``), the ``buckets`` (stages 2-3: a few pooled
buffers of one bucket in the gradient dtype; reduce-scatters land in place or in
the shard, never in a temporary) and the one ``.grad`` a hook is consuming. With ``offload`` the 12 bytes
(master + moments) move to host memory (``cpu``) or disk (``disk``;
``states``/``offload``). With ``precision=fp32`` and no offload the parameters
are their own master weights. ``memory_bytes`` reports what is held now,
``memory_peak_bytes`` the high-water mark since ``reset_memory_peak`` (running
counts updated at every allocation, gather and release, and inside the gradient
hooks, ``memory``).

The pieces, one per concept (``assembly`` picks them per stage, ``update`` does a step's
arithmetic, this class is the facade): ``params`` (``ReplicatedParams`` for stages 0-2,
``ShardedParams`` for stage 3) holds the parameters; ``grad_sync``
(``ReplicatedGradSync`` for stages 0/1, ``ShardedGradSync`` for 2/3) reduces the
gradients and owns their finalisation (``GradSync.finalize``, once per step);
``states`` (``DeviceStates``, ``HostStates``, ``DiskStates``) holds masters and
moments and streams the update. All share one ``buffers.BufferLayout`` per dtype,
so every rank's optimizer state is the same "owned pieces" in shard coordinates
whatever the stage and offload (``read_state_piece`` / ``write_state_piece``).

A step: finalize the gradients -> scale by ``1/loss_scale`` -> global norm
(every rank, ``clip``) -> skip on every rank if it is not finite (fp16 overflow)
-> clip -> AdamW where the state lives (on the device: one vectorised update of
every piece, ``adamw_multi``; offloaded: chunk by chunk) -> the updated pieces go
into the parameters; stages 1-2 all-gather them, stage 3 gathers at next use.

``overlap_param_gather`` (stages 1-2): ``step`` only launches the all-gathers and
each bucket is waited for just before its first layer's forward (``param_gather``).
Every other reader of the parameters must call ``finish_param_sync`` first; this
class does so itself in ``step``, ``gather_params``, ``gathered_params``, the
state-piece accessors (checkpoints, HF import/export) and ``params_from_master``,
and a model ``state_dict()`` waits too. On by default (``ZeroOptions``, the same default as
``parallel.overlap_param_gather``): a caller reading ``p.data`` right after ``step``
without a forward in between calls ``finish_param_sync`` first, or passes
``overlap_param_gather=False``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch

from parallel3d import comm
from parallel3d.parallel_state import ParallelState
from parallel3d.zero import clip
from parallel3d.zero.adamw import resolve_backend
from parallel3d.zero.assembly import DENSE_REDUCE_KIND, EXPERT_REDUCE_KIND, build_layouts, build_strategies, named_params
from parallel3d.zero.buffers import Bucket, BufferLayout
from parallel3d.zero.memory import MEMORY_CATEGORIES, MemoryTracker, held_bytes
from parallel3d.zero.offload import make_states
from parallel3d.zero.options import OptimizerOptions, ZeroOptions
from parallel3d.zero.owned import OwnedSegment, owned_segments
from parallel3d.zero.precision import LossScaler, precision_dtype
from parallel3d.zero.states import OptimizerStates
from parallel3d.zero.units import find_units
from parallel3d.zero.update import AdamWUpdate, global_grad_norm

log = logging.getLogger(__name__)
__all__ = ["StepInfo", "ZeroOptimizer"]


@dataclass(frozen=True)
class StepInfo:
    grad_norm: float  # global norm before clipping (of the unscaled, DP-averaged gradient)
    skipped: bool  # non-finite gradient somewhere in the job: nobody stepped
    loss_scale: float  # the scale used for this step's gradients
    lr: float


class ZeroOptimizer:
    """Sharded mixed-precision AdamW for ``modules`` (this rank's model chunks).

    Invariants: every trainable parameter is a view into ``self.params``' storage;
    after ``step`` all DP ranks hold identical parameters (stage 3: identical shards of
    them); master weights and moments cover exactly this rank's shard
    (``layout.shard_numel`` elements), wherever ``offload`` keeps them.
    ``reduce_scatter``: how stages 1-3 reduce a bucket: "reduce_scatter" (default; ZeRO's
    volume, equal to DDP's; on gloo an all-to-all exchange, ``reduction``), or "auto" (opt-in: an
    all-reduce on gloo, twice the bytes, else a reduce-scatter; see ``grad_sync``).
    ``grad_reduce_dtype``: "fp32" (default: fp32 main grads, accumulated and reduced in fp32)
    or the training precision ("bf16"/"fp16": half the gradient bytes and bandwidth).
    ``bucket_size_mb`` sizes buckets in parameter-dtype bytes (fp32 staging buffers of a
    bf16 model are twice that). ``offload``: "none", "cpu" or "disk" (stages 1-3; with
    ``offload_dir`` and ``offload_buffer_mb`` of host staging for "disk"). ``zero3_prefetch``
    and ``zero3_reshard``: stage 3's prefetch depth (units) and when it frees gathered
    parameters ("auto", "microbatch", "step"; see ``params_sharded``).
    ``overlap_param_gather``: stages 1-2 overlap the post-step all-gather with the next
    forward (module doc; ignored by stages 0 and 3, which have none after the step).
    The AdamW defaults (betas, eps, weight_decay, clip_grad) are ``OptimizerOptions``' and the
    sharding defaults ``ZeroOptions``': no default is stated here.
    """

    def __init__(
        self,
        modules: list[torch.nn.Module] | torch.nn.Module,
        pstate: ParallelState,
        *,
        zero_stage: int,
        lr: float,
        expert_zero_stage: int | None = None,
        betas: tuple[float, float] = (OptimizerOptions.beta1, OptimizerOptions.beta2),
        eps: float = OptimizerOptions.eps,
        weight_decay: float = OptimizerOptions.weight_decay,
        clip_grad: float | None = OptimizerOptions.clip_grad,
        bucket_size_mb: float = ZeroOptions.bucket_size_mb,
        precision: str = "fp32",
        lr_schedule: Callable[[int], float] | None = None,
        loss_scale_init: float = 2.0**16,
        loss_scale_growth_interval: int = 1000,
        loss_scale_growth_factor: float = 2.0,
        loss_scale_backoff_factor: float = 0.5,
        loss_scale_min: float = 1.0,
        fused_adamw_backend: str = "auto",
        reduce_scatter: str = "reduce_scatter",
        grad_reduce_dtype: str = ZeroOptions.grad_reduce_dtype,
        offload: str = ZeroOptions.offload,
        offload_dir: str | None = ZeroOptions.offload_dir,
        offload_buffer_mb: float = ZeroOptions.offload_buffer_mb,
        zero3_prefetch: int = ZeroOptions.zero3_prefetch,
        zero3_reshard: str = ZeroOptions.zero3_reshard,
        overlap_param_gather: bool = ZeroOptions.overlap_param_gather,
    ) -> None:
        if isinstance(modules, torch.nn.Module):
            modules = [modules]
        self.options = ZeroOptions(
            zero_stage=zero_stage, expert_zero_stage=expert_zero_stage, bucket_size_mb=bucket_size_mb, grad_reduce_dtype=grad_reduce_dtype,
            offload=offload, offload_dir=offload_dir, offload_buffer_mb=offload_buffer_mb,
            zero3_prefetch=zero3_prefetch, zero3_reshard=zero3_reshard, overlap_param_gather=overlap_param_gather)
        if clip_grad is not None and not clip_grad > 0:
            raise ValueError(f"optim.clip_grad={clip_grad!r} must be > 0 or None (no clipping)")
        if not lr >= 0 or not eps > 0 or not weight_decay >= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW hyper-parameters out of range: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        dtype = precision_dtype(precision)
        self.options.check_precision(precision)
        named = named_params(modules)
        if not named:
            raise ValueError("ZeroOptimizer: the modules have no trainable parameters")
        for name, p in named:
            if p.dtype != dtype:
                raise ValueError(f"train.precision={precision!r} needs {dtype} parameters, but {name} is {p.dtype}")
        self.modules = modules
        self.named_params = named  # registration order (checkpoints report mismatches in this order)
        self.pstate = pstate
        self.zero_stage = zero_stage
        self.precision = precision
        self.grad_reduce_dtype = grad_reduce_dtype
        self.offload = offload
        self.lr = lr
        self.clip_grad = clip_grad
        self.lr_schedule = lr_schedule
        self.scaler = LossScaler(
            enabled=precision == "fp16", scale=float(loss_scale_init), growth_factor=loss_scale_growth_factor,
            backoff_factor=loss_scale_backoff_factor, growth_interval=loss_scale_growth_interval,
            min_scale=loss_scale_min,
        )
        resolve_backend(fused_adamw_backend)  # validates the name before any buffer is built
        # Dense parameters are replicated over dp and cp: their gradients reduce over dp_cp.
        self.replicas = comm.group_size(pstate, DENSE_REDUCE_KIND)
        self.iteration = 0  # step() calls, skipped or not (drives the LR schedule)
        self.adam_step = 0  # applied updates (drives bias correction)

        # Each kind's stage: dense parameters at zero_stage, routed experts at expert_zero_stage.
        self.stage_of_kind = {DENSE_REDUCE_KIND: zero_stage, EXPERT_REDUCE_KIND: self.options.expert_stage}
        units = find_units(modules) if 3 in self.stage_of_kind.values() else None
        # Routed experts (parallel3d.moe) are replicated over the expert data-parallel group: a layout of their own.
        self._all_layouts = build_layouts(named, pstate, self.stage_of_kind, units, dtype=dtype,
                                          bucket_size_mb=bucket_size_mb)
        self.device = named[0][1].device
        self._update = AdamWUpdate(betas=betas, eps=eps, weight_decay=weight_decay,
                                   fused_adamw_backend=fused_adamw_backend, device=self.device)
        self.memory = MemoryTracker(MEMORY_CATEGORIES)
        grad_dtype = precision_dtype(grad_reduce_dtype)
        parts = build_strategies(modules, self._all_layouts, pstate, self.stage_of_kind, units, device=self.device,
                                 grad_dtype=grad_dtype, reduce_scatter=reduce_scatter, memory=self.memory,
                                 zero3_prefetch=zero3_prefetch, zero3_reshard=zero3_reshard,
                                 overlap_param_gather=overlap_param_gather)
        self.params = parts.params
        self.grad_sync = parts.grad_sync
        self.states: OptimizerStates = make_states(
            offload, self._all_layouts, self.params.piece, device=self.device, grad_dtype=grad_dtype, memory=self.memory,
            offload_dir=offload_dir, buffer_bytes=int(offload_buffer_mb * 2**20),
            tag="_".join(f"{dim}{index}" for dim, index in dataclasses.asdict(pstate.coords).items()),
        )

    # ---- public API ----------------------------------------------------------------
    @property
    def betas(self) -> tuple[float, float]:
        return self._update.betas

    @property
    def eps(self) -> float:
        return self._update.eps

    @property
    def weight_decay(self) -> float:
        return self._update.weight_decay

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 unless fp16)."""
        return self.scaler.scale

    @property
    def layouts(self) -> list[BufferLayout]:
        return self._all_layouts

    def layout_stage(self, group: int) -> int:
        """The ZeRO stage of layout ``group`` (dense: ``zero_stage``, experts: ``expert_zero_stage``)."""
        return self.stage_of_kind[self.layouts[group].reduce_kind]

    @property
    def masters(self) -> list[torch.Tensor | None]:
        """Flat fp32 master shards (None: fp32 parameters are their own master); absent with disk offload."""
        return getattr(self.states, "masters", [])

    @property
    def exp_avgs(self) -> list[torch.Tensor]:
        return getattr(self.states, "exp_avgs", [])

    @property
    def exp_avg_sqs(self) -> list[torch.Tensor]:
        return getattr(self.states, "exp_avg_sqs", [])

    def current_lr(self) -> float:
        return self.lr_schedule(self.iteration) if self.lr_schedule is not None else self.lr

    def zero_grad(self) -> None:
        self.grad_sync.zero_grad()

    def finish_param_sync(self) -> None:
        """Wait for the post-step parameter all-gathers still in flight (``overlap_param_gather``):
        call before reading parameters outside a module forward. Cheap when nothing is pending."""
        self.params.finish()

    @property
    def param_gathers_in_flight(self) -> int:
        """Buckets whose post-step all-gather has not been waited for yet."""
        return self.params.gathers_in_flight

    def gathered_params(self) -> AbstractContextManager:
        """Inside the block every parameter is whole (stage 3 gathers them; read-only), e.g. to export weights."""
        return self.params.gathered()

    # ---- the owned pieces (checkpoints) -------------------------------------------------
    def read_state_piece(self, group: int, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 (master, exp_avg, exp_avg_sq) of this rank's piece of ``bucket`` in shard coordinates, in every
        stage and offload mode, as in-place views (disk: of the memory-mapped state files)."""
        self.finish_param_sync()
        return self.states.read_piece(group, bucket)

    @torch.no_grad()
    def write_state_piece(self, group: int, bucket: Bucket, master: torch.Tensor, exp_avg: torch.Tensor,
                          exp_avg_sq: torch.Tensor) -> None:
        """Store a piece's state and refresh this rank's parameter piece from the master (call
        ``gather_params`` after the last piece)."""
        self.finish_param_sync()
        self.states.write_piece(group, bucket, master, exp_avg, exp_avg_sq)
        piece = self.params.piece(group, bucket)
        if piece.data_ptr() != master.data_ptr():
            piece.copy_(master)

    def master_piece(self, group: int, bucket: Bucket) -> torch.Tensor:
        """fp32 master weights of this rank's piece of ``bucket`` (a copy with disk offload)."""
        return self.read_state_piece(group, bucket)[0]

    @torch.no_grad()
    def step(self) -> StepInfo:
        self.finish_param_sync()  # a step without a forward since the last one: the update reads the pieces
        self.grad_sync.finalize()
        lr = self.current_lr()
        used_scale = self.scaler.scale
        inv = 1.0 / used_scale  # the pieces are DP means already (the reduction divided by dp)
        norm = global_grad_norm(self.layouts, self.grad_sync.grad_piece, self.pstate,
                                kinds=(DENSE_REDUCE_KIND, EXPERT_REDUCE_KIND), stage_of_kind=self.stage_of_kind,
                                inv_scale=inv, device=self.device)
        self.iteration += 1
        if not math.isfinite(norm):
            self.scaler.update(overflow=True)
            self.grad_sync.reset()
            # Debug only: the trainer's DivergenceGuard tells the user, once from the logging rank,
            # whether the run skips this step or stops on it (parallel3d/divergence.py).
            log.debug("non-finite gradient norm %s: step skipped on all ranks (loss scale -> %s)",
                      norm, self.scaler.scale)
            return StepInfo(grad_norm=norm, skipped=True, loss_scale=used_scale, lr=lr)
        coef = inv * clip.clip_coefficient(norm, self.clip_grad)
        self.adam_step += 1
        self._update.apply(self.layouts, self.states, self.grad_sync.grad_piece, self.params.piece, coef=coef,
                           lr=lr, step=self.adam_step)
        self.params.publish(asynchronous=True)
        self.scaler.update(overflow=False)
        self.grad_sync.reset()
        return StepInfo(grad_norm=norm, skipped=False, loss_scale=used_scale, lr=lr)

    @torch.no_grad()
    def gather_params(self) -> None:
        """Make the parameters whole after their pieces changed: all-gather (stages 1-2; waited for
        here); stage 3 gathers at use."""
        self.finish_param_sync()
        self.params.publish()

    def memory_peak_bytes(self) -> dict[str, int]:
        """The most bytes held per category since construction or ``reset_memory_peak``.

        Includes what ``memory_bytes`` cannot see after the fact: the ``.grad`` a gradient hook
        is consuming, reduce-scatter outputs in flight (``buckets``) and stage 3's gathered
        units. Each category has its own high-water mark (their sum can exceed the peak of the
        total). ``offload_host`` / ``offload_disk`` are offloaded state (host memory / files)."""
        return dict(self.memory.peak)

    def reset_memory_peak(self) -> None:
        """Restart the high-water marks from what is held now."""
        self.memory.reset_peak()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now per category, summed over distinct tensor storages."""
        params = [s.param for layout in self.layouts for s in layout.slots]
        masters, moments = self.states.device_tensors()
        return held_bytes(weights=self.params.storage_tensors() + params,
                          gradients=self.grad_sync.gradient_tensors() + [p.grad for p in params],
                          masters=masters, moments=moments, buckets=self.grad_sync.staging_buffers(),
                          offload_host=self.states.host_bytes(), offload_disk=self.states.disk_bytes())

    # ---- checkpoints -------------------------------------------------------------------
    def owned_segments(self) -> list[OwnedSegment]:
        """This rank's master weights and moments per parameter range, as in-place views (``owned``),
        in every stage and offload mode (disk: views of the memory-mapped state files)."""
        return owned_segments(self)

    def layout_replicated(self, group: int) -> bool:
        """Whether every rank of layout ``group``'s replica group holds its whole optimizer state
        (stage 0) rather than a shard."""
        return self.layout_stage(group) == 0

    @torch.no_grad()
    def params_from_master(self) -> None:
        """Make the parameters (stage 3: this rank's parameter shard) equal their (rounded) master
        weights after the masters were overwritten in place (checkpoint load, HF import); all ranks
        of each layout's replica group call it."""
        for g, layout in enumerate(self.layouts):
            for b in layout.buckets:
                master = self.read_state_piece(g, b)[0]
                piece = self.params.piece(g, b)
                if piece.data_ptr() != master.data_ptr():
                    piece.copy_(master)
        self.gather_params()

    def close(self) -> None:
        """Release offload files and threads (also done when the optimizer is garbage-collected)."""
        self.states.close()
