"""Benchmark checkpoint saves: step time while an async save runs vs without, save time by size.

    python scripts/bench_checkpoint.py [--world 1 2] [--sizes 256x4 512x8 768x8] [--rounds 3]
                                       [--out bench_results/checkpoint.json]

For each world size and model size (gpt, ``hidden x layers``, vocab 512, seq 128) the real
Trainer runs on ``world`` gloo ranks (dp = world, ZeRO-1, fp32, one thread per rank) and,
alternating, per round:

- ``baseline``: training steps with no save in flight (median step time);
- ``async``: ``save_checkpoint`` with ``train.async_save=true`` (the time it blocks the
  training loop: host staging), then training steps until the background save has
  committed (median step time of those steps, and the save's duration);
- ``blocking``: a save with ``async_save=false`` (training waits for all of it).

A step is ``next(batches)`` + pipeline step + optimizer step, timed on every rank; the
table reports rank 0 (all ranks save at the same step). Sizes are the checkpoint's bytes
on disk. On a CPU machine the background writer competes with training for the same
cores (world 2 on 2 cores leaves none idle; world 1 leaves one, as a GPU node's host CPUs
are idle while the GPU trains). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.harness import run_on_ranks  # noqa: E402  (spawns gloo ranks on this machine)

BASE_STEPS = 4
MAX_OVERLAP_STEPS = 200


def _values(hidden: int, layers: int, world: int, out: str, cache: str) -> dict:
    return {
        "model": {"name": f"bench_{hidden}x{layers}", "arch": "gpt", "num_layers": layers, "hidden_size": hidden,
                  "num_heads": max(1, hidden // 64), "vocab_size": 512, "max_seq_len": 128, "dropout": 0.0},
        "parallel": {"dp": world, "zero_stage": 1},
        "train": {"steps": 100_000, "global_batch_size": 4 * world, "micro_batch_size": 4, "seq_len": 128,
                  "out_dir": out, "save_every": 0, "keep_last": 1, "device": "cpu", "resume": "none",
                  "async_save": True},
        "optimizer": {"warmup_steps": 0},
        "data": {"cache_dir": cache},
        "logging": {"log_every": 1_000_000},
    }


def _step(trainer) -> float:
    t0 = time.perf_counter()
    trainer.optimizer.zero_grad()
    trainer.engine.run_step(next(trainer.batches), loss_scale=trainer.optimizer.loss_scale, step=trainer.step)
    trainer.optimizer.step()
    trainer.step += 1
    return time.perf_counter() - t0


def _bytes_on_disk(root: str) -> int:
    total = 0
    for parent, _, names in os.walk(root):
        total += sum(os.path.getsize(os.path.join(parent, n)) for n in names)
    return total


def _bench_on_rank(rank: int, world: int, values: dict, rounds: int) -> dict:
    import contextlib
    import io

    import torch.distributed as dist

    from parallel3d.config import job_from_dict, resolve
    from parallel3d.parallel_state import ParallelState
    from parallel3d.trainer import Trainer

    rj = resolve(job_from_dict(values), world)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(rj, ParallelState(rj.topology))
    for _ in range(2):  # warm-up
        _step(trainer)
    out = {"baseline": [], "async_steps": [], "async_block": [], "async_total": [], "overlapped_steps": [],
           "blocking": [], "bytes": 0, "params": sum(p.numel() for c in trainer.chunks for p in c.parameters())}
    writer = trainer.checkpoints
    for _ in range(rounds):
        out["baseline"] += [_step(trainer) for _ in range(BASE_STEPS)]
        # async: the loop is blocked only while the state is staged to host memory
        writer.async_save = True
        dist.barrier()
        t0 = time.perf_counter()
        trainer.save_checkpoint()
        out["async_block"].append(time.perf_counter() - t0)
        steps = []
        while writer.in_flight is not None and len(steps) < MAX_OVERLAP_STEPS:
            steps.append(_step(trainer))
            if writer.completed():
                break
        writer.wait()
        out["async_total"].append(time.perf_counter() - t0)
        out["async_steps"] += steps
        out["overlapped_steps"].append(len(steps))
        # blocking: the loop waits for the whole save
        writer.async_save = False
        dist.barrier()
        t0 = time.perf_counter()
        trainer.save_checkpoint()
        assert writer.wait()[0][1]
        out["blocking"].append(time.perf_counter() - t0)
        out["bytes"] = _bytes_on_disk(writer.manager.latest())
    writer.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2], help="gloo ranks (dp = world, ZeRO-1)")
    parser.add_argument("--sizes", nargs="+", default=["256x4", "512x8", "768x8"], help="gpt hidden x layers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench_results/checkpoint.json")
    parser.add_argument("--cache-dir", default=".cache/parallel3d")
    args = parser.parse_args()

    rows = []
    work = tempfile.mkdtemp(prefix="bench_ckpt_")
    try:
        for world, size in [(w, s) for w in args.world for s in args.sizes]:
            hidden, layers = map(int, size.split("x"))
            values = _values(hidden, layers, world, os.path.join(work, f"{world}-{size}"), args.cache_dir)
            r = run_on_ranks(_bench_on_rank, world, values, args.rounds, timeout=3600)[0]
            base, during = statistics.median(r["baseline"]), statistics.median(r["async_steps"] or [float("nan")])
            rows.append({
                "world": world, "size": size, "params": r["params"], "checkpoint_bytes": r["bytes"],
                "step_s_baseline": base, "step_s_during_async_save": during, "slowdown": during / base,
                "async_blocking_s": statistics.median(r["async_block"]),
                "async_save_s": statistics.median(r["async_total"]),
                "steps_overlapped": statistics.median(r["overlapped_steps"]),
                "blocking_save_s": statistics.median(r["blocking"]),
                "blocking_MBps": r["bytes"] / 2**20 / statistics.median(r["blocking"]),
                "raw": r,
            })
    finally:
        shutil.rmtree(work, ignore_errors=True)

    header = (f"{'world':>5} {'size':>7} {'params':>11} {'ckpt MiB':>9} {'step ms':>8} {'step ms':>9} {'slow':>5} "
              f"{'async':>8} {'async':>8} {'steps':>5} {'blocking':>9} {'MB/s':>6}")
    sub = (f"{'':>5} {'':>7} {'':>11} {'':>9} {'no save':>8} {'async sv':>9} {'':>5} "
           f"{'block s':>8} {'total s':>8} {'ovlp':>5} {'save s':>9} {'':>6}")
    print(f"dp = world, ZeRO-1, fp32, gloo/CPU, rounds={args.rounds}, medians of rank 0")
    print(header)
    print(sub)
    for row in rows:
        print(f"{row['world']:>5} {row['size']:>7} {row['params']:>11,} {row['checkpoint_bytes'] / 2**20:>9.1f} "
              f"{row['step_s_baseline'] * 1e3:>8.1f} {row['step_s_during_async_save'] * 1e3:>9.1f} "
              f"{row['slowdown']:>5.2f} {row['async_blocking_s']:>8.3f} {row['async_save_s']:>8.2f} "
              f"{row['steps_overlapped']:>5.0f} {row['blocking_save_s']:>9.2f} {row['blocking_MBps']:>6.0f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"command": " ".join(sys.argv), "rounds": args.rounds,
                   "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
