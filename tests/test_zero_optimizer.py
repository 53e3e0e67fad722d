"""ZeRO 0-3 on gloo ranks against single-process torch.optim.AdamW on the same global batch
(every stage x gradient dtype x accumulation x dp), and the gradient-accumulation contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZERO_STAGES, StepInfo, WarmupCosine, ZeroOptimizer
from tests.harness import run_on_ranks

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
TINY_BUCKET_MB = 40 * 4 / 2**20  # ~40 fp32 elements: several buckets, none divisible by dp


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """131 parameters (odd, so no dp divides it); LayerNorm and biases are not decayed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.LayerNorm(9), nn.GELU(), nn.Linear(9, 5)).to(dtype)


def global_batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 6, generator=g), torch.randint(0, 5, (size,), generator=g)


def reference_adamw(model: nn.Module, lr, schedule=None) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS)


def train_reference(steps: int, clip: float | None, schedule=None, batch: int = 8) -> tuple[nn.Module, list[float]]:
    model = make_mlp()
    opt = reference_adamw(model, LR)
    norms = []
    for step in range(steps):
        if schedule is not None:
            for group in opt.param_groups:
                group["lr"] = schedule(step)
        x, y = global_batch(step, batch)
        F.cross_entropy(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf)))
        opt.step()
        opt.zero_grad()
    return model, norms


def max_rel_error(model: nn.Module, ref: nn.Module) -> float:
    return max(float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())
               for a, b in zip(model.parameters(), ref.parameters()))


def _train_dp(rank, world_size, stages, steps, clip, use_schedule, layout=None):
    """``layout``: the data-parallel dimensions (default dp = world); every rank that holds a replica of
    the parameters (its dp_cp index) takes its own slice of the global batch."""
    ps = ParallelState(Topology(**(layout or {"dp": world_size})))
    replica = ps.ranks("dp_cp").index(rank)
    schedule = WarmupCosine(max_lr=LR, min_lr=LR / 10, warmup_steps=3, decay_steps=steps) if use_schedule else None
    ref, ref_norms = train_reference(steps, clip, schedule)
    out = {}
    for stage in stages:
        model = make_mlp()
        opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            clip_grad=clip, bucket_size_mb=TINY_BUCKET_MB, lr_schedule=schedule)
        norms = []
        for step in range(steps):
            x, y = global_batch(step)
            local = slice(replica * len(x) // world_size, (replica + 1) * len(x) // world_size)
            F.cross_entropy(model(x[local]), y[local]).backward()
            info = opt.step()
            assert isinstance(info, StepInfo) and not info.skipped
            norms.append(info.grad_norm)
            opt.zero_grad()
        with opt.gathered_params():  # stage 3 keeps only shards between steps
            out[stage] = (max_rel_error(model, ref), norms, [b.size for b in opt.layouts[0].buckets])
    return out, ref_norms


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_stages_match_torch_adamw(dp):
    results = run_on_ranks(_train_dp, dp, ZERO_STAGES, 10, 0.05, True, timeout=120)
    for rank, (per_stage, ref_norms) in enumerate(results):
        assert max(ref_norms) > 0.05, "clipping should be active in this test"
        for stage, (err, norms, bucket_sizes) in per_stage.items():
            assert err < 1e-5, f"dp={dp} stage={stage} rank={rank}: rel. error {err:.2e}"
            assert norms == pytest.approx(ref_norms, rel=1e-5), f"stage={stage}: grad norms differ"
            assert len(bucket_sizes) > 1 and all(s % dp == 0 for s in bucket_sizes)
    assert sum(bucket_sizes) > 131 or 131 % dp == 0  # padding was needed for an odd parameter count


def test_zero_reduces_over_every_replica_dp_and_cp():
    """cp ranks hold the same weights as dp ranks: ZeRO must reduce and shard over dp x cp, not dp."""
    results = run_on_ranks(_train_dp, 4, ZERO_STAGES, 4, 0.05, False, {"cp": 2, "dp": 2}, timeout=120)
    for rank, (per_stage, ref_norms) in enumerate(results):
        for stage, (err, norms, bucket_sizes) in per_stage.items():
            assert err < 1e-5, f"cp=2 dp=2 stage={stage} rank={rank}: rel. error {err:.2e}"
            assert norms == pytest.approx(ref_norms, rel=1e-5), f"stage={stage}: grad norms differ"
            assert all(s % 4 == 0 for s in bucket_sizes)


# ---- the matrix: every stage x gradient dtype x accumulation x dp against torch AdamW ------------
MATRIX_STEPS, MATRIX_BATCH = 3, 16
DTYPE_CASES = (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"))  # (precision, grad_reduce_dtype)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# bf16 weights round at 2^-9 relative; the fp32 reference is the same model without rounding
# (measured: parameters <= 7.5e-3, grad norms <= 3.7e-3 relative).
BF16_PARAM_TOLERANCE, BF16_NORM_TOLERANCE = 2e-2, 1e-2


def matrix_cases() -> list[tuple[int, str, str, int]]:
    return [(stage, precision, grad_dtype, acc)
            for stage in ZERO_STAGES for precision, grad_dtype in DTYPE_CASES for acc in (1, 4)]


def accumulate_rank_batch(model: nn.Module, opt: ZeroOptimizer, x: torch.Tensor, y: torch.Tensor, rank: int,
                          dp: int, acc: int, dtype: torch.dtype) -> None:
    """Backward of this DP rank's share of the global batch ``(x, y)`` in ``acc`` microbatches,
    announcing each to ``opt.grad_sync`` as the pipeline engine does."""
    rows = len(x) // dp // acc
    for mb in range(acc):
        lo = (rank * acc + mb) * rows
        opt.grad_sync.prepare(is_last_microbatch=mb == acc - 1)
        (F.cross_entropy(model(x[lo : lo + rows].to(dtype)).float(), y[lo : lo + rows]) / acc).backward()


def _train_case(ps: ParallelState, rank: int, dp: int, case: tuple[int, str, str, int],
                ref: nn.Module) -> tuple[float, list[float]]:
    stage, precision, grad_dtype, acc = case
    dtype = DTYPES[precision]
    model = make_mlp(dtype=dtype)
    opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, clip_grad=0.05,
                        precision=precision, grad_reduce_dtype=grad_dtype, bucket_size_mb=TINY_BUCKET_MB)
    norms = []
    for step in range(MATRIX_STEPS):
        accumulate_rank_batch(model, opt, *global_batch(step, MATRIX_BATCH), rank, dp, acc, dtype)
        opt.grad_sync.finalize()
        info = opt.step()
        assert not info.skipped
        norms.append(info.grad_norm)
        opt.zero_grad()
    with opt.gathered_params():
        return max_rel_error(model, ref), norms


def _matrix(rank, world_size, cases):
    ps = ParallelState(Topology(tp=1, pp=1, dp=world_size)) if world_size > 1 else ParallelState.single_process()
    ref, ref_norms = train_reference(MATRIX_STEPS, 0.05, batch=MATRIX_BATCH)
    return {case: _train_case(ps, rank, world_size, case, ref) for case in cases}, ref_norms


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_every_stage_grad_dtype_and_accumulation_matches_torch_adamw(dp):
    cases = matrix_cases()
    results = [_matrix(0, 1, cases)] if dp == 1 else run_on_ranks(_matrix, dp, cases, timeout=180)
    for rank, (per_case, ref_norms) in enumerate(results):
        for (stage, precision, grad_dtype, acc), (err, norms) in per_case.items():
            label = f"dp={dp} rank={rank} stage={stage} {precision}/grads {grad_dtype} acc={acc}"
            if precision == "fp32":
                assert err < 1e-5, f"{label}: rel. error {err:.2e}"
                assert norms == pytest.approx(ref_norms, rel=1e-5), label
            else:
                assert err < BF16_PARAM_TOLERANCE, f"{label}: rel. error {err:.2e}"
                assert norms == pytest.approx(ref_norms, rel=BF16_NORM_TOLERANCE), label


@pytest.mark.parametrize("backend", ["torch", "auto"])  # auto: kernels.adamw.adamw_flat_ when present
def test_single_process_matches_torch_adamw_without_clipping(backend):
    ps = ParallelState.single_process()
    ref, _ = train_reference(5, None)
    model = make_mlp()
    opt = ZeroOptimizer(model, ps, zero_stage=2, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                        fused_adamw_backend=backend)
    for step in range(5):
        x, y = global_batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert max_rel_error(model, ref) < 1e-6


def _accumulate(rank, world_size, stage, reduce_scatter="reduce_scatter"):
    """Two microbatches per step through grad_sync.prepare/finish, as the pipeline engine drives it."""
    ps = ParallelState(Topology(tp=1, pp=1, dp=world_size))
    ref, _ = train_reference(4, 0.05)
    model = make_mlp()
    opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                        clip_grad=0.05, bucket_size_mb=TINY_BUCKET_MB, reduce_scatter=reduce_scatter)
    for step in range(4):
        x, y = global_batch(step)
        x, y = x[rank::world_size], y[rank::world_size]
        for mb in range(2):
            opt.grad_sync.prepare(is_last_microbatch=mb == 1)
            (F.cross_entropy(model(x[mb::2]), y[mb::2]) / 2).backward()
        opt.grad_sync.finalize()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        return max_rel_error(model, ref), dict(ps.comm_stats.calls)


def _accumulate_both_modes(rank, world_size, stages):
    return {stage: (_accumulate(rank, world_size, stage), _accumulate(rank, world_size, stage, "all_reduce"))
            for stage in stages}


def test_gradient_accumulation_reduction_counts():
    """Stage 1 reduces each bucket once per step (in the last backward); stage 2 once per
    microbatch (its gradients never exist in full), as DeepSpeed's stage 2 does."""
    results = run_on_ranks(_accumulate_both_modes, 2, (1, 2), timeout=120)
    for per_stage in results:
        for stage, ((err, calls), (err_ar, calls_ar)) in per_stage.items():
            assert err < 1e-5 and err_ar < 1e-5, (stage, err, err_ar)
            buckets = calls[("dp_cp", "all_gather")] // 4
            per_step = 1 if stage == 1 else 2
            assert calls[("dp_cp", "reduce_scatter")] == 4 * buckets * per_step, stage
            # gloo mode: the same reductions as all-reduces (beside the grad-norm ones both modes do)
            assert calls_ar[("dp_cp", "all_reduce")] - calls[("dp_cp", "all_reduce")] == 4 * buckets * per_step


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_second_backward_without_prepare_fails_loudly(stage):
    # Reductions start inside the last backward (bucket by bucket), so an unannounced
    # second backward would accumulate into buffers already being reduced.
    model = make_mlp()
    opt = ZeroOptimizer([model], ParallelState.single_process(), zero_stage=stage, lr=LR)
    x, y = global_batch(0)
    F.cross_entropy(model(x), y).backward()
    match = r"arrived after its last microbatch's backward(.|\n)*prepare\(is_last_microbatch=False\)"
    with pytest.raises(RuntimeError, match=match):
        F.cross_entropy(model(x), y).backward()
    opt.grad_sync.finalize()
    with pytest.raises(RuntimeError, match=r"arrived after finalize\(\)"):
        F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(zero_stage=4), r"parallel.zero_stage=4: must be one of 0, 1, 2, 3"),
        (dict(zero_stage=1, offload="nvme"), r"parallel.offload='nvme': must be one of none, cpu, disk"),
        (dict(zero_stage=0, offload="cpu"), r"parallel.offload=cpu: needs parallel.zero_stage >= 1"),
        (dict(zero_stage=3, offload="disk"), r"parallel.offload_dir=null: parallel.offload=disk needs a directory"),
        (dict(zero_stage=3, zero3_prefetch=-1), r"parallel.zero3_prefetch=-1: must be an integer >= 0"),
        (dict(zero_stage=3, zero3_reshard="layer"), r"parallel.zero3_reshard='layer': must be one of"),
        (dict(zero_stage=1, bucket_size_mb=0), r"parallel.bucket_size_mb=0: must be a number > 0"),
        (dict(zero_stage=1, bucket_size_mb=-2.5), r"parallel.bucket_size_mb=-2.5"),
        (dict(zero_stage=1, precision="fp8"), r"train.precision='fp8': must be one of fp32, bf16, fp16"),
        (dict(zero_stage=1, precision="bf16"), r"needs torch.bfloat16 parameters, but 0.weight is torch.float32"),
        (dict(zero_stage=1, clip_grad=0.0), r"optim.clip_grad=0.0 must be > 0"),
        (dict(zero_stage=1, fused_adamw_backend="cuda"), r"fused_adamw_backend='cuda' is not one of"),
        (dict(zero_stage=2, reduce_scatter="ring"), r"reduce_scatter='ring' is not one of \('auto', "),
        (dict(zero_stage=2, grad_reduce_dtype="bf16"),
         r"parallel.grad_reduce_dtype='bf16': must be fp32 or the training precision \(train.precision='fp32'\)"),
    ],
)
def test_bad_settings_fail_fast(kwargs, match):
    """ZeroOptimizer checks its settings with ZeroOptions: the config's one-line messages."""
    with pytest.raises(ValueError, match=match):
        ZeroOptimizer(make_mlp(), ParallelState.single_process(), lr=LR, **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(loss_scale_init=0.0), r"loss_scale_init=0.0: must be a number > 0"),
        (dict(loss_scale_init=float("inf")), r"loss_scale_init=inf"),
        (dict(loss_scale_backoff_factor=1.5), r"loss_scale_backoff_factor=1.5 must be in \(0, 1\)"),
        (dict(loss_scale_growth_factor=1.0), r"loss_scale_growth_factor=1.0 must be > 1"),
        (dict(loss_scale_growth_interval=0), r"loss_scale_growth_interval=0 must be an integer >= 1"),
        (dict(loss_scale_min=1e9), r"loss_scale_min=1000000000.0 must be in \(0, loss_scale_init\]"),
    ],
)
def test_fp16_loss_scaling_settings_are_checked(kwargs, match):
    model = make_mlp(dtype=torch.float16)
    with pytest.raises(ValueError, match=match):
        ZeroOptimizer(model, ParallelState.single_process(), zero_stage=2, lr=LR, precision="fp16", **kwargs)


def test_warmup_cosine_schedule():
    s = WarmupCosine(max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(9) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert s(14) == s(100) == 0.1
    with pytest.raises(ValueError, match="min_lr"):
        WarmupCosine(max_lr=1.0, min_lr=2.0, warmup_steps=1, decay_steps=2)


def test_adamw_defaults_are_the_options_defaults():
    """One source of truth: an optimizer built without hyper-parameters uses ``OptimizerOptions``'
    defaults (and ``ZeroOptions``' for the sharding keys), read from a constructed options object."""
    import dataclasses
    import inspect

    from parallel3d.zero import OptimizerOptions, ZeroOptions

    o, z = OptimizerOptions(), ZeroOptions()
    opt = ZeroOptimizer(make_mlp(), ParallelState.single_process(), zero_stage=0, lr=LR)
    assert (opt.betas, opt.eps, opt.weight_decay, opt.clip_grad) == (o.betas, o.eps, o.weight_decay, o.clip_grad)
    params = inspect.signature(ZeroOptimizer).parameters
    for f in dataclasses.fields(ZeroOptions):
        if f.name != "zero_stage":
            assert params[f.name].default == getattr(z, f.name), f.name
