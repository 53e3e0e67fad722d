"""Benchmark ZeRO stages 0/1/2 against torch DDP and FSDP2 on gloo/CPU ranks.

    python scripts/bench_zero.py [--dp 2 4] [--steps 10] [--out bench_results/zero.json]

Same model (an MLP stack), batch and AdamW for every method. Per method and dp:
median step time (forward + backward + optimizer step), its ratio to DDP, and the
optimizer + gradient bytes per rank measured by summing tensor storages (ours:
``ZeroOptimizer.memory_bytes``; torch: ``.grad`` and optimizer state tensors)
beside the ZeRO-paper formula (fp32: grads 4Ψ or 4Ψ/N, moments 8Ψ or 8Ψ/N, plus
the stage-2 staging buckets). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.parallel_state import ParallelState  # noqa: E402
from parallel3d.topology import Topology  # noqa: E402
from parallel3d.zero import ZeroOptimizer  # noqa: E402
from parallel3d.zero.grad_sync import MAX_STAGING_BUFFERS  # noqa: E402

WIDTH, DEPTH, BATCH, LR = 512, 8, 32, 1e-3
BUCKET_MB = 1.0
# zeroN: ZeroOptimizer defaults (a true reduce-scatter per bucket: DDP's byte volume);
# zeroN_ar: reduce_scatter="auto", where gloo reduces each bucket with its faster all-reduce.
METHODS = ("ddp", "fsdp2", "zero0", "zero1", "zero1_ar", "zero2", "zero2_ar")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "_local_tensor"):  # DTensor: this rank's shard
            t = t._local_tensor
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def formula_bytes(method: str, psi: int, n: int) -> int:
    """Gradient + optimizer bytes per rank in fp32 (parameters are the master weights)."""
    bucket = int(BUCKET_MB * 2**20)
    return {
        "ddp": 4 * psi + 8 * psi,
        "zero0": 4 * psi + 8 * psi,
        "zero1": 4 * psi + 8 * psi // n,
        "zero1_ar": 4 * psi + 8 * psi // n,
        "zero2": 4 * psi // n + 8 * psi // n + MAX_STAGING_BUFFERS * bucket,
        "zero2_ar": 4 * psi // n + 8 * psi // n + MAX_STAGING_BUFFERS * bucket,
        "fsdp2": 4 * psi // n + 8 * psi // n,
    }[method]


def _run_method(method: str, rank: int, n: int, steps: int) -> dict:
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    zero = None
    if method == "ddp":
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    elif method == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        ps = ParallelState(Topology(1, 1, n))
        stage, _, forced = method.removeprefix("zero").partition("_")
        zero = ZeroOptimizer([model], ps, zero_stage=int(stage), lr=LR, bucket_size_mb=BUCKET_MB,
                             reduce_scatter="auto" if forced == "ar" else "reduce_scatter")
        opt = zero
    times, mem = [], 0
    for step in range(steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        if zero is not None:
            mem = sum(v for k, v in zero.memory_bytes().items() if k != "model_weights")
        opt.step()
        if zero is None:
            params = list(model.parameters())
            grads = _storage_bytes([p.grad for p in params])
            states = _storage_bytes([t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
                                     and t.numel() > 1])
            mem = grads + states
        opt.zero_grad()
        if step >= 3:
            times.append(time.perf_counter() - t0)
    return {"median_step_s": statistics.median(times), "bytes": mem, "formula_bytes": formula_bytes(method, psi, n),
            "params": psi}


def _worker(rank: int, n: int, port: int, steps: int, queue) -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=300))
    out = {}
    for method in METHODS:
        out[method] = _run_method(method, rank, n, steps)
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="bench_results/zero.json")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for n in args.dp:
        queue = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, n, port, args.steps, queue)) for r in range(n)]
        for p in procs:
            p.start()
        result = queue.get()
        for p in procs:
            p.join()
        ddp = result["ddp"]["median_step_s"]
        for method in METHODS:
            r = result[method]
            rows.append({"dp": n, "method": method, **r, "ratio_to_ddp": r["median_step_s"] / ddp,
                         "bytes_vs_formula": r["bytes"] / r["formula_bytes"]})
    header = f"{'dp':>3} {'method':<8} {'median step ms':>15} {'x DDP':>6} {'grad+optim MiB':>15} {'formula MiB':>12} {'meas/formula':>13}"
    print(f"params: {rows[0]['params']:,} (fp32), batch {BATCH}/rank, bucket {BUCKET_MB} MiB, gloo/CPU, 1 thread/rank")
    print(header)
    for r in rows:
        print(f"{r['dp']:>3} {r['method']:<8} {1000 * r['median_step_s']:>15.1f} {r['ratio_to_ddp']:>6.2f} "
              f"{r['bytes'] / 2**20:>15.2f} {r['formula_bytes'] / 2**20:>12.2f} {r['bytes_vs_formula']:>13.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {"width": WIDTH, "depth": DEPTH, "batch_per_rank": BATCH, "bucket_mb": BUCKET_MB,
                              "steps": args.steps}, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
