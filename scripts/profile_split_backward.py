"""In-process profile of the zero-bubble split backward: B, W and B + W against one full backward.

One pipeline chunk of parallel3d's GPT (the shapes of ``bench_pipeline.py``: ``gpt_tiny``,
hidden 128, 4 heads, seq 64, micro-batch 2; by default a middle stage of pp 4, i.e. layers
2-3 of 8) runs, alternating sample by sample, (a) forward + one ``torch.autograd.backward``
and (b) forward + ``split_backward`` (``B``) + the returned work's ``run`` (``W``), exactly as
the pipeline engine does. Only the backward parts are timed, in this thread's CPU time (CPU
autograd runs on the calling thread; preemption on a busy machine does not count) and in
wall time. Prints per-phase medians and ``(B+W)/full`` as the median of per-round ratios.

    .venv/bin/python scripts/profile_split_backward.py --hidden 128 --rounds 40

One thread (as the benchmark's ranks). ``--profile`` adds torch's profiler table for one B + W;
``--variants`` instead attributes the split's cost to W's queue order and W's graph reuse:

    .venv/bin/python scripts/profile_split_backward.py --hidden 128 --rounds 40 --variants

``--breakdown`` times the weight-gradient GEMMs inside both and splits the excess (B against the
full backward less its GEMMs; W outside its GEMMs). ``--w-paths`` pairs the full backward with B + W
accumulating through autograd's one-node graph (``direct=False``, before 2026-12-06) and without it
(``parallel3d.leaf_grads``, now), in one process, sample by sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def _setup(args):
    from models import build_model, get_config
    from parallel3d.deferred_grads import backward_inputs
    from parallel3d.parallel_state import ParallelState
    from parallel3d.topology import Topology

    cfg = get_config("gpt_tiny", num_layers=args.layers, hidden_size=args.hidden, num_heads=4,
                     vocab_size=args.vocab, max_seq_len=args.seq, fused_kernels=False)
    pstate = ParallelState(Topology())
    a, b = args.layer_range
    chunk = build_model(cfg, pstate, seed=0, layer_range=(a, b), pre_process=False, post_process=args.last)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.mbs, args.seq, args.hidden, generator=gen)
    grad = torch.randn(args.mbs, args.seq, args.hidden, generator=gen)
    if args.last:
        labels = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=gen)
        chunk, grad = _LastChunk(chunk, labels), None
    return chunk, pstate, x, grad, backward_inputs(chunk.parameters())


class _LastChunk(torch.nn.Module):
    """The last pipeline stage as the engine runs it (``--last``): final norm, tied head and the mean
    token loss, scaled as the engine scales it; its backward starts from the scalar (no output gradient)."""

    def __init__(self, chunk: torch.nn.Module, labels: torch.Tensor, microbatches: int = 8) -> None:
        super().__init__()
        self.chunk, self.labels, self.factor = chunk, labels, 1.0 / microbatches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x, self.labels) * self.factor


def _clock() -> tuple[float, float]:
    return time.thread_time(), time.perf_counter()


def _variants(args, chunk, pstate, x, grad, undeferred) -> None:
    """``--variants``: one process, paired per round: the full backward against B + W with W's queue
    first in, first out (the order before 2026-12-06) or last in, first out (now), W's graph
    built per W (before) or kept for the step (now), and (``lifo_kept_held``) every queued layer's
    tensors held until W's end (before) instead of freed as each layer's GEMMs ran (now). Prints
    (B+W)/full per variant, median and quartiles over rounds of the per-round ratio of medians."""
    from parallel3d.deferred_grads import _Anchors
    from parallel3d.pipeline.backward_split import split_backward

    deferral = pstate.weight_grads
    anchors = {"fifo_fresh": _Anchors(0), "lifo_fresh": _Anchors(0), "fifo_kept": _Anchors(8),
               "lifo_kept_held": _Anchors(8), "lifo_kept": _Anchors(8)}
    for name, a in anchors.items():
        a.keep = "kept" in name
    modes = ["full", *anchors]
    clock = time.thread_time
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.warmup + args.rounds):
        got: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(args.reps * len(modes)):
            mode = modes[(i + r) % len(modes)]
            chunk.zero_grad(set_to_none=True)
            inp = x.detach().clone().requires_grad_(True)
            out = chunk(inp)
            start = clock()
            if mode == "full":
                torch.autograd.backward(out, grad_tensors=grad)
            else:
                deferral._anchors = anchors[mode]
                _, work = split_backward(out, grad, inp, deferral, undeferred)
                del out
                if mode.startswith("fifo"):
                    work._queue.reverse()  # run() takes from the end: first in, first out
                # held: every closure (its layer's input and output gradient) kept until W ends, as
                # before W freed each as soon as its GEMMs ran
                held = list(work._queue) if mode.endswith("held") else None
                work.run()
                del held
            got[mode].append(clock() - start)
        if r >= args.warmup:
            base = statistics.median(got["full"])
            for m in modes:
                ratios[m].append(statistics.median(got[m]) / base)
    print(f"hidden {args.hidden}, layers {args.layer_range} of {args.layers}: (B+W)/full, CPU time, "
          f"{args.rounds} rounds x {args.reps} samples per variant")
    for m in modes:
        q = statistics.quantiles(ratios[m], n=4)
        print(f"  {m:11s} {statistics.median(ratios[m]):.3f}  [q1 {q[0]:.3f} q3 {q[2]:.3f}]")


def _w_paths(args, chunk, pstate, x, grad, undeferred) -> None:
    """``--w-paths``: per round, alternating sample by sample, the full backward, B + W through W's
    one-node autograd graph (kept for the step, as the engine does) and B + W without autograd; thread
    CPU time. Prints each path's median B, W, (B+W)/full (median over rounds of per-round ratios of
    medians) and W(direct)/W(graph)."""
    from parallel3d.pipeline.backward_split import split_backward

    deferral = pstate.weight_grads
    clock = time.thread_time
    modes = ("full", "graph", "direct")
    b_all: dict[str, list[float]] = {m: [] for m in modes[1:]}
    w_all: dict[str, list[float]] = {m: [] for m in modes[1:]}
    ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}
    w_ratio: list[float] = []
    for r in range(args.warmup + args.rounds):
        got: dict[str, list] = {m: [] for m in modes}
        with deferral.reusing_graphs():
            for i in range(args.reps * len(modes)):
                mode = modes[(i + r) % len(modes)]
                chunk.zero_grad(set_to_none=True)
                inp = x.detach().clone().requires_grad_(True)
                out = chunk(inp)
                t0 = clock()
                if mode == "full":
                    torch.autograd.backward(out, grad_tensors=grad)
                    got[mode].append((clock() - t0, 0.0))
                    continue
                deferral.direct = mode == "direct"
                _, work = split_backward(out, grad, inp, deferral, undeferred)
                del out
                t1 = clock()
                work.run()
                got[mode].append((t1 - t0, clock() - t1))
        deferral.direct = True
        if r < args.warmup:
            continue
        full = statistics.median(s[0] for s in got["full"])
        w_med = {}
        for m in modes[1:]:
            b, w = (statistics.median(s[k] for s in got[m]) for k in (0, 1))
            b_all[m].append(b)
            w_all[m].append(w)
            w_med[m] = w
            ratios[m].append((b + w) / full)
        w_ratio.append(w_med["direct"] / w_med["graph"])
    print(f"hidden {args.hidden}, layers {args.layer_range} of {args.layers}: thread CPU us, {args.rounds} rounds x "
          f"{args.reps} samples per path, alternating")
    for m in modes[1:]:
        q = statistics.quantiles(ratios[m], n=4)
        print(f"  W {m:6s}  B {1e6 * statistics.median(b_all[m]):8.0f}  W {1e6 * statistics.median(w_all[m]):8.0f}  "
              f"(B+W)/full {statistics.median(ratios[m]):.3f} [q1 {q[0]:.3f} q3 {q[2]:.3f}]")
    q = statistics.quantiles(w_ratio, n=4)
    print(f"  W direct / W graph {statistics.median(w_ratio):.3f} [q1 {q[0]:.3f} q3 {q[2]:.3f}]")


def _breakdown(args, chunk, pstate, x, grad, undeferred) -> None:
    """``--breakdown``: where B + W's excess over one backward sits, paired sample by sample (thread CPU
    time): the weight-gradient GEMMs (``linear_weight_grads``, timed inside the full backward and
    inside W), B against the full backward less its GEMMs, and W outside its GEMMs (the accumulation,
    freeing what the queue held, Python; autograd's entry into W's one-node graph with ``direct=False``)."""
    import parallel3d.tensor_parallel.deferrable_linear as dl
    from parallel3d.pipeline.backward_split import split_backward

    clock = time.thread_time
    in_gemms = [0.0]
    gemms = dl.linear_weight_grads

    def timed(*a):
        t0 = clock()
        try:
            return gemms(*a)
        finally:
            in_gemms[0] += clock() - t0

    full: list[tuple[float, float]] = []
    split: list[tuple[float, float, float]] = []
    dl.linear_weight_grads = timed
    try:
        with pstate.weight_grads.reusing_graphs():
            for r in range(args.warmup + args.rounds * args.reps):
                for mode in (("full", "split") if r % 2 else ("split", "full")):
                    chunk.zero_grad(set_to_none=True)
                    inp = x.detach().clone().requires_grad_(True)
                    out = chunk(inp)
                    in_gemms[0] = 0.0
                    t0 = clock()
                    if mode == "full":
                        torch.autograd.backward(out, grad_tensors=grad)
                        sample: tuple = (in_gemms[0], clock() - t0)
                    else:
                        _, work = split_backward(out, grad, inp, pstate.weight_grads, undeferred)
                        del out
                        t1 = clock()
                        work.run()
                        sample = (in_gemms[0], t1 - t0, clock() - t1)
                    if r >= args.warmup:
                        (full if mode == "full" else split).append(sample)
    finally:
        dl.linear_weight_grads = gemms

    def med(rows: list, i: int) -> float:
        return 1e6 * statistics.median(row[i] for row in rows)

    f_g, f, s_g, b, w = med(full, 0), med(full, 1), med(split, 0), med(split, 1), med(split, 2)
    print(f"hidden {args.hidden}, layers {args.layer_range} of {args.layers}; medians of {len(full)} paired samples, "
          f"thread CPU us")
    print(f"  full backward {f:8.0f}   its weight GEMMs {f_g:8.0f}   the rest {f - f_g:8.0f}")
    print(f"  B             {b:8.0f}   B / (full - its GEMMs) {b / (f - f_g):.3f}")
    print(f"  W             {w:8.0f}   its weight GEMMs {s_g:8.0f} ({s_g / f_g:.3f} of full's)   W outside them {w - s_g:8.0f}")
    print(f"  (B + W) / full {(b + w) / f:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-range", type=int, nargs=2, default=[2, 4], help="the chunk's layers [a, b)")
    ap.add_argument("--last", action="store_true",
                    help="the chunk is a last stage: final norm, tied LM head and loss (pass --layer-range a L)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5, help="samples of each kind per round (alternating)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured rounds")
    ap.add_argument("--fresh-graphs", action="store_true",
                    help="build W's graph every time (no reusing_graphs), as before the engine kept them per step")
    ap.add_argument("--variants", action="store_true",
                    help="instead: W's queue order (fifo/lifo) x W's graph (fresh/kept), paired in this process")
    ap.add_argument("--breakdown", action="store_true",
                    help="instead: B + W's excess split into GEMMs, B's rest and W outside its GEMMs (paired)")
    ap.add_argument("--w-paths", action="store_true",
                    help="instead: B + W with W through autograd's graph vs without autograd (paired)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table for one B + W")
    ap.add_argument("--out", default=None, help="write the samples as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    from parallel3d.pipeline.backward_split import split_backward

    chunk, pstate, x, grad, undeferred = _setup(args)
    if args.variants:
        _variants(args, chunk, pstate, x, grad, undeferred)
        return
    if args.breakdown:
        _breakdown(args, chunk, pstate, x, grad, undeferred)
        return
    if args.w_paths:
        _w_paths(args, chunk, pstate, x, grad, undeferred)
        return

    def forward():
        inp = x.detach().clone().requires_grad_(True)
        return inp, chunk(inp)

    def full() -> tuple[float, float]:
        chunk.zero_grad(set_to_none=True)
        inp, out = forward()
        c0 = _clock()
        torch.autograd.backward(out, grad_tensors=grad)
        c1 = _clock()
        return c1[0] - c0[0], c1[1] - c0[1]

    def split() -> tuple[tuple[float, float], tuple[float, float]]:
        chunk.zero_grad(set_to_none=True)
        inp, out = forward()
        c0 = _clock()
        _, work = split_backward(out, grad, inp, pstate.weight_grads, undeferred)
        del out
        c1 = _clock()
        work.run()
        c2 = _clock()
        return (c1[0] - c0[0], c1[1] - c0[1]), (c2[0] - c1[0], c2[1] - c1[1])

    samples: dict[str, list[float]] = {k: [] for k in ("full_cpu", "b_cpu", "w_cpu", "full_wall", "b_wall", "w_wall")}
    ratios_cpu, ratios_wall = [], []
    deferral = pstate.weight_grads
    # A round is one engine step: the engine keeps each chunk's W graph for the step (reusing_graphs).
    reuse = getattr(deferral, "reusing_graphs", None)
    for r in range(args.warmup + args.rounds):
        fc, fw, bc, bw, wc, ww = [], [], [], [], [], []
        step = reuse() if reuse is not None and not args.fresh_graphs else contextlib.nullcontext()
        with step:
            samples_round = [full() if (i + r) % 2 == 0 else split() for i in range(2 * args.reps)]
        for i, got in enumerate(samples_round):
            if (i + r) % 2 == 0:
                c, w = got
                fc.append(c)
                fw.append(w)
            else:
                (b_c, b_w), (w_c, w_w) = got
                bc.append(b_c)
                bw.append(b_w)
                wc.append(w_c)
                ww.append(w_w)
        if r < args.warmup:
            continue
        for key, vals in (("full_cpu", fc), ("b_cpu", bc), ("w_cpu", wc), ("full_wall", fw), ("b_wall", bw),
                          ("w_wall", ww)):
            samples[key].extend(vals)
        ratios_cpu.append((statistics.median(bc) + statistics.median(wc)) / statistics.median(fc))
        ratios_wall.append((statistics.median(bw) + statistics.median(ww)) / statistics.median(fw))
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"chunk layers {args.layer_range} of {args.layers}, hidden {args.hidden}, seq {args.seq}, mbs {args.mbs}; "
          f"{args.rounds} rounds x {args.reps} alternating samples each")
    print(f"{'':6} {'full us':>8} {'B us':>8} {'W us':>8} {'B+W us':>8} {'(B+W)/full':>10} {'range over rounds':>20}")
    for kind, ratios in (("cpu", ratios_cpu), ("wall", ratios_wall)):
        f, b, w = med[f"full_{kind}"], med[f"b_{kind}"], med[f"w_{kind}"]
        qs = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{kind:6} {1e6 * f:8.1f} {1e6 * b:8.1f} {1e6 * w:8.1f} {1e6 * (b + w):8.1f} "
              f"{statistics.median(ratios):10.3f}   q1 {qs[0]:.3f} q3 {qs[2]:.3f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            split()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if args.out:
        Path(args.out).write_text(json.dumps({"config": vars(args), "medians_s": med,
                                              "ratio_cpu": ratios_cpu, "ratio_wall": ratios_wall}, indent=2))


if __name__ == "__main__":
    main()
