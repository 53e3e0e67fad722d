"""DeepSpeed-MoE (``deepspeed.moe.layer.MoE``): the peer ``bench_moe.py`` times.

Runs under the peer's own virtual environment (``.cache/peers/deepspeed-venv``, created by
``peer_env.deepspeed_python``; DeepSpeed is never a parallel3d dependency), ``DS_ACCELERATOR=cpu``,
gloo, one thread per rank. One launch = one expert-parallel size (the world; ``ep_size`` = world,
so every rank holds ``experts / ep`` experts and its own tokens, as ours at the same layout).

The same layer as ``bench_moe`` gives ours, with the same weights (``moe_weights``) and tokens
(``moe_tokens``): a softmax top-k router without bias, each expert a SwiGLU FFN
``w2 (silu(w1 x) * w3 x)``. DeepSpeed is set to compute that function: ``drop_tokens=False``
(dropless: its capacity is the largest expert load over the ep group), no noisy gate,
``top2_2nd_expert_sampling=False`` (else its second expert is drawn with Gumbel noise), top-k
weights normalised (its top-2 always divides by their sum; ``bench_moe`` sets ours alike). A
step is forward + backward of ``(out * dout).sum()`` (its aux loss is computed but, as ours
at coefficient 0, not trained on).

Prints one JSON line: the median (over ``--steps``) of the slowest rank's step time, the peak
resident memory around one step (``peer_env.PeakGate``), and with ``--check`` the fingerprints
of the whole output, input gradient, router gradient (summed over ranks) and ``w1`` gradients
(every expert, global order), which ``bench_moe`` compares with its float64 reference.

Imports only torch at the top: ``bench_moe`` takes ``moe_weights``, ``moe_tokens`` and
``gather_fingerprints`` from here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
from torch import nn

from peer_deepspeed_ulysses import fingerprint
from peer_env import run_ranks, timed_steps

CHECKED = ("out", "dx", "d_router", "d_w1")


def moe_weights(hidden: int, ffn: int, experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Router ``[E, h]`` and stacked expert weights ``w1``, ``w3`` ``[E, f, h]``, ``w2`` ``[E, h, f]`` (float32)."""
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(experts, hidden, generator=g) / hidden ** 0.5,
            "w1": torch.randn(experts, ffn, hidden, generator=g) / hidden ** 0.5,
            "w3": torch.randn(experts, ffn, hidden, generator=g) / hidden ** 0.5,
            "w2": torch.randn(experts, hidden, ffn, generator=g) / ffn ** 0.5}


def moe_tokens(rank: int, batch: int, seq: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens ``x`` and the output gradient ``dout`` (``[b, s, h]``, float32)."""
    g = torch.Generator().manual_seed(seed * 7919 + 1000 + rank)
    return torch.randn(batch, seq, hidden, generator=g), torch.randn(batch, seq, hidden, generator=g)


def gather_fingerprints(out: torch.Tensor, dx: torch.Tensor, d_router: torch.Tensor, d_w1_local: torch.Tensor,
                        world: int) -> dict[str, list[float]] | None:
    """Fingerprints of the tensors in ``CHECKED`` over all ranks (rank 0 gets them, others None):
    outputs and input gradients concatenated in rank order, router gradients summed, local experts'
    ``w1`` gradients ``[E/ep, f, h]`` concatenated in rank (= global expert) order."""
    import torch.distributed as dist

    whole = {}
    for name, t in (("out", out), ("dx", dx), ("d_w1", d_w1_local)):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        whole[name] = torch.cat(parts, dim=0)
    router = d_router.clone()
    dist.all_reduce(router)
    whole["d_router"] = router
    return {n: fingerprint(whole[n]) for n in CHECKED} if dist.get_rank() == 0 else None


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


def _worker(rank: int, world: int, args, gate) -> dict:
    """One rank under ``peer_env.run_ranks`` (which prepares the process and reports the result)."""
    import torch.distributed as dist

    import deepspeed
    from deepspeed.moe.layer import MoE

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600))
    moe = MoE(args.hidden, SwiGLU(args.hidden, args.ffn), num_experts=args.experts, ep_size=world, k=args.top_k,
              drop_tokens=False, noisy_gate_policy=None, use_rts=False, top2_2nd_expert_sampling=False)
    moe.set_deepspeed_parallelism()
    w = moe_weights(args.hidden, args.ffn, args.experts, args.seed)
    local = args.experts // world
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(w["router"])
        for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            for name in ("w1", "w2", "w3"):
                getattr(expert, name).weight.copy_(w[name][rank * local + i])
    x, dout = moe_tokens(rank, args.batch, args.seq, args.hidden, args.seed)
    x.requires_grad_()

    def step() -> torch.Tensor:
        o, _, _ = moe(x)
        (o * dout).sum().backward()
        return o

    result: dict = {}
    if args.check:
        o = step()
        w1 = torch.stack([e.w1.weight.grad for e in moe.deepspeed_moe.experts.deepspeed_experts])
        result["fingerprints"] = gather_fingerprints(o.detach(), x.grad, moe.deepspeed_moe.gate.wg.weight.grad,
                                                     w1, world)
        del o, w1  # not held through the measured step
    moe.zero_grad(set_to_none=True)
    x.grad = None
    gate.measure(step)
    def clear() -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None

    cpu: list[float] = []
    times = timed_steps(step, args.steps, args.warmup, clear, cpu)
    result["median_ms"] = statistics.median(times)
    result["cpu_ms"] = statistics.median(cpu)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, required=True)
    for name, default in (("batch", 2), ("seq", 512), ("hidden", 512), ("ffn", 1024), ("experts", 8), ("top-k", 2),
                          ("steps", 3), ("warmup", 1), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--check", action="store_true", help="fingerprints of the output and gradients")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    result, (memory,) = run_ranks(_worker, args.ep, args.port, args, measures=1)
    print(json.dumps({**result, **memory}))


if __name__ == "__main__":
    main()
