"""``python -m parallel3d.export RUN_DIR_OR_CHECKPOINT --hf OUT_DIR``: a transformers model directory.

Reads a checkpoint of any layout (a run directory means its newest complete checkpoint)
on one process, no GPU, and writes ``config.json``, safetensors weights and the run's
tokenizer, so that ``AutoModelForCausalLM.from_pretrained(OUT_DIR, local_files_only=True)``
and ``AutoTokenizer.from_pretrained(OUT_DIR, local_files_only=True)`` load it offline.
Bad input fails with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from parallel3d.user_warnings import one_line_warnings


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``100KB`` or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 1000000")
    unit = (m.group(2) or "B").upper().replace("I", "")
    return int(float(m.group(1)) * {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[unit])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m parallel3d.export", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a run directory (train.out_dir) or one checkpoint directory (step_N)")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="write a transformers model directory here")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="weights' dtype (default: the run's train.precision)")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB", help="largest safetensors file (default 5GB)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default=None, help="tokenizer.json or directory to use instead of the run's")
    tok.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from parallel3d.checkpoint import CheckpointError
    from parallel3d.checkpoint_io.hf_export import export_hf

    t0 = time.perf_counter()
    try:
        with one_line_warnings():
            result = export_hf(args.source, args.hf, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                               tokenizer=args.tokenizer, with_tokenizer=not args.no_tokenizer,
                               progress=lambda line: print(line, flush=True))
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"export error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"exported {result.checkpoint} (step {result.step}, {result.parameters:,} parameters, {result.dtype}) to "
          f"{result.out_dir} in {time.perf_counter() - t0:.1f}s: {', '.join(result.files)}"
          + ("" if result.tokenizer else " (no tokenizer)"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
