"""DeepSpeed PipelineModule on parallel3d's GPT: the peer ``bench_pipeline.py`` times.

Runs under the peer's own virtual environment (``bench_pipeline.py`` creates it in
``.cache/peers/deepspeed-venv``; DeepSpeed is never a parallel3d dependency). Each
pipeline stage is one ``LayerSpec`` that builds the same chunk ``bench_pipeline`` gives
our engine (same partition, same init), so the peers compute the same model on the
same microbatches. Prints one JSON line: per measured step, the slowest rank's time
of ``engine.train_batch`` (which also runs DeepSpeed's optimizer step: plain SGD
here, a few hundred microseconds at these sizes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer_env import rank_zero_result  # noqa: E402


def _worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1")
    try:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch import nn

        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule

        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600))
        from models import build_model, get_config
        from parallel3d.parallel_state import ParallelState
        from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
        from parallel3d.topology import Topology

        pstate = ParallelState(Topology(tp=1, pp=world, dp=1))
        cfg = get_config("gpt_tiny", num_layers=args.layers, hidden_size=args.hidden, num_heads=4,
                         vocab_size=args.vocab, max_seq_len=args.seq, fused_kernels=False)
        ranges = partition_layers(cfg, world, 1)

        class Stage(nn.Module):
            def __init__(self, stage: int) -> None:
                super().__init__()
                (r,) = stage_layer_ranges(ranges, world, stage)
                self.chunk = build_model(cfg, pstate, seed=0, layer_range=r)

            def forward(self, x):
                return self.chunk(x)

        vocab = args.vocab

        def loss_fn(logits, target):
            return F.cross_entropy(logits.reshape(-1, vocab).float(), target.reshape(-1))

        module = PipelineModule([LayerSpec(Stage, s) for s in range(world)], num_stages=world,
                                partition_method="uniform", loss_fn=loss_fn, activation_checkpoint_interval=0)
        m = args.microbatches
        ds_config = {"train_batch_size": m * args.mbs, "train_micro_batch_size_per_gpu": args.mbs,
                     "gradient_accumulation_steps": m, "steps_per_print": 10**9, "wall_clock_breakdown": False,
                     "zero_optimization": {"stage": 0}}
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, args.vocab, (m * args.mbs, args.seq + 1), generator=gen)
        batches = [(ids[i * args.mbs:(i + 1) * args.mbs, :-1].contiguous(),
                    ids[i * args.mbs:(i + 1) * args.mbs, 1:].contiguous()) for i in range(m)]
        times, cpu_times = [], []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.train_batch(iter(batches))
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            # CPU seconds of the step summed over ranks (process time, gloo threads included), as the
            # bench's process-group systems report it: comparable across launches under other load.
            cpu = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            if step >= args.warmup:
                times.append(elapsed.item())
                cpu_times.append(cpu.item())
        out.put((rank, "ok", (times, cpu_times)))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("stages", 2), ("microbatches", 8), ("layers", 8), ("hidden", 128), ("seq", 64),
                          ("mbs", 2), ("vocab", 1024), ("steps", 3), ("warmup", 1)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    times, cpu_times = rank_zero_result(_worker, args.stages, args.port, args)
    print(json.dumps({"step_times_s": times, "cpu_times_s": cpu_times}))


if __name__ == "__main__":
    main()
