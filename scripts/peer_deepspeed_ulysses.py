"""DeepSpeed Ulysses (``deepspeed.sequence.layer.DistributedAttention``): the peer ``bench_cp.py`` times.

Runs under the peer's own virtual environment (``.cache/peers/deepspeed-venv``, created by
``peer_env.deepspeed_python``; DeepSpeed is never a parallel3d dependency), ``DS_ACCELERATOR=cpu``,
gloo, one thread per rank. One launch = one sequence-parallel size (the world). Each rank holds a
contiguous ``s / cp`` slice of the same whole ``q``, ``k``, ``v`` that ``bench_cp`` gives our
attention (``cp_inputs``: seeded, float32, ``[b, s, h, d]``); DeepSpeed's all-to-alls move it to
head shards (``scatter_idx=2``, ``gather_idx=1``, ``batch_dim_idx=0``) around a local causal
attention: torch's ``scaled_dot_product_attention`` (kv heads repeated for GQA), the CPU
attention a DeepSpeed user would pass. A step is forward + backward (``autograd.grad`` of the
output against a seeded ``dout``), like ``parallel3d.context_parallel.bench.bench_variants``.

Prints one JSON line: the median (over ``--steps``) of the slowest rank's step time and of the CPU
time per step averaged over the ranks (``cpu_ms``, what ``bench_cp`` pairs on a busy machine), the peak
resident memory around one step (``peer_env.PeakGate``, read from outside the ranks), and with
``--check`` the fingerprints (``fingerprint``) of the whole output and input gradients, which
``bench_cp`` compares with ours before it trusts a ratio.

This module imports only torch at the top: ``bench_cp`` takes ``cp_inputs`` and ``fingerprint`` from here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch

from peer_env import run_ranks, timed_steps

PROJECTIONS = 4


def cp_inputs(batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole-sequence q, k, v and dout (float32, ``[b, s, h, d]``) both implementations attend."""
    g = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (batch, seq, q_heads, head_dim), (batch, seq, kv_heads, head_dim)
    return {"q": torch.randn(shape_q, generator=g), "k": torch.randn(shape_kv, generator=g),
            "v": torch.randn(shape_kv, generator=g), "dout": torch.randn(shape_q, generator=g)}


def fingerprint(t: torch.Tensor, seed: int = 1234) -> list[float]:
    """``[norm, cos_1 .. cos_P]``: the float64 norm of ``t`` and its cosines with ``P`` seeded random
    tensors. Equal tensors give equal fingerprints up to rounding; any wrong value moves them."""
    x = t.detach().double().reshape(-1)
    g = torch.Generator().manual_seed(seed)
    norm = float(x.norm())
    out = [norm]
    for _ in range(PROJECTIONS):
        w = torch.randn(x.numel(), generator=g, dtype=torch.float64)
        out.append(float(x @ w) / (norm * float(w.norm()) + 1e-300))
    return out


def fingerprint_mismatch(a: list[float], b: list[float]) -> float:
    """Largest difference: relative for the norm, absolute for the cosines."""
    return max([abs(a[0] - b[0]) / max(abs(b[0]), 1e-30)] + [abs(x - y) for x, y in zip(a[1:], b[1:])])


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``[b, s, h, d]`` head shards (kv heads repeated for GQA)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True)
    return out.transpose(1, 2)


def _worker(rank: int, world: int, args, gate) -> dict:
    """One rank under ``peer_env.run_ranks`` (which prepares the process and reports the result)."""
    import torch.distributed as dist

    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600))
    group = dist.new_group(list(range(world)))
    attn = DistributedAttention(_local_attention, group, scatter_idx=2, gather_idx=1)
    full = cp_inputs(args.batch, args.seq, args.q_heads, args.kv_heads, args.head_dim, args.seed)
    share = args.seq // world
    q, k, v, dout = (full[n][:, rank * share:(rank + 1) * share].contiguous() for n in ("q", "k", "v", "dout"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    del full

    def step():
        o = attn(q, k, v, 0)
        return o, torch.autograd.grad(o, (q, k, v), dout)

    result: dict = {}
    if args.check:
        o, grads = step()
        whole = []
        for t in (o, *grads):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            whole.append(torch.cat(parts, dim=1))
        result["fingerprints"] = {n: fingerprint(t) for n, t in zip(("out", "dq", "dk", "dv"), whole)}
        del whole, o, grads
    gate.measure(step)
    cpu: list[float] = []
    times = timed_steps(step, args.steps, args.warmup, cpu_ms=cpu)
    result["median_ms"], result["cpu_ms"] = statistics.median(times), statistics.median(cpu)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, required=True)
    for name, default in (("batch", 1), ("seq", 2048), ("q-heads", 8), ("kv-heads", 4), ("head-dim", 64),
                          ("steps", 3), ("warmup", 1), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--check", action="store_true", help="fingerprints of the whole output and gradients")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    result, (memory,) = run_ranks(_worker, args.cp, args.port, args, measures=1)
    print(json.dumps({**result, **memory}))


if __name__ == "__main__":
    main()
