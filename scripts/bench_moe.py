"""Benchmark our MoE layer at ep 1 / 2 / 4 against DeepSpeed-MoE at the same layout.

    .venv/bin/python scripts/bench_moe.py [--ep 1 2 4] [--batch 2] [--seq 256] [--hidden 512] [--ffn 1024]
        [--experts 8] [--top-k 2] [--rounds 3] [--steps 3] [--peers deepspeed] [--no-install] [--quick]
        [--out bench_results/moe.json]

One MoE layer (softmax top-k router, normalised top-k weights, dropless, SwiGLU experts, no
aux-loss training), forward + backward of ``(out * dout).sum()``, fp32, gloo, one thread per
rank. ep = the world: every rank holds ``experts / ep`` experts and its own ``batch x seq``
tokens (the token count per rank is fixed, so tokens/s counts every rank's tokens). Per ep
size, ``rounds`` rounds each launch our ranks once and DeepSpeed once
(``peer_deepspeed_moe.py`` under DeepSpeed's own environment, created on first use by
``peer_env.deepspeed_python``), the launch order alternating per round. A step's time is the
slowest rank's; a round gives the median over ``steps``; the table gives min / median / max
over rounds and the ratio to DeepSpeed paired within each round (median [min - max]).

Before any timing counts, the first round checks the numbers: both layers get the same
weights and tokens (``peer_deepspeed_moe.moe_weights`` / ``moe_tokens``), and each one's whole
output, input gradient, router gradient and expert ``w1`` gradients must match a float64
loop over experts computed here (fingerprints, ``--tolerance``); a mismatch exits 1.

Peak memory per rank: ``VmHWM`` read from outside the rank processes around one step
(``peer_env.PeakGate``). Dispatch vs compute: ours only, by phase
(``parallel3d.moe.bench.bench_dispatch_vs_experts``: route, dispatch, experts, combine; slowest
rank). CPU time per step (user + sys per rank, ``peer_env.timed_steps``), the load-robust measure: a
rank descheduled by other jobs or blocked in a collective adds wall time but no CPU time.
Target (met / not met): ours at least as fast as DeepSpeed-MoE at each ep (paired median <= 1).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from peer_deepspeed_moe import CHECKED, gather_fingerprints, moe_tokens, moe_weights  # noqa: E402
from peer_deepspeed_ulysses import fingerprint, fingerprint_mismatch  # noqa: E402
from peer_env import (deepspeed_python, free_port, run_peer, run_ranks, timed_steps,  # noqa: E402
                      write_results)

PHASES = ("route_s", "dispatch_s", "experts_s", "combine_s", "forward_backward_s")


def _worker(rank: int, world: int, args, gate) -> dict:
    """One rank under ``peer_env.run_ranks`` (which prepares the process and reports the result)."""
    import torch.distributed as dist

    from parallel3d.moe.bench import bench_dispatch_vs_experts
    from parallel3d.moe.layer import MoELayer
    from parallel3d.moe.options import MoEOptions

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    ep_group = dist.new_group(list(range(world))) if world > 1 else None
    options = MoEOptions(num_experts=args.experts, top_k=args.top_k, ffn_hidden=args.ffn, score_function="softmax",
                         normalize_topk=True, dispatcher=args.dispatcher)
    layer = MoELayer(options, args.hidden, global_name="moe", ep_group=ep_group)
    w = moe_weights(args.hidden, args.ffn, args.experts, args.seed)
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        for e, expert in layer.experts.items():
            for name in ("w1", "w2", "w3"):
                getattr(expert, name).copy_(w[name][int(e)])
    x, dout = moe_tokens(rank, args.batch, args.seq, args.hidden, args.seed)
    x.requires_grad_()

    def step() -> torch.Tensor:
        o = layer(x)
        (o * dout).sum().backward()
        layer.stats.reset()
        return o

    result: dict = {}
    if args.check:
        o = step()
        w1 = torch.stack([expert.w1.grad for expert in layer.experts.values()])
        result["fingerprints"] = gather_fingerprints(o.detach(), x.grad, layer.router.weight.grad, w1, world)
        del o, w1  # not held through the measured step
    layer.zero_grad(set_to_none=True)
    x.grad = None
    gate.measure(step)
    def clear() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None

    cpu: list[float] = []
    times = timed_steps(step, args.steps, args.warmup, clear, cpu)
    result["median_ms"] = statistics.median(times)
    result["cpu_ms"] = statistics.median(cpu)
    phases = bench_dispatch_vs_experts(layer, x.detach(), steps=args.steps, warmup=args.warmup)
    slowest = torch.tensor([phases[p] for p in PHASES], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    result["phases_ms"] = {p.removesuffix("_s"): 1e3 * float(t) for p, t in zip(PHASES, slowest)}
    return result


def reference_fingerprints(args, world: int) -> dict[str, list[float]]:
    """A float64 loop over experts on every rank's tokens: the independent oracle for both layers."""
    w = {k: v.double().requires_grad_() for k, v in moe_weights(args.hidden, args.ffn, args.experts, args.seed).items()}
    pairs = [moe_tokens(r, args.batch, args.seq, args.hidden, args.seed) for r in range(world)]
    x = torch.cat([p[0] for p in pairs]).double().requires_grad_()
    dout = torch.cat([p[1] for p in pairs]).double()
    tokens = x.reshape(-1, args.hidden)
    scores = torch.softmax(tokens @ w["router"].T, dim=-1)
    top = scores.topk(args.top_k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for e in range(args.experts):
        rows, slot = (top.indices == e).nonzero(as_tuple=True)
        if rows.numel():
            t = tokens[rows]
            y = torch.nn.functional.silu(t @ w["w1"][e].T) * (t @ w["w3"][e].T) @ w["w2"][e].T
            out = out.index_add(0, rows, weights[rows, slot, None] * y)
    out = out.view_as(x)
    (out * dout).sum().backward()
    whole = {"out": out, "dx": x.grad, "d_router": w["router"].grad, "d_w1": w["w1"].grad}
    return {n: fingerprint(whole[n]) for n in CHECKED}


def _shape_args(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("batch", "seq", "hidden", "ffn", "experts", "top_k",
                                                                     "steps", "warmup", "seed")]


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "rounds": values}


def bench_ep_size(args, ep: int, ds_py: str | None) -> dict:
    reference = reference_fingerprints(args, ep)
    times: dict[str, list[float]] = {"ours": [], "deepspeed": []}
    cpu: dict[str, list[float]] = {"ours": [], "deepspeed": []}
    memory: dict[str, list[dict]] = {"ours": [], "deepspeed": []}
    phases: list[dict] = []
    checks: dict[str, float] = {}
    for r in range(args.rounds):
        order = ["ours", "deepspeed"] if r % 2 == 0 else ["deepspeed", "ours"]
        for who in order:
            check = r == 0
            if who == "ours":
                got, (mem,) = run_ranks(_worker, ep, free_port(), SimpleNamespace(**vars(args), check=check),
                                        measures=1)
                phases.append(got["phases_ms"])
            elif ds_py is not None:
                got = run_peer(ds_py, "peer_deepspeed_moe.py", [f"--ep={ep}", *_shape_args(args)]
                               + (["--check"] if check else []))
                mem = {k: got[k] for k in ("peak_rss_bytes", "peak_over_base_bytes")}
            else:
                continue
            times[who].append(got["median_ms"])
            cpu[who].append(got["cpu_ms"])
            memory[who].append(mem)
            if "fingerprints" in got:
                checks[who] = max(fingerprint_mismatch(got["fingerprints"][n], reference[n]) for n in CHECKED)
        print(f"[bench] ep={ep} round {r + 1}/{args.rounds} done", flush=True)
    tokens = ep * args.batch * args.seq
    rows = []
    for who in ("ours", "deepspeed"):
        if not times[who]:
            continue
        ratios = [a / b for a, b in zip(times["ours"], times["deepspeed"])] if who == "ours" else []
        cpu_ratios = [a / b for a, b in zip(cpu["ours"], cpu["deepspeed"])] if who == "ours" else []
        rows.append({"ep": ep, "impl": "ours" if who == "ours" else "deepspeed MoE", "step_ms": _spread(times[who]),
                     "tokens_per_s": tokens / (statistics.median(times[who]) / 1e3),
                     "vs_deepspeed": _spread(ratios) if ratios else None,
                     "cpu_ms_per_rank": _spread(cpu[who]),
                     "cpu_vs_deepspeed": _spread(cpu_ratios) if cpu_ratios else None,
                     "peak_rss_bytes": max(m["peak_rss_bytes"] for m in memory[who]),
                     "peak_over_base_bytes": max(m["peak_over_base_bytes"] for m in memory[who]),
                     "mismatch": checks[who]})
    split = {p: statistics.median(ph[p] for ph in phases) for p in phases[0]}
    split["dispatch_combine_over_experts"] = (split["dispatch"] + split["combine"]) / split["experts"]
    return {"ep": ep, "rows": rows, "phases_ms": split}


def report(results: list[dict], args) -> tuple[list[str], dict]:
    lines = [f"layer: hidden {args.hidden}, {args.experts} SwiGLU experts of width {args.ffn}, top-{args.top_k} softmax "
             f"(normalised), dropless, {args.batch}x{args.seq} tokens per rank, fp32, our dispatcher {args.dispatcher}; "
             f"{args.rounds} alternating rounds x {args.steps} steps (+{args.warmup} warm-up), gloo, 1 thread/rank, "
             f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} "
             f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)"]
    head = (f"{'ep':>2} {'implementation':<14} {'min ms':>8} {'median ms':>9} {'max ms':>8} {'tokens/s':>9} "
            f"{'x deepspeed [range]':>22} {'CPU ms/rank':>11} {'CPU x ds [range]':>22} {'peak RSS MiB':>12} "
            f"{'+step MiB':>9} {'mismatch':>9}")
    lines += [head, "-" * len(head)]
    targets = {}
    for res in results:
        for r in res["rows"]:
            t, vs = r["step_ms"], r["vs_deepspeed"]
            ratio = f"{vs['median']:.2f} [{vs['min']:.2f}-{vs['max']:.2f}]" if vs else "-"
            cv = r["cpu_vs_deepspeed"]
            cpu_ratio = f"{cv['median']:.2f} [{cv['min']:.2f}-{cv['max']:.2f}]" if cv else "-"
            lines.append(f"{r['ep']:>2} {r['impl']:<14} {t['min']:>8.2f} {t['median']:>9.2f} {t['max']:>8.2f} "
                         f"{r['tokens_per_s']:>9.0f} {ratio:>22} {r['cpu_ms_per_rank']['median']:>11.1f} "
                         f"{cpu_ratio:>22} {r['peak_rss_bytes'] / 2**20:>12.1f} "
                         f"{r['peak_over_base_bytes'] / 2**20:>9.1f} {r['mismatch']:>9.1e}")
            if vs:
                targets[f"vs_deepspeed_ep{r['ep']}"] = "met" if vs["median"] <= 1.0 else "NOT met"
    lines.append("mismatch: largest fingerprint difference from the float64 loop over experts (output, dx, router "
                 "and w1 gradients); CPU ms/rank: user+sys per step (getrusage), mean over ranks, median over "
                 "rounds; CPU x ds: that paired per round (median [min-max])")
    lines.append("")
    head = (f"{'ep':>2} {'route ms':>8} {'dispatch ms':>11} {'experts ms':>10} {'combine ms':>10} {'fwd+bwd ms':>10} "
            f"{'(dispatch+combine)/experts':>26}")
    lines += ["ours by phase (forward; slowest rank, median over rounds)", head, "-" * len(head)]
    for res in results:
        p = res["phases_ms"]
        lines.append(f"{res['ep']:>2} {p['route']:>8.2f} {p['dispatch']:>11.2f} {p['experts']:>10.2f} "
                     f"{p['combine']:>10.2f} {p['forward_backward']:>10.2f} {p['dispatch_combine_over_experts']:>26.2f}")
    lines.append("target (ours <= DeepSpeed-MoE, paired median): "
                 + (", ".join(f"{k} {v}" for k, v in targets.items()) or "DeepSpeed not run"))
    return lines, targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    for name, default in (("batch", 2), ("seq", 256), ("hidden", 512), ("ffn", 1024), ("experts", 8), ("top-k", 2),
                          ("rounds", 3), ("steps", 3), ("warmup", 1), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dispatcher", default="alltoall", choices=["alltoall", "allgather"])
    ap.add_argument("--tolerance", type=float, default=1e-4, help="largest fingerprint difference accepted")
    ap.add_argument("--peers", nargs="*", default=["deepspeed"], choices=["deepspeed"])
    ap.add_argument("--peer-venv", default=str(Path(__file__).resolve().parent.parent / ".cache/peers/deepspeed-venv"))
    ap.add_argument("--no-install", action="store_true", help="skip DeepSpeed if its environment is missing")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: ep 2, a tiny layer, 1 round of 1 step (every check still runs)")
    ap.add_argument("--out", default="bench_results/moe.json")
    args = ap.parse_args()
    if args.quick:
        args.ep, args.batch, args.seq, args.hidden, args.ffn = [2], 2, 16, 32, 64
        args.rounds, args.steps, args.warmup = 1, 1, 0
    for ep in args.ep:
        if args.experts % ep:
            ap.error(f"--experts={args.experts} must divide over ep={ep}")
    if args.top_k != 2 and "deepspeed" in args.peers:
        ap.error("--top-k: DeepSpeed-MoE normalises the top-k weights only for k=2; use --top-k 2 or --peers")
    ds_py = deepspeed_python(args.peer_venv, args.no_install) if "deepspeed" in args.peers else None
    results = [bench_ep_size(args, ep, ds_py) for ep in args.ep]
    lines, targets = report(results, args)
    print("\n".join(lines))
    write_results(args, results, targets, "ep")


if __name__ == "__main__":
    main()
