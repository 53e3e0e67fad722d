"""Benchmark ZeRO stages 0-3 and optimizer offload against torch DDP and FSDP2 on gloo/CPU ranks.

    python scripts/bench_zero.py [--dp 2 4] [--rounds 5] [--steps 4] [--out bench_results/zero.json]

Same model (a stack of Linear + LayerNorm + GELU blocks), batch and AdamW for every
method; each block is one unit for both stage 3 and FSDP2 (``fully_shard`` per block,
then the root). Methods are run alternating: ``rounds`` rounds of ``steps`` steps of
each method, so slow phases of the shared machine hit all of them; a method's time
is the median over rounds of its median step (forward + backward + optimizer step),
its ratio to a peer is taken per round (median and range reported).

Memory per rank, model states only (weights + gradients + optimizer state, on the
device; offloaded state shown apart): ours is ``ZeroOptimizer.memory_peak_bytes``
(the high-water mark inside the step, stage 3's gathered units and staging buckets
included) and ``memory_bytes`` after the step; torch's (DDP, FSDP2) is the sum of
parameter (local shard), gradient and optimizer-state storages after the backward,
which for FSDP2 misses the unsharded parameters it holds while a block computes
(not measurable from outside on CPU). Formulas (Ψ parameters, N = dp): fp32 DDP /
stage 0 16Ψ; stage 1 8Ψ + 8Ψ/N; stage 2 4Ψ + 12Ψ/N; stage 3 and FSDP2 16Ψ/N
(fp32: 4 + 4 + 8; bf16 with bf16 gradients: 2 + 2 + 12 bytes per parameter).
Offload moves the 8 (fp32) or 12 (bf16) optimizer bytes per shard element to host
memory (``cpu``) or disk (``disk``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.parallel_state import ParallelState  # noqa: E402
from parallel3d.topology import Topology  # noqa: E402
from parallel3d.zero import ZeroOptimizer  # noqa: E402

WIDTH, DEPTH, BATCH, LR = 512, 8, 32, 1e-3
BUCKET_MB = 1.0
# zeroN: ZeroOptimizer defaults (a true reduce-scatter per bucket: DDP's byte volume);
# zeroN_ar: reduce_scatter="auto", where gloo reduces each bucket with its faster all-reduce;
# zero3 / fsdp2_rs: parameters sharded and gathered per block (FSDP2's reshard_after_forward=True);
# fsdp2: FSDP2 keeping parameters whole from forward to backward; *_cpu / *_disk: offloaded state;
# *_bf16: bf16 parameters with bf16 gradient reduction (ZeRO's 16 bytes per parameter).
METHODS = ("ddp", "fsdp2", "fsdp2_rs", "zero0", "zero1", "zero1_ar", "zero2", "zero2_ar", "zero3", "zero3_ar",
           "zero2_cpu", "zero3_cpu", "zero3_disk", "fsdp2_rs_bf16", "zero3_bf16", "zero3_bf16_cpu")
PEERS = {"zero3": "fsdp2_rs", "zero3_ar": "fsdp2_rs", "zero3_bf16": "fsdp2_rs_bf16", "zero2_cpu": "zero2",
         "zero3_cpu": "zero3", "zero3_disk": "zero3", "zero3_bf16_cpu": "zero3_bf16"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.norm(self.fc(x)))


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(DEPTH)]).to(dtype)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "_local_tensor"):  # DTensor: this rank's shard
            t = t._local_tensor
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def formula_bytes(method: str, psi: int, n: int) -> float:
    """Device model-state bytes per rank (module doc); offload keeps weights + gradients on the device."""
    base = method.removesuffix("_cpu").removesuffix("_disk")
    offloaded = base != method
    bf16 = "bf16" in method
    w, g, k = (2, 2, 12) if bf16 else (4, 4, 8)
    k = 0 if offloaded else k
    stage = {"ddp": 0, "zero0": 0, "zero1": 1, "zero1_ar": 1, "zero2": 2, "zero2_ar": 2}.get(base.replace("_bf16", ""), 3)
    weights = w * psi if stage < 3 else w * psi / n
    grads = g * psi if stage < 2 else g * psi / n
    opt = k * psi if stage == 0 else k * psi / n
    return weights + grads + opt


class Runner:
    """One method on this rank: ``step()`` runs forward + backward + update; ``memory()`` its bytes."""

    def __init__(self, method: str, rank: int, n: int, offload_root: str) -> None:
        self.method = method
        bf16 = "bf16" in method
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.model = make_model(dtype)
        self.psi = sum(p.numel() for p in self.model.parameters())
        self.x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank)).to(dtype)
        self.zero = None
        if method == "ddp":
            self.model = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=BUCKET_MB,
                                                             gradient_as_bucket_view=True)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        elif method.startswith("fsdp2"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            reshard = "_rs" in method
            mp_policy = MixedPrecisionPolicy()
            if bf16:  # fp32 sharded parameters, bf16 compute and reduction (FSDP2's mixed precision)
                self.model = make_model(torch.float32)
                mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for block in self.model:
                fully_shard(block, reshard_after_forward=reshard, mp_policy=mp_policy)
            fully_shard(self.model, reshard_after_forward=reshard, mp_policy=mp_policy)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        else:
            ps = ParallelState(Topology(1, 1, n))
            parts = method.removeprefix("zero").split("_")
            offload = "cpu" if "cpu" in parts else "disk" if "disk" in parts else "none"
            self.zero = ZeroOptimizer(
                [self.model], ps, zero_stage=int(parts[0]), lr=LR, bucket_size_mb=BUCKET_MB,
                reduce_scatter="auto" if "ar" in parts else "reduce_scatter", precision="bf16" if bf16 else "fp32",
                grad_reduce_dtype="bf16" if bf16 else "fp32", offload=offload,
                offload_dir=os.path.join(offload_root, method) if offload == "disk" else None)
            self.opt = self.zero
        self.peak = self.after = self.offloaded = 0

    def step(self) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if self.zero is not None:
            self.zero.reset_memory_peak()
        self.model(self.x).float().pow(2).mean().backward()
        if self.zero is None:
            params = list(self.model.parameters())
            states = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
            self.peak = self.after = _storage_bytes(params + [p.grad for p in params] + states)
        self.opt.step()
        self.opt.zero_grad()
        elapsed = time.perf_counter() - t0
        if self.zero is not None:
            peak, now = self.zero.memory_peak_bytes(), self.zero.memory_bytes()
            device = ("model_weights", "gradients", "master_weights", "optimizer_moments", "buckets")
            self.peak = sum(peak[k] for k in device)
            self.after = sum(now[k] for k in device if k != "buckets")
            self.offloaded = now["offload_host"] + now["offload_disk"]
        return elapsed


def _worker(rank: int, n: int, port: int, rounds: int, steps: int, queue) -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=600))
    with tempfile.TemporaryDirectory(prefix=f"p3d-bench-offload-{rank}-") as root:
        runners = {m: Runner(m, rank, n, root) for m in METHODS}
        for runner in runners.values():  # warm-up (first steps allocate state, record stage-3 orders)
            runner.step()
            runner.step()
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for _ in range(rounds):
            for m, runner in runners.items():
                times[m].append(statistics.median(runner.step() for _ in range(steps)))
        out = {m: {"round_s": times[m], "peak_bytes": r.peak, "after_bytes": r.after, "offloaded_bytes": r.offloaded,
                   "params": r.psi} for m, r in runners.items()}
        for r in runners.values():
            if r.zero is not None:
                r.zero.close()
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="bench_results/zero.json")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for n in args.dp:
        queue = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, n, port, args.rounds, args.steps, queue)) for r in range(n)]
        for p in procs:
            p.start()
        result = queue.get()
        for p in procs:
            p.join()
        for method in METHODS:
            r = result[method]
            ratios = [a / b for a, b in zip(r["round_s"], result["ddp"]["round_s"])]
            peer = PEERS.get(method)
            peer_ratios = [a / b for a, b in zip(r["round_s"], result[peer]["round_s"])] if peer else []
            formula = formula_bytes(method, r["params"], n)
            rows.append({"dp": n, "method": method, "median_step_s": statistics.median(r["round_s"]),
                         "ratio_to_ddp": statistics.median(ratios), "peer": peer,
                         "ratio_to_peer": statistics.median(peer_ratios) if peer else None,
                         "ratio_to_peer_range": [min(peer_ratios), max(peer_ratios)] if peer else None,
                         "peak_bytes": r["peak_bytes"], "after_bytes": r["after_bytes"],
                         "offloaded_bytes": r["offloaded_bytes"], "formula_bytes": formula,
                         "after_vs_formula": r["after_bytes"] / formula, "peak_vs_formula": r["peak_bytes"] / formula,
                         "params": r["params"], "round_s": r["round_s"]})
    print(f"params: {rows[0]['params']:,} ({DEPTH} blocks of Linear {WIDTH}x{WIDTH} + LayerNorm), batch {BATCH}/rank, "
          f"bucket {BUCKET_MB} MiB, gloo/CPU, 1 thread/rank; {args.rounds} alternating rounds x {args.steps} steps")
    print(f"{'dp':>3} {'method':<15} {'step ms':>8} {'x DDP':>6} {'x peer (range)':>22} {'states MiB':>10} "
          f"{'peak MiB':>9} {'formula MiB':>11} {'after/formula':>13} {'offloaded MiB':>13}")
    for r in rows:
        peer = "" if r["peer"] is None else (f"{r['ratio_to_peer']:.2f} [{r['ratio_to_peer_range'][0]:.2f}-"
                                             f"{r['ratio_to_peer_range'][1]:.2f}] {r['peer']}")
        print(f"{r['dp']:>3} {r['method']:<15} {1000 * r['median_step_s']:>8.1f} {r['ratio_to_ddp']:>6.2f} {peer:>22} "
              f"{r['after_bytes'] / 2**20:>10.2f} {r['peak_bytes'] / 2**20:>9.2f} {r['formula_bytes'] / 2**20:>11.2f} "
              f"{r['after_vs_formula']:>13.3f} {r['offloaded_bytes'] / 2**20:>13.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {"width": WIDTH, "depth": DEPTH, "batch_per_rank": BATCH, "bucket_mb": BUCKET_MB,
                              "rounds": args.rounds, "steps": args.steps}, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
