"""Paired CPU cost of the engine's activation accounting: ``run_step(account_activations=True)``
vs ``False`` on the same engine, steps alternating (ABBA), 1f1b at pp 2 on 2 gloo ranks.

    PYTHONPATH=. python scripts/bench_activation_accounting.py --microbatches 16 --mbs 1

Each rank reports its thread CPU seconds per step (a busy machine's preemption does not count)
and the median of the paired on/off ratios. The model is bench_pipeline's GPT (``gpt_tiny``
resized by the flags).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from models import build_model, get_config
    from parallel3d.parallel_state import ParallelState
    from parallel3d.pipeline.engine import PipelineEngine
    from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
    from parallel3d.topology import Topology

    pstate = ParallelState(Topology(tp=1, pp=2, dp=1))
    cfg = get_config("gpt_tiny", num_layers=args.layers, hidden_size=args.hidden, num_heads=4,
                     vocab_size=args.vocab, max_seq_len=args.seq, fused_kernels=False)
    chunks = [build_model(cfg, pstate, seed=0, layer_range=r)
              for r in stage_layer_ranges(partition_layers(cfg, 2, 1), 2, pstate.coord("pp"))]
    m, mbs = args.microbatches, args.mbs
    engine = PipelineEngine(chunks, pstate, schedule="1f1b", num_microbatches=m, micro_batch_size=mbs,
                            seq_len=args.seq, hidden_size=cfg.hidden_size)
    gen = torch.Generator().manual_seed(0)
    batch = []
    for i in range(m):
        ids = torch.randint(0, args.vocab, (mbs, args.seq + 1), generator=gen)
        batch.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
                      "sample_ids": torch.arange(i * mbs, (i + 1) * mbs)})
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.warmup + 2 * args.pairs):
        account = (i % 4) in (0, 3)  # ABBA: a drift in load hits both alike
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.thread_time()
        engine.run_step(batch, account_activations=account)
        if i >= args.warmup:
            cpu[account].append(time.thread_time() - start)
    queue.put((rank, cpu))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--port", type=int, default=29731)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"pp 2, 1f1b, m={args.microbatches}, micro-batch {args.mbs}, layers {args.layers}, hidden {args.hidden}, "
          f"seq {args.seq}; {args.pairs} pairs")
    for rank, cpu in sorted(results.items()):
        on, off = cpu[True], cpu[False]
        ratio = statistics.median(a / b for a, b in zip(on, off))
        print(f"rank {rank}: CPU/step median accounting on {1e3 * statistics.median(on):.2f} ms, "
              f"off {1e3 * statistics.median(off):.2f} ms; paired on/off {ratio:.4f}")


if __name__ == "__main__":
    main()
