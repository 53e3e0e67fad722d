"""DeepSpeed ZeRO-1 / ZeRO-2 on ``bench_zero.py``'s model: the peer it times.

Runs under the peer's own virtual environment (``bench_zero.py --peer-venv``, created
like ``bench_pipeline.py`` does; DeepSpeed is never a parallel3d dependency), with
``DS_ACCELERATOR=cpu`` and gloo. Same model (``make_model``: Linear + LayerNorm + GELU
blocks, seed 0), batch (``BATCH`` rows per rank, seeded by rank), loss and torch
AdamW (lr ``LR``) as ``bench_zero``'s methods, fp32; DeepSpeed's buckets are set to
``bench_zero``'s bucket size with its recommended ZeRO-2 options (contiguous gradients,
reduce-scatter, overlapped communication). Prints one JSON line: per stage, the
median step time (forward + ``engine.backward`` + ``engine.step``) of each measured
round on rank 0, and the bytes rank 0 sent per step by collective, counted at
``torch.distributed`` with parallel3d's ``comm`` conventions (all-reduce 2(n-1)/n,
all-gather / reduce-scatter / reduce (n-1)/n of the full tensor, broadcast 1x).

This module imports only torch at the top: ``bench_zero`` takes the model from here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
import traceback
from collections import defaultdict

import torch
import torch.nn as nn

from peer_env import rank_zero_result

WIDTH, DEPTH, BATCH, LR = 512, 8, 32, 1e-3
BUCKET_MB = 1.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.norm(self.fc(x)))


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(DEPTH)]).to(dtype)


def batch_for(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank)).to(dtype)


class ByteCounter:
    """Counts bytes handed to ``torch.distributed`` collectives (module doc) while ``on``."""

    OPS = {"all_reduce": 2.0, "reduce_scatter_tensor": 1.0, "all_gather_into_tensor": 1.0, "reduce": 1.0,
           "all_gather": 1.0, "reduce_scatter": 1.0, "broadcast": None}

    def __init__(self, world: int) -> None:
        import torch.distributed as dist

        self.world, self.on = world, False
        self.bytes: dict[str, float] = defaultdict(float)
        for name, factor in self.OPS.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, factor, original))

    def _wrap(self, name, factor, original):
        def counted(*args, **kwargs):
            if self.on:
                tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
                lists = [a for a in list(args) + list(kwargs.values()) if isinstance(a, (list, tuple))]
                if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
                    full = max(t.numel() * t.element_size() for t in tensors)
                elif name in ("all_gather", "reduce_scatter"):
                    full = sum(t.numel() * t.element_size() for ls in lists for t in ls if torch.is_tensor(t))
                else:
                    full = tensors[0].numel() * tensors[0].element_size() if tensors else 0
                n = self.world
                self.bytes[name] += full if factor is None else factor * full * (n - 1) / n
            return original(*args, **kwargs)

        return counted


def _worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1")
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        counter = ByteCounter(world)  # before DeepSpeed binds anything
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600))
        bucket = int(args.bucket_mb * 2**20) // 4
        engines = {}
        for stage in args.stages:
            model = make_model()
            config = {
                "train_batch_size": BATCH * world, "train_micro_batch_size_per_gpu": BATCH,
                "gradient_accumulation_steps": 1, "steps_per_print": 10**9, "wall_clock_breakdown": False,
                "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                      "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True},
            }
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            engines[stage], *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        x = batch_for(rank)

        def step(engine) -> float:
            dist.barrier()
            start = time.perf_counter()
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            return time.perf_counter() - start

        for engine in engines.values():  # warm-up: state allocation, op builds
            step(engine)
            step(engine)
        result = {f"deepspeed_zero{s}": {"round_s": [], "bytes_per_step": {}} for s in args.stages}
        for _ in range(args.rounds):
            for s, engine in engines.items():
                result[f"deepspeed_zero{s}"]["round_s"].append(statistics.median(step(engine)
                                                                                  for _ in range(args.steps)))
        for s, engine in engines.items():  # bytes of one step (not timed)
            counter.bytes.clear()
            counter.on = True
            step(engine)
            counter.on = False
            result[f"deepspeed_zero{s}"]["bytes_per_step"] = dict(counter.bytes)
        out.put((rank, "ok", result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=BUCKET_MB)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    print(json.dumps(rank_zero_result(_worker, args.dp, args.port, args)))


if __name__ == "__main__":
    main()
