"""``ZeroOptimizer``: AdamW over DP-sharded flat buffers (ZeRO stages 0, 1 and 2).

Who holds what, per rank, at the peak of a step (Ψ = this model-parallel rank's
parameter count, N = dp, g = bytes per gradient element: 4 for fp32 main grads,
the default, or 2 with ``grad_reduce_dtype`` equal to bf16/fp16):

| stage | model weights | gradients (g bytes each)         | fp32 master + Adam moments |
|-------|---------------|----------------------------------|----------------------------|
| 0     | Ψ (all)       | Ψ (flat buffer)                  | Ψ (replicated)             |
| 1     | Ψ (all)       | Ψ (flat buffer)                  | Ψ/N (own shard)            |
| 2     | Ψ (all)       | Ψ/N (own shard), every microbatch | Ψ/N (own shard)           |

In bytes with mixed precision and stage 2: 2Ψ + gΨ/N + 12Ψ/N, plus the
``buckets`` (a few staging buffers of one bucket in the gradient dtype, and
in-flight reduce-scatter outputs of 1/N of a bucket) and the one ``.grad`` a
hook is consuming. With ``precision=fp32`` the parameters are their own master
weights (no extra copy) and ``.grad`` is a view of the gradient buffer (stages
0/1). Parameters stay in the model's dtype as views into one flat buffer per
dtype (see ``buffers``). ``memory_bytes`` reports what is held now,
``memory_peak_bytes`` the high-water mark since ``reset_memory_peak`` (running
counts updated at every allocation and inside the gradient hooks, ``memory``).

Gradient reduction (``grad_sync``: ``ReplicatedGradSync`` for stages 0/1,
``ShardedGradSync`` for stage 2): accumulated over microbatches and reduced over
dp in the gradient dtype, each bucket divided by dp right before its collective,
so ``grad_piece`` is already the DP mean. Stage 0/1 reduce once per step (in the
last backward); stage 2 reduce-scatters each bucket in every backward.

A step: wait for the reduction -> scale by ``1/loss_scale`` -> global norm
(TP/PP/DP, ``clip``) -> skip on every rank if it is not finite (fp16 overflow)
-> clip -> AdamW on the owned shard -> write the shard back into the parameters
and all-gather them (stages 1-2), bucket by bucket. Communication per step equals
DDP's (reduce-scatter + all-gather) for stages 0/1 and for stage 2 without
accumulation; stage 2 sends one reduce-scatter per microbatch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from parallel3d import comm
from parallel3d.parallel_state import ParallelState
from parallel3d.zero import clip
from parallel3d.zero.adamw import resolve_backend
from parallel3d.zero.buffers import BufferLayout, FlatBuffer, shard_slice
from parallel3d.zero.grad_replicated import ReplicatedGradSync
from parallel3d.zero.grad_sharded import ShardedGradSync
from parallel3d.zero.grad_sync import GradSync
from parallel3d.zero.memory import MEMORY_CATEGORIES, MemoryTracker, nbytes
from parallel3d.zero.owned import OwnedSegment, owned_segments
from parallel3d.zero.precision import LossScaler, precision_dtype

log = logging.getLogger(__name__)

ZERO_STAGES = (0, 1, 2)
__all__ = ["MEMORY_CATEGORIES", "StepInfo", "ZERO_STAGES", "ZeroOptimizer", "make_grad_sync"]


def make_grad_sync(modules: list[torch.nn.Module], param_bufs: list[FlatBuffer], pstate: ParallelState, *,
                   zero_stage: int, grad_dtype: torch.dtype, reduce_scatter: str,
                   memory: MemoryTracker) -> GradSync:
    """The gradient-synchronisation strategy of ``zero_stage``."""
    common = dict(grad_dtype=grad_dtype, reduce_scatter=reduce_scatter, memory=memory)
    if zero_stage in (0, 1):
        return ReplicatedGradSync(modules, param_bufs, pstate, zero_stage=zero_stage, **common)
    if zero_stage == 2:
        return ShardedGradSync(modules, param_bufs, pstate, **common)
    raise ValueError(f"no gradient synchronisation for ZeRO stage {zero_stage}")


@dataclass(frozen=True)
class StepInfo:
    grad_norm: float  # global norm before clipping (of the unscaled, DP-averaged gradient)
    skipped: bool  # non-finite gradient somewhere in the job: nobody stepped
    loss_scale: float  # the scale used for this step's gradients
    lr: float


def _named_params(modules: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    out, seen = [], set()
    for i, m in enumerate(modules):
        for name, p in m.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((getattr(p, "global_name", None) or (name if len(modules) == 1 else f"{i}.{name}"), p))
    return out


class ZeroOptimizer:
    """Sharded mixed-precision AdamW for ``modules`` (this rank's model chunks).

    Invariants: every trainable parameter is a view into ``self.param_bufs``;
    after ``step`` all DP ranks hold identical parameters; master weights and
    moments cover exactly this rank's shard (``layout.shard_numel`` elements).
    ``reduce_scatter``: how stages 1-2 reduce a bucket: "reduce_scatter" (default; ZeRO's
    volume, equal to DDP's), or "auto" (opt-in: an all-reduce on gloo, where it is the
    faster collective though it sends more bytes, else a reduce-scatter; see ``grad_sync``).
    ``grad_reduce_dtype``: "fp32" (default: fp32 main grads, accumulated and reduced in fp32)
    or the training precision ("bf16"/"fp16": half the gradient bytes and bandwidth).
    ``bucket_size_mb`` sizes buckets in parameter-dtype bytes (fp32 staging buffers of a
    bf16 model are twice that).
    """

    def __init__(
        self,
        modules: list[torch.nn.Module] | torch.nn.Module,
        pstate: ParallelState,
        *,
        zero_stage: int,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_grad: float | None = None,
        bucket_size_mb: float = 25.0,
        precision: str = "fp32",
        lr_schedule: Callable[[int], float] | None = None,
        loss_scale_init: float = 2.0**16,
        loss_scale_growth_interval: int = 1000,
        loss_scale_growth_factor: float = 2.0,
        loss_scale_backoff_factor: float = 0.5,
        loss_scale_min: float = 1.0,
        fused_adamw_backend: str = "auto",
        reduce_scatter: str = "reduce_scatter",
        grad_reduce_dtype: str = "fp32",
    ) -> None:
        if isinstance(modules, torch.nn.Module):
            modules = [modules]
        if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
            raise ValueError(f"parallel.zero_stage={zero_stage!r} is not one of {ZERO_STAGES}")
        if not isinstance(bucket_size_mb, (int, float)) or not bucket_size_mb > 0:
            raise ValueError(f"parallel.bucket_size_mb={bucket_size_mb!r} must be a number > 0")
        if clip_grad is not None and not clip_grad > 0:
            raise ValueError(f"optim.clip_grad={clip_grad!r} must be > 0 or None (no clipping)")
        if not lr >= 0 or not eps > 0 or not weight_decay >= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW hyper-parameters out of range: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        dtype = precision_dtype(precision)
        if grad_reduce_dtype not in ("fp32", precision):
            raise ValueError(f"parallel.grad_reduce_dtype={grad_reduce_dtype!r} must be 'fp32' or the training "
                             f"precision {precision!r}")
        named = _named_params(modules)
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
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.clip_grad = clip_grad
        self.lr_schedule = lr_schedule
        self.scaler = LossScaler(
            enabled=precision == "fp16", scale=float(loss_scale_init), growth_factor=loss_scale_growth_factor,
            backoff_factor=loss_scale_backoff_factor, growth_interval=loss_scale_growth_interval,
            min_scale=loss_scale_min,
        )
        self._adamw = resolve_backend(fused_adamw_backend)
        self.dp = comm.group_size(pstate, "dp")
        self.iteration = 0  # step() calls, skipped or not (drives the LR schedule)
        self.adam_step = 0  # applied updates (drives bias correction)

        bucket_numel = max(1, int(bucket_size_mb * 2**20) // dtype.itemsize)
        sharded = zero_stage > 0
        layout = BufferLayout(
            named, bucket_numel=bucket_numel, dp=self.dp,
            owner_count=self.dp if sharded else 1,
            owner_index=comm.group_rank(pstate, "dp") if sharded else 0,
            count_in_norm=lambda p: clip.counts_in_norm(p, pstate),
        )
        device = named[0][1].device
        self.memory = MemoryTracker(MEMORY_CATEGORIES)
        self.param_bufs = [FlatBuffer(layout, dtype, device)]
        self.param_bufs[0].adopt_params()
        self.memory.add("model_weights", sum(nbytes(pb.data) for pb in self.param_bufs))
        self.grad_sync: GradSync = make_grad_sync(
            modules, self.param_bufs, pstate, zero_stage=zero_stage, grad_dtype=precision_dtype(grad_reduce_dtype),
            reduce_scatter=reduce_scatter, memory=self.memory,
        )
        # fp32 master weights of the owned shard (the parameters themselves when training in fp32).
        self.masters: list[torch.Tensor | None] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        for pb in self.param_bufs:
            n = pb.layout.shard_numel
            if dtype == torch.float32:
                self.masters.append(None)
            else:
                master = torch.empty(n, dtype=torch.float32, device=device)
                for b in pb.layout.buckets:
                    shard_slice(master, b).copy_(pb.piece_view(b))
                self.masters.append(master)
            self.exp_avgs.append(torch.zeros(n, dtype=torch.float32, device=device))
            self.exp_avg_sqs.append(torch.zeros(n, dtype=torch.float32, device=device))
        self.memory.add("master_weights", sum(nbytes(m) for m in self.masters if m is not None))
        self.memory.add("optimizer_moments", sum(nbytes(t) for t in self.exp_avgs + self.exp_avg_sqs))

    # ---- public API ----------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 unless fp16)."""
        return self.scaler.scale

    @property
    def layouts(self) -> list[BufferLayout]:
        return [pb.layout for pb in self.param_bufs]

    def current_lr(self) -> float:
        return self.lr_schedule(self.iteration) if self.lr_schedule is not None else self.lr

    def zero_grad(self) -> None:
        self.grad_sync.zero_grad()

    def master_piece(self, group: int, bucket) -> torch.Tensor:
        """fp32 master weights of this rank's piece of ``bucket``."""
        master = self.masters[group]
        if master is None:
            return self.param_bufs[group].piece_view(bucket)
        return shard_slice(master, bucket)

    @torch.no_grad()
    def step(self) -> StepInfo:
        self.grad_sync.complete()
        lr = self.current_lr()
        used_scale = self.scaler.scale
        inv = 1.0 / used_scale  # the pieces are DP means already (the reduction divided by dp)
        local_sq = torch.zeros((), dtype=torch.float32, device=self.param_bufs[0].data.device)
        for g, pb in enumerate(self.param_bufs):
            for b in pb.layout.buckets:
                piece = self.grad_sync.grad_piece(g, b)
                local_sq += clip.piece_sq_sum(piece, b, inv)
                if not clip.uncounted_all_finite(piece, b):
                    # Also in elements another rank counts in the norm (e.g. TP replicas):
                    # an inf in the sum makes every rank of the job see the overflow.
                    local_sq += math.inf
        norm = clip.reduce_norm(local_sq, self.pstate, sharded_over_dp=self.zero_stage > 0)
        self.iteration += 1
        if not math.isfinite(norm):
            self.scaler.update(overflow=True)
            self.grad_sync.reset()
            log.warning("non-finite gradient norm %s: step skipped on all ranks (loss scale -> %s)",
                        norm, self.scaler.scale)
            return StepInfo(grad_norm=norm, skipped=True, loss_scale=used_scale, lr=lr)
        coef = inv * clip.clip_coefficient(norm, self.clip_grad)
        self.adam_step += 1
        beta1, beta2 = self.betas
        for g, pb in enumerate(self.param_bufs):
            for b in pb.layout.buckets:
                grad = self.grad_sync.grad_piece(g, b).float() * coef
                master = self.master_piece(g, b)
                if self.weight_decay and lr:
                    for seg in b.segments:
                        if seg.slot.decay:  # decoupled decay, before the Adam update (as torch does)
                            lo = seg.shard_start - b.shard_offset
                            master[lo : lo + seg.length].mul_(1 - lr * self.weight_decay)
                self._adamw(master, grad, shard_slice(self.exp_avgs[g], b), shard_slice(self.exp_avg_sqs[g], b),
                            step=self.adam_step, lr=lr, beta1=beta1, beta2=beta2, eps=self.eps)
                if self.masters[g] is not None:
                    pb.piece_view(b).copy_(master)
        self.gather_params()
        self.scaler.update(overflow=False)
        self.grad_sync.reset()
        return StepInfo(grad_norm=norm, skipped=False, loss_scale=used_scale, lr=lr)

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather every bucket's updated pieces into the full parameter buffer (stages 1-2)."""
        if self.zero_stage == 0:
            return
        works = []
        for pb in self.param_bufs:
            for b in pb.layout.buckets:
                # The collective must not read its own output buffer: send a copy of the piece.
                works.append(comm.all_gather_into_tensor(pb.bucket_view(b), pb.piece_view(b).clone(),
                                                         self.pstate, "dp", async_op=True))
        for w in works:
            if w is not None:
                w.wait()

    def memory_peak_bytes(self) -> dict[str, int]:
        """The most bytes held per category since construction or ``reset_memory_peak``.

        Includes what ``memory_bytes`` cannot see after the fact: the ``.grad`` a gradient hook
        is consuming and reduce-scatter outputs in flight (``buckets``). Each category has its
        own high-water mark (their sum can exceed the peak of the total)."""
        return dict(self.memory.peak)

    def reset_memory_peak(self) -> None:
        """Restart the high-water marks from what is held now."""
        self.memory.reset_peak()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now per category, summed over distinct tensor storages."""
        seen: set[int] = set()

        def size(tensors) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                st = t.untyped_storage()
                if st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                total += st.nbytes()
            return total

        params = [s.param for pb in self.param_bufs for s in pb.layout.slots]
        out = {"model_weights": size([pb.data for pb in self.param_bufs] + params)}
        out["gradients"] = size(self.grad_sync.gradient_tensors() + [p.grad for p in params])
        out["master_weights"] = size(self.masters)
        out["optimizer_moments"] = size(self.exp_avgs + self.exp_avg_sqs)
        out["buckets"] = size(self.grad_sync.staging_buffers())
        return out

    # ---- checkpoints -------------------------------------------------------------------
    def owned_segments(self) -> list[OwnedSegment]:
        """This rank's master weights and moments per parameter range, as in-place views (``owned``)."""
        return owned_segments(self)

    @property
    def replicated_over_dp(self) -> bool:
        """Whether every dp rank holds the whole optimizer state (stage 0) rather than a shard."""
        return self.zero_stage == 0

    @torch.no_grad()
    def params_from_master(self) -> None:
        """Make the parameters equal their (rounded) master weights after the masters were
        overwritten in place (checkpoint load, HF import); all ranks of the dp group call it."""
        for g, pb in enumerate(self.param_bufs):
            if self.masters[g] is None:
                continue  # fp32: the parameters are the masters
            for b in pb.layout.buckets:
                pb.piece_view(b).copy_(self.master_piece(g, b))
        self.gather_params()
