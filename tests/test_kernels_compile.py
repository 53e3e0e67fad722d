"""Every Triton kernel compiles for a real GPU (sm_90, to a cubin) on this CPU-only machine.

The interpreter runs kernels as numpy code and accepts things the compiler rejects
(loop-carried type changes, pointer/int mix-ups, non-constexpr shapes). Compiling each
kernel, in each constexpr branch the host code launches, with Triton's bundled CUDA
toolchain catches those without a GPU. Signatures use bf16 data and i32 sizes, as the
benchmark shapes do.
"""

from __future__ import annotations

import pytest

BF16, F32 = "*bf16", "*fp32"


def _cases() -> dict[str, tuple]:
    from kernels import adamw, cross_entropy, layernorm, rmsnorm, rope, swiglu

    i32 = "i32"
    rms_fwd = dict(X=BF16, W=BF16, Y=BF16, RSTD=F32, stride_x=i32, stride_y=i32, N=i32, eps="fp32",
                   BLOCK_N="constexpr", SINGLE_BLOCK="constexpr")
    rms_bwd = dict(DY=BF16, X=BF16, W=BF16, RSTD=F32, DX=BF16, DW_PARTIAL=F32, stride_dy=i32, stride_x=i32,
                   stride_dx=i32, M=i32, N=i32, rows_per_program=i32, BLOCK_N="constexpr", SINGLE_BLOCK="constexpr")
    ln_fwd = dict(X=BF16, W=BF16, B=BF16, Y=BF16, MEAN=F32, RSTD=F32, stride_x=i32, stride_y=i32, N=i32, eps="fp32",
                  BLOCK_N="constexpr", SINGLE_BLOCK="constexpr", HAS_BIAS="constexpr")
    ln_bwd = dict(DY=BF16, X=BF16, W=BF16, MEAN=F32, RSTD=F32, DX=BF16, DW_PARTIAL=F32, DB_PARTIAL=F32,
                  stride_dy=i32, stride_x=i32, stride_dx=i32, M=i32, N=i32, rows_per_program=i32,
                  BLOCK_N="constexpr", SINGLE_BLOCK="constexpr")
    strides = "q_sb q_ss q_sh k_sb k_ss k_sh qo_sb qo_ss qo_sh ko_sb ko_ss ko_sh cos_s sin_s".split()
    rope_sig = dict(Q=BF16, K=BF16, COS=F32, SIN=F32, QO=BF16, KO=BF16, S=i32, HQ=i32, HK=i32, HALF=i32,
                    **{s: i32 for s in strides}, BLOCK_HQ="constexpr", BLOCK_HK="constexpr", BLOCK_D="constexpr",
                    INVERSE="constexpr")
    stats = dict(LOGITS=BF16, TARGETS="*i64", MAX=F32, SUM_EXP=F32, TARGET_LOGIT=F32, SUM_LOGITS=F32, stride=i32,
                 V_VALID=i32, vocab_start=i32, ignore_index=i32, BLOCK_V="constexpr")
    grad = dict(LOGITS=BF16, TARGETS="*i64", LSE=F32, ROW_SCALE=F32, GRAD=BF16, stride=i32, grad_stride=i32, V=i32,
                V_VALID=i32, vocab_start=i32, smooth_target="fp32", target_weight="fp32", BLOCK_V="constexpr")
    adam = dict(P=F32, G=BF16, M=F32, V=F32, P_OUT=BF16, n=i32, lr="fp32", beta1="fp32", beta2="fp32", eps="fp32",
                decay_factor="fp32", step_size="fp32", inv_sqrt_bc2="fp32", BLOCK="constexpr", WRITE_OUT="constexpr")
    return {
        "rms_norm_fwd_one_block": (rmsnorm._rms_norm_fwd, rms_fwd, dict(BLOCK_N=8192, SINGLE_BLOCK=True), 16),
        "rms_norm_fwd_blocks": (rmsnorm._rms_norm_fwd, rms_fwd, dict(BLOCK_N=8192, SINGLE_BLOCK=False), 16),
        "rms_norm_bwd_one_block": (rmsnorm._rms_norm_bwd, rms_bwd, dict(BLOCK_N=4096, SINGLE_BLOCK=True), 8),
        "rms_norm_bwd_blocks": (rmsnorm._rms_norm_bwd, rms_bwd, dict(BLOCK_N=1024, SINGLE_BLOCK=False), 4),
        "layer_norm_fwd_one_block": (layernorm._layer_norm_fwd, ln_fwd,
                                     dict(BLOCK_N=4096, SINGLE_BLOCK=True, HAS_BIAS=True), 8),
        "layer_norm_fwd_blocks": (layernorm._layer_norm_fwd, ln_fwd,
                                  dict(BLOCK_N=1024, SINGLE_BLOCK=False, HAS_BIAS=False), 4),
        "layer_norm_bwd_one_block": (layernorm._layer_norm_bwd, ln_bwd, dict(BLOCK_N=4096, SINGLE_BLOCK=True), 8),
        "layer_norm_bwd_blocks": (layernorm._layer_norm_bwd, ln_bwd, dict(BLOCK_N=1024, SINGLE_BLOCK=False), 4),
        "rope": (rope._rope_kernel, rope_sig, dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_D=64, INVERSE=True), 8),
        "swiglu_fwd": (swiglu._swiglu_fwd, dict(GATE=BF16, UP=BF16, Y=BF16, n=i32, BLOCK="constexpr"),
                       dict(BLOCK=2048), 8),
        "swiglu_bwd": (swiglu._swiglu_bwd, dict(DY=BF16, GATE=BF16, UP=BF16, DGATE=BF16, DUP=BF16, n=i32,
                                                BLOCK="constexpr"), dict(BLOCK=2048), 8),
        "cross_entropy_stats": (cross_entropy._softmax_stats_kernel, stats, dict(BLOCK_V=4096), 8),
        "cross_entropy_grad": (cross_entropy._cross_entropy_grad_kernel, grad, dict(BLOCK_V=4096), 8),
        "adamw": (adamw._adamw_kernel, adam, dict(BLOCK=1024, WRITE_OUT=True), 8),
    }


CASE_NAMES = ["rms_norm_fwd_one_block", "rms_norm_fwd_blocks", "rms_norm_bwd_one_block", "rms_norm_bwd_blocks",
              "layer_norm_fwd_one_block", "layer_norm_fwd_blocks", "layer_norm_bwd_one_block",
              "layer_norm_bwd_blocks", "rope", "swiglu_fwd", "swiglu_bwd", "cross_entropy_stats",
              "cross_entropy_grad", "adamw"]


@pytest.fixture(scope="module")
def sm90(tmp_path_factory: pytest.TempPathFactory):
    from triton.backends.compiler import GPUTarget  # triton is a dependency on Linux: no skip
    from triton.compiler import ASTSource

    return ASTSource, GPUTarget("cuda", 90, 32), str(tmp_path_factory.mktemp("triton_cache"))


def test_case_list_covers_every_kernel() -> None:
    assert sorted(_cases()) == sorted(CASE_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASE_NAMES)
def test_kernel_compiles_for_sm90(name: str, sm90, monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    ast_source, target, cache_dir = sm90
    monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir)  # no writes to the user's cache
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    fn, signature, constants, num_warps = _cases()[name]
    constexprs = {(fn.arg_names.index(key),): value for key, value in constants.items()}
    compiled = triton.compile(ast_source(fn=fn, signature=signature, constexprs=constexprs), target=target,
                              options={"num_warps": num_warps})
    assert compiled.asm.get("cubin"), f"{name}: no cubin produced"
