"""In-process: what a zero-bubble ``W``'s lag costs. One chunk, thread CPU time, (B + W) / one full backward.

Why: ``bench_pipeline.py``'s (B+W)/B at hidden 128 pp 4 rises with the stage's ``W`` lag (zb_h1's
lags 0 1 2 2: stage 0 ~1.01, 1 ~1.05, 2-3 ~1.07), while ``profile_split_backward.py`` (``W`` right
after its ``B``) says ~1.03. This separates the two in one process, no other rank: a step of ``m``
microbatches (the benchmark's chunk and shapes) runs as 1F1B does it (``F(i)``, then the full
backward of ``i``) or as a split stage with lag ``L`` does (``F(i)``, ``B(i)``, then ``W(i - L)``; the
last ``L`` ``W``s at the step's end), steps alternating; the backward work (full, or ``B`` + ``W``) is
summed per step in the calling thread's CPU time (CPU autograd runs there). With ``L`` > 0 a ``W``
runs after another microbatch's forward and backward, whose tensors have pushed its saved input and
output gradient out of the core's cache; 1F1B's weight GEMMs read an output gradient just computed.

    .venv/bin/python scripts/profile_w_lag.py --hidden 128 --lags 0 1 2 --rounds 30
    .venv/bin/python scripts/profile_w_lag.py --last    # the last stage (final norm, head, loss)

Prints per lag the median over rounds of (B+W)/full (each round: the median of 2 steps per mode)
and its quartiles, and the step's ``B``s and ``W``s apart (medians over steps: which one the lag slows). Gradients are the engine's (the split's are bitwise the full backward's: tests).

``--base DIR`` pairs this checkout's split path with another's in the same process (an A/B that the
machine's other load hits alike): DIR's ``leaf_grads``, ``deferred_grads`` and ``backward_split`` are
loaded beside this tree's (the model, its layers and everything else stay this tree's), its steps
alternate with this tree's, and each lag prints both and the per-round difference (this - base):

    .venv/bin/python scripts/profile_w_lag.py --rounds 150 --lags 0 2 --base /tmp/base-checkout
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from profile_split_backward import _setup  # noqa: E402


def _step(chunk, xs: list[torch.Tensor], grad, deferral, undeferred, lag: int | None,
          split_backward: Callable | None = None) -> tuple[float, float]:
    """One step over ``xs``; the CPU seconds summed over its ``B``s (1F1B: its full backwards) and its ``W``s.
    ``lag`` None: 1F1B's full backward. ``split_backward``: this tree's unless given (``--base``); the
    layers defer to the deferral they were built with (``pstate.weight_grads``): pass that one."""
    if split_backward is None:
        from parallel3d.pipeline.backward_split import split_backward

    clock = time.thread_time
    chunk.zero_grad(set_to_none=True)
    spent, in_w, pending = 0.0, 0.0, []
    for x in xs:
        inp = x.detach().clone().requires_grad_(True)
        out = chunk(inp)
        t0 = clock()
        if lag is None:
            torch.autograd.backward(out, grad_tensors=grad)
            del out  # the graph goes here, inside 1F1B's backward action (step_run)
            spent += clock() - t0
            continue
        _, work = split_backward(out, grad, inp, deferral, undeferred)
        del out
        spent += clock() - t0
        pending.append(work)
        if len(pending) > lag:
            t0 = clock()
            pending.pop(0).run()
            in_w += clock() - t0
    while pending:  # the cool-down's W
        t0 = clock()
        pending.pop(0).run()
        in_w += clock() - t0
    return spent, in_w


_SPLIT_PATH = ("parallel3d.leaf_grads", "parallel3d.deferred_grads", "parallel3d.pipeline.backward_split")


def _split_path_of(base: str) -> tuple[Any, Callable]:
    """Checkout ``base``'s ``WeightGradDeferral`` and ``split_backward``, its ``_SPLIT_PATH`` modules loaded
    beside this tree's (each one importing the previous from ``base``; the rest of ``parallel3d`` is this
    tree's, so a change outside those three modules is not what ``--base`` compares)."""
    saved = {name: sys.modules.get(name) for name in _SPLIT_PATH}
    loaded = {}
    try:
        for name in _SPLIT_PATH:
            spec = importlib.util.spec_from_file_location(name, Path(base, *name.split(".")).with_suffix(".py"))
            if spec is None or spec.loader is None:
                raise FileNotFoundError(f"{base}: no {name}")
            module = loaded[name] = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # what the next one imports
            spec.loader.exec_module(module)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return loaded[_SPLIT_PATH[1]].WeightGradDeferral, loaded[_SPLIT_PATH[2]].split_backward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-range", type=int, nargs=2, default=[2, 4], help="the chunk's layers [a, b)")
    ap.add_argument("--last", action="store_true", help="the last stage: final norm, tied head and the loss")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured rounds")
    ap.add_argument("--base", default=None, help="another checkout: pair its split path with this one's")
    args = ap.parse_args()
    if args.last and args.layer_range == [2, 4]:
        args.layer_range = [args.layers - 2, args.layers]
    torch.set_num_threads(1)  # as the benchmark's ranks
    chunk, pstate, x, grad, undeferred = _setup(args)
    gen = torch.Generator().manual_seed(1)
    xs = [x + 0.01 * torch.randn(x.shape, generator=gen) for _ in range(args.microbatches)]
    # A mode: (tree, lag); ("", None) is 1F1B's full backward. Trees: "this", and "base" with --base.
    paths = {"this": (pstate.weight_grads, None)}
    if args.base:
        deferral_class, split = _split_path_of(args.base)
        paths["base"] = (deferral_class(), split)
    modes: list[tuple[str, int | None]] = [("", None)] + [(t, lag) for lag in args.lags for t in paths]
    ratios: dict[tuple, list[float]] = {m: [] for m in modes[1:]}
    parts: dict[tuple, list[tuple[float, float]]] = {m: [] for m in modes}  # per step: B (or full), W
    rounds: dict[tuple, list[tuple[float, float]]] = {m: [] for m in modes}  # per round: B, W (medians)
    with contextlib.ExitStack() as steps:
        for deferral, _ in paths.values():  # as the engine's step (W's routes and graphs reused)
            steps.enter_context(deferral.reusing_graphs())
        for r in range(args.warmup + args.rounds):
            got: dict[tuple, list[tuple[float, float]]] = {m: [] for m in modes}
            for k in range(2 * len(modes)):
                mode = modes[(k + r) % len(modes)]
                deferral, split = paths[mode[0] or "this"]
                pstate.weight_grads = deferral  # the layers defer to it (each reads it at its forward)
                got[mode].append(_step(chunk, xs, grad, deferral, undeferred, mode[1], split))
            if r < args.warmup:
                continue
            for m in modes:
                parts[m].extend(got[m])
                rounds[m].append(tuple(statistics.median(x[i] for x in got[m]) for i in (0, 1)))
            full = statistics.median(sum(x) for x in got[modes[0]])
            for m in modes[1:]:
                ratios[m].append(statistics.median(sum(x) for x in got[m]) / full)
    print(f"hidden {args.hidden}, layers {args.layer_range} of {args.layers}{' (last stage)' if args.last else ''}, "
          f"m {args.microbatches}: (B+W)/full backward, thread CPU, {args.rounds} rounds")
    print(f"  full backward: {1e6 * statistics.median(b for b, _ in parts[modes[0]]):.0f} us per step")
    for m in modes[1:]:
        q = statistics.quantiles(ratios[m], n=4)
        b, w = (1e6 * statistics.median(x[i] for x in parts[m]) for i in (0, 1))
        print(f"  lag {m[1]}{' ' + m[0] if args.base else ''}: {statistics.median(ratios[m]):.3f}  [q1 {q[0]:.3f} "
              f"q3 {q[2]:.3f}]  B {b:.0f} us, W {w:.0f} us per step")
    for lag in args.lags if args.base else ():
        this, base = rounds[("this", lag)], rounds[("base", lag)]
        diffs = [[1e6 * (t[i] - u[i]) for t, u in zip(this, base)] for i in (0, 1)]
        diffs.append([b + w for b, w in zip(*diffs)])
        print(f"  lag {lag} this - base, median over rounds [q1 q3], us per step: " + ", ".join(
            f"{name} {statistics.median(d):+.0f} [{statistics.quantiles(d, n=4)[0]:+.0f} "
            f"{statistics.quantiles(d, n=4)[2]:+.0f}]" for name, d in zip(("B", "W", "B+W"), diffs)))


if __name__ == "__main__":
    main()
