#!/usr/bin/env python
"""Start-up cost of the training dataset on a large token file: before vs after (issue 15).

    python scripts/bench_data_startup.py                        # 1 GB file, this tree only
    python scripts/bench_data_startup.py --compare-with /tmp/base   # also a tree of an older commit
    (e.g. `git archive ac4b24b parallel3d models kernels | tar -x -C /tmp/base`)

Writes (once) a ``--size-gb`` indexed dataset of uint16 tokens (documents of 100-4000
tokens, ids < 50,000) under ``--data-dir``, then times, in a fresh process per run,
what every rank does at start-up: ``GPTDataset(prefix, seq_len, seed, model_vocab_size)``
plus reading the first global batch. Cases: this tree with the ``.stats.json`` sidecar
(written by our preprocessing), this tree without it (a dataset written by another tool:
the vocabulary is checked lazily, per sample read), and the ``--compare-with`` tree (the
old code scanned every token for the largest id). The page cache is warm after the first
run (the file fits in memory); the table reports the median of ``--repeats`` runs. Prints
a table and writes JSON (default ``bench_results/data_startup.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_MEASURE = r"""
import sys, time, json
sys.path.insert(0, {code!r})
import numpy as np
from parallel3d.data import GPTDataset
t0 = time.perf_counter()
ds = GPTDataset({prefix!r}, None, seq_len={seq_len}, seed=1, model_vocab_size={vocab})
t1 = time.perf_counter()
batch = ds.get_samples(np.arange({batch}))
t2 = time.perf_counter()
print(json.dumps({{"construct_s": t1 - t0, "first_batch_s": t2 - t1, "samples": int(ds.samples_per_epoch)}}))
"""


def make_dataset(prefix: str, size_gb: float) -> None:
    from parallel3d.data import IndexedDatasetWriter

    if os.path.exists(prefix + ".idx"):
        return
    rng = np.random.default_rng(0)
    target = int(size_gb * 2**30) // 2
    writer = IndexedDatasetWriter(prefix, np.uint16)
    written = 0
    t0 = time.perf_counter()
    while written < target:
        lengths = rng.integers(100, 4000, 4096)
        tokens = rng.integers(0, 50_000, int(lengths.sum()), dtype=np.uint16)
        for doc in np.split(tokens, np.cumsum(lengths)[:-1]):
            writer.add_document(doc)
        written += len(tokens)
    writer.finalize()
    print(f"wrote {prefix}.bin: {os.path.getsize(prefix + '.bin') / 2**30:.2f} GiB, {written:,} tokens "
          f"in {time.perf_counter() - t0:.0f}s", flush=True)


def measure(code: str, prefix: str, args: argparse.Namespace) -> dict:
    script = _MEASURE.format(code=code, prefix=prefix, seq_len=args.seq_len, vocab=50_304, batch=args.batch)
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        "construct_s": statistics.median(r["construct_s"] for r in runs),
        "first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
        "runs": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--data-dir", default="/tmp/p3d-bench-data")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64, help="samples in the first batch read")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-with", default=None, help="another source tree (e.g. the commit before)")
    parser.add_argument("--json", default="bench_results/data_startup.json")
    args = parser.parse_args()

    os.makedirs(args.data_dir, exist_ok=True)
    prefix = os.path.join(args.data_dir, f"tokens_{args.size_gb:g}gb")
    make_dataset(prefix, args.size_gb)
    cases = []
    if args.compare_with:
        cases.append(("before (--compare-with tree)", args.compare_with, prefix))
    cases.append(("after, with .stats.json sidecar", REPO, prefix))
    bare = os.path.join(args.data_dir, "no_sidecar")  # the same data without our sidecar
    for ext in (".bin", ".idx"):
        if not os.path.exists(bare + ext):
            os.symlink(prefix + ext, bare + ext)
    cases.append(("after, no sidecar (lazy check)", REPO, bare))
    results = []
    print(f"{'case':<34} {'start-up s':>10} {'1st batch s':>11}", flush=True)
    for name, code, pfx in cases:
        r = measure(code, pfx, args)
        results.append({"case": name, "code": code, "prefix": pfx, **r})
        print(f"{name:<34} {r['construct_s']:>10.3f} {r['first_batch_s']:>11.4f}", flush=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "bytes": os.path.getsize(prefix + ".bin"),
                   "seq_len": args.seq_len, "repeats": args.repeats, "results": results}, fh, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    import numpy as np

    sys.exit(main())
