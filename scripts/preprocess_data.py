#!/usr/bin/env python
"""Tokenize raw text or JSONL files into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx).

    python scripts/preprocess_data.py --input a.jsonl b.jsonl --json-key text \\
        --tokenizer path/to/tokenizer.json --output-prefix data/my_corpus
    python scripts/preprocess_data.py --input book.txt --split-paragraphs \\
        --train-bpe 8192 --output-prefix data/book      # also writes data/book.tokenizer.json

Without --json-key, each input file is raw text (one document, or one per
paragraph with --split-paragraphs). Each document ends with the tokenizer's
end-of-document token unless --no-append-eod. Nothing is downloaded.
--workers N tokenizes in N processes (large inputs); the output is byte-identical
to one worker. A progress bar (documents, tokens, ETA) runs on stderr; --quiet
turns it off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel3d.data import (  # noqa: E402  (needs the sys.path entry above)
    DataError,
    iter_documents,
    load_tokenizer,
    train_byte_level_bpe,
    write_tokenized,
)
from parallel3d.data.preprocess import check_inputs, check_output_prefix, count_lines  # noqa: E402
from parallel3d.progress import progress_bar  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--json-key", default=None, help="read JSONL and take this field of each line")
    p.add_argument("--split-paragraphs", action="store_true", help="raw text: one document per paragraph")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="'byte', a tokenizer.json, or a local HF tokenizer directory")
    tok.add_argument("--train-bpe", type=int, metavar="VOCAB", help="train a byte-level BPE on the input")
    p.add_argument("--no-append-eod", action="store_true", help="do not end documents with the EOD token")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (output identical to 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers={args.workers}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_inputs(args.input)
        check_output_prefix(args.output_prefix)

        def docs():
            return iter_documents(args.input, args.json_key, args.split_paragraphs)

        show = not args.quiet
        # JSONL: one document per line, so the line count gives the bar its total (and an ETA).
        total = count_lines(args.input) if show and args.json_key is not None else None
        if args.train_bpe is not None:
            tokenizer = train_byte_level_bpe(docs(), args.train_bpe, show_progress=show, total=total)
            tok_path = Path(args.output_prefix + ".tokenizer.json")
            tok_path.parent.mkdir(parents=True, exist_ok=True)
            tokenizer.save(tok_path)
        else:
            tokenizer = load_tokenizer(args.tokenizer)
        with progress_bar(f"tokenizing into {args.output_prefix} ({args.workers} worker(s))", total=total,
                          unit="doc", enabled=show) as bar:
            stats = write_tokenized(docs(), tokenizer, args.output_prefix, append_eod=not args.no_append_eod,
                                    workers=args.workers, progress=bar)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stats.update(vocab_size=tokenizer.vocab_size, eod_id=tokenizer.eod_id, workers=args.workers,
                 seconds=round(time.perf_counter() - t0, 3))
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
