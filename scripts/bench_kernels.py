#!/usr/bin/env python
"""Benchmark the fused kernels (issue 7) against torch eager, torch.compile and liger-kernel.

On a CUDA GPU, for each kernel and shape: median time of forward and of forward+backward,
achieved GB/s (the minimum bytes the op must move / time) and that as a fraction of the
device's measured copy bandwidth; for cross-entropy also the peak extra memory of
forward+backward. Prints a table and writes JSON (``--out``).
Targets on an H100/H200: norms and SwiGLU >= 80% of copy bandwidth; cross-entropy peak
memory <= 1/4 of eager's at a 128k vocabulary.

Without a GPU it says so, times the torch reference ops on small CPU shapes as a sanity
check, writes the JSON and exits 0.

    python scripts/bench_kernels.py [--out bench_results/kernels.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.adamw import adamw_step_reference  # noqa: E402
from kernels.cross_entropy import cross_entropy_reference  # noqa: E402
from kernels.layernorm import layer_norm_reference  # noqa: E402
from kernels.rmsnorm import rms_norm_reference  # noqa: E402
from kernels.rope import apply_rope_reference  # noqa: E402
from kernels.swiglu import swiglu_reference  # noqa: E402

GPU_TOKENS_HIDDEN = [(16384, 4096), (16384, 8192)]
GPU_CE = [(16384, 128256)]  # tokens x vocab (Llama 3)
HEAD_DIM = 128
NORM_TARGET, CE_MEMORY_TARGET = 0.80, 0.25


# ---- timing -------------------------------------------------------------------------
def median_ms(fn: Callable[[], Any], reps: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes / time)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps=20, warmup=5, cuda=device.type == "cuda")
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ---- one op = inputs + minimum bytes + implementations --------------------------------
def op_cases(tokens: int, hidden: int, vocab: int | None, dtype: torch.dtype, device: torch.device) -> list[dict]:
    """Each case: name, shape, make() -> (inputs, grad-out), bytes for fwd and fwd+bwd, impls."""
    es = torch.tensor([], dtype=dtype).element_size()
    cases = []
    if vocab is None:
        n = tokens * hidden
        heads = hidden // HEAD_DIM
        kv = max(1, heads // 4)

        def norm_inputs():
            x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
            w = torch.ones(hidden, dtype=dtype, device=device, requires_grad=True)
            b = torch.zeros(hidden, dtype=dtype, device=device, requires_grad=True)
            return (x, w, b), torch.randn_like(x)

        cases.append(dict(name="rms_norm", shape=f"{tokens}x{hidden}", make=norm_inputs,
                          bytes_fwd=2 * n * es, bytes_fwdbwd=5 * n * es,
                          eager=lambda x, w, b: rms_norm_reference(x, w, 1e-6),
                          fused=lambda x, w, b: _fused("rmsnorm").rms_norm(x, w, 1e-6),
                          liger=_liger_norm("LigerRMSNorm", hidden, 1e-6, dtype, device)))
        cases.append(dict(name="layer_norm", shape=f"{tokens}x{hidden}", make=norm_inputs,
                          bytes_fwd=2 * n * es, bytes_fwdbwd=5 * n * es,
                          eager=lambda x, w, b: layer_norm_reference(x, w, b, 1e-5),
                          fused=lambda x, w, b: _fused("layernorm").layer_norm(x, w, b, 1e-5),
                          liger=_liger_norm("LigerLayerNorm", hidden, 1e-5, dtype, device)))

        def swiglu_inputs():
            a = torch.randn(tokens, 3 * hidden, dtype=dtype, device=device, requires_grad=True)
            b = torch.randn(tokens, 3 * hidden, dtype=dtype, device=device, requires_grad=True)
            return (a, b), torch.randn_like(a)

        m = 3 * n  # ffn width ~ 3x hidden (Llama-style)
        cases.append(dict(name="swiglu", shape=f"{tokens}x{3 * hidden}", make=swiglu_inputs,
                          bytes_fwd=3 * m * es, bytes_fwdbwd=8 * m * es, eager=swiglu_reference,
                          fused=lambda a, b: _fused("swiglu").swiglu(a, b), liger=_liger_swiglu()))

        def rope_inputs():
            seq = 4096 if tokens % 4096 == 0 else tokens
            q = torch.randn(tokens // seq, seq, heads, HEAD_DIM, dtype=dtype, device=device, requires_grad=True)
            k = torch.randn(tokens // seq, seq, kv, HEAD_DIM, dtype=dtype, device=device, requires_grad=True)
            ang = torch.rand(seq, HEAD_DIM // 2, device=device) * 100
            return (q, k, ang.cos(), ang.sin()), None

        qk = tokens * (heads + kv) * HEAD_DIM
        cases.append(dict(name="rope", shape=f"{tokens}x({heads}+{kv})x{HEAD_DIM}", make=rope_inputs,
                          bytes_fwd=2 * qk * es, bytes_fwdbwd=4 * qk * es, eager=apply_rope_reference,
                          fused=lambda q, k, c, s: _fused("rope").apply_rope(q, k, c, s), liger=_liger_rope()))

        def adamw_inputs():
            p = torch.randn(n, device=device)
            return (p, torch.randn(n, device=device), torch.zeros(n, device=device), torch.zeros(n, device=device),
                    torch.empty(n, dtype=dtype, device=device)), None

        hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10)
        cases.append(dict(name="adamw", shape=f"{n}", make=adamw_inputs, bytes_fwd=(16 + 12 + es) * n,
                          bytes_fwdbwd=None, differentiable=False,
                          eager=lambda p, g, m_, v, o: adamw_step_reference(p, g, m_, v, model_param_out=o, **hyper),
                          fused=lambda p, g, m_, v, o: _fused("adamw").adamw_step_triton(
                              p, g, m_, v, model_param_out=o, **hyper),
                          liger=None))
    else:
        def ce_inputs():
            logits = torch.randn(tokens, vocab, dtype=dtype, device=device, requires_grad=True)
            targets = torch.randint(0, vocab, (tokens,), device=device)
            return (logits, targets), None

        cases.append(dict(name="cross_entropy", shape=f"{tokens}x{vocab}", make=ce_inputs,
                          bytes_fwd=tokens * vocab * es, bytes_fwdbwd=2 * tokens * vocab * es,
                          eager=lambda x, t: cross_entropy_reference(x, t),
                          fused=lambda x, t: _fused("cross_entropy").cross_entropy(x, t),
                          liger=_liger_cross_entropy(), peak_memory=True))
    return cases


def _fused(module: str):
    import importlib

    return importlib.import_module(f"kernels.{module}")


def _liger(path: str, name: str):
    try:
        import importlib

        return getattr(importlib.import_module(path), name)
    except Exception:  # liger-kernel is optional
        return None


def _liger_norm(class_name: str, hidden, eps: float, dtype, device):
    """liger's norm module ``class_name`` as ``f(x, w, b)`` (its own weights), or None."""
    cls = _liger("liger_kernel.transformers", class_name)
    if cls is None:
        return None
    mod = cls(hidden, eps=eps).to(device=device, dtype=dtype)
    return lambda x, w, b: mod(x)


def _liger_swiglu():
    fn = _liger("liger_kernel.ops.swiglu", "LigerSiLUMulFunction")
    return None if fn is None else (lambda a, b: fn.apply(a, b))


def _liger_rope():
    fn = _liger("liger_kernel.transformers", "liger_rotary_pos_emb")
    if fn is None:
        return None

    def run(q, k, cos, sin):  # liger wants [b, h, s, d] and full-width [1, s, d] tables
        c, s = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
        return fn(q.transpose(1, 2), k.transpose(1, 2), c, s)

    return run


def _liger_cross_entropy():
    cls = _liger("liger_kernel.transformers", "LigerCrossEntropyLoss")
    if cls is None:
        return None
    loss = cls()
    return lambda x, t: loss(x, t)


# ---- measuring one implementation ------------------------------------------------------
def _outputs_sum(out, grad_out) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    if grad_out is not None:
        return (outs[0] * grad_out).sum()
    return sum(o.float().sum() for o in outs)


def measure(case: dict, impl: Callable, cuda: bool, reps: int, warmup: int) -> dict:
    inputs, grad_out = case["make"]()
    differentiable = case.get("differentiable", True)
    fwd = lambda: impl(*inputs)  # noqa: E731
    row: dict[str, Any] = {"fwd_ms": median_ms(fwd, reps, warmup, cuda)}
    if differentiable:
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

        def fwd_bwd():
            torch.autograd.grad(_outputs_sum(impl(*inputs), grad_out), leaves, allow_unused=True)

        row["fwdbwd_ms"] = median_ms(fwd_bwd, reps, warmup, cuda)
        if case.get("peak_memory") and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            torch.cuda.synchronize()
            row["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    for key, nbytes in (("fwd", case["bytes_fwd"]), ("fwdbwd", case.get("bytes_fwdbwd"))):
        if nbytes and f"{key}_ms" in row:
            row[f"{key}_gbs"] = nbytes / (row[f"{key}_ms"] * 1e-3) / 1e9
    del inputs, grad_out
    return row


def run_gpu(args: argparse.Namespace) -> dict:
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    copy_gbs = copy_bandwidth_gbs(device)
    shapes = [(t, h, None) for t, h in GPU_TOKENS_HIDDEN] + [(t, None, v) for t, v in GPU_CE]
    if args.quick:
        shapes = [(4096, 4096, None), (4096, None, 128256)]
    results = []
    for tokens, hidden, vocab in shapes:
        for case in op_cases(tokens, hidden or 0, vocab, dtype, device):
            impls = {"fused": case["fused"], "eager": case["eager"], "liger": case.get("liger")}
            if not args.no_compile:
                impls["compile"] = torch.compile(case["eager"], dynamic=False)
            for impl_name, impl in impls.items():
                if impl is None:
                    continue
                entry = {"op": case["name"], "shape": case["shape"], "impl": impl_name}
                try:
                    entry.update(measure(case, impl, True, args.reps, args.warmup))
                    for key in ("fwd", "fwdbwd"):
                        if f"{key}_gbs" in entry:
                            entry[f"{key}_frac_copy"] = entry[f"{key}_gbs"] / copy_gbs
                except Exception as exc:  # one failing variant must not stop the table
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
                torch.cuda.empty_cache()
                results.append(entry)
    _add_targets(results)
    return {"device": torch.cuda.get_device_name(), "gpu": True, "dtype": args.dtype,
            "copy_bandwidth_gbs": copy_gbs, "results": results}


def _add_targets(results: list[dict]) -> None:
    eager_peak = {(r["op"], r["shape"]): r.get("peak_extra_mib") for r in results if r["impl"] == "eager"}
    for r in results:
        if r["impl"] != "fused" or "error" in r:
            continue
        if r["op"] in ("rms_norm", "layer_norm", "swiglu"):
            r["meets_bandwidth_target"] = min(r.get("fwd_frac_copy", 0), r.get("fwdbwd_frac_copy", 0)) >= NORM_TARGET
        base = eager_peak.get((r["op"], r["shape"]))
        if "peak_extra_mib" in r and base:
            r["peak_vs_eager"] = r["peak_extra_mib"] / base
            r["meets_memory_target"] = r["peak_vs_eager"] <= CE_MEMORY_TARGET


def run_cpu(args: argparse.Namespace) -> dict:
    print("no CUDA GPU here: the Triton kernels are not timed (tests run them in the Triton interpreter); "
          "timing the torch reference ops on small CPU shapes as a sanity check.")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    results = []
    for tokens, hidden, vocab in ((256, 512, None), (256, None, 8192)):
        for case in op_cases(tokens, hidden or 0, vocab, torch.float32, torch.device("cpu")):
            entry = {"op": case["name"], "shape": case["shape"], "impl": "eager"}
            entry.update(measure(case, case["eager"], False, reps=5, warmup=1))
            results.append(entry)
    return {"device": platform.processor() or "cpu", "gpu": False, "dtype": "float32", "results": results}


def print_table(report: dict) -> None:
    cols = ["op", "shape", "impl", "fwd_ms", "fwdbwd_ms", "fwd_gbs", "fwdbwd_gbs", "fwd_frac_copy",
            "fwdbwd_frac_copy", "peak_extra_mib", "peak_vs_eager", "error"]
    present = [c for c in cols if any(c in r for r in report["results"])]
    rows = [[_fmt(r.get(c)) for c in present] for r in report["results"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(present)]
    print(f"device: {report['device']} (gpu={report['gpu']}, dtype={report['dtype']})"
          + (f", copy bandwidth {report['copy_bandwidth_gbs']:.0f} GB/s" if report.get("copy_bandwidth_gbs") else ""))
    print("  ".join(c.ljust(w) for c, w in zip(present, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/kernels.json")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one small shape per family (GPU smoke run)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = parser.parse_args(argv)
    report = run_gpu(args) if torch.cuda.is_available() else run_cpu(args)
    report["torch"] = torch.__version__
    print_table(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
