"""Raw text / JSONL files -> tokenized Megatron indexed dataset.

One document per JSONL line (``json_key`` names the text field) or per text
file (optionally one per blank-line-separated paragraph). Each document is
stored as one sequence and, with ``append_eod``, ends with the tokenizer's
``eod_id``, so a dataset's token stream is already the documents joined by the
end-of-document token.

``write_tokenized(..., workers=N)`` tokenizes batches of documents in N worker
processes (spawned, each loading the same tokenizer from its serialised form) and
writes them in input order, so the output is byte-identical to one worker.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import tempfile
from collections import deque
from itertools import islice
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from parallel3d.data.errors import DataError
from parallel3d.data.indexed import IndexedDatasetWriter, token_dtype_for
from parallel3d.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

_BLANK_LINES = re.compile(r"\n\s*\n")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def iter_jsonl_documents(path: str | os.PathLike, json_key: str) -> Iterator[str]:
    """Texts under ``json_key`` of each non-empty line; errors name the file and line."""
    path = os.fspath(path)
    with _utf8_errors_named(path), open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or json_key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{line_no}: no key {json_key!r} (found: {keys}); set --json-key")
            text = record[json_key]
            if not isinstance(text, str):
                raise DataError(f"{path}:{line_no}: {json_key!r} holds a {type(text).__name__}, not text")
            if bad := _LONE_SURROGATE.search(text):
                # valid JSON ("\\udcff", e.g. a cut emoji) that no tokenizer can encode as UTF-8
                raise DataError(f"{path}:{line_no}: {json_key!r} holds the lone surrogate "
                                f"\\u{ord(bad.group()):04x} at character {bad.start()}, not encodable as UTF-8 text")
            yield text


def iter_text_documents(path: str | os.PathLike, split_paragraphs: bool = False) -> Iterator[str]:
    """The whole file as one document, or each blank-line-separated paragraph."""
    with _utf8_errors_named(os.fspath(path)), open(path, encoding="utf-8") as f:
        text = f.read()
    if not split_paragraphs:
        if text.strip():
            yield text
        return
    for paragraph in _BLANK_LINES.split(text):
        if paragraph.strip():
            yield paragraph


@contextlib.contextmanager
def _utf8_errors_named(path: str) -> Iterator[None]:
    """Turn a ``UnicodeDecodeError`` while reading ``path`` into one ``DataError`` naming the line and byte.
    The decoder reads ahead in blocks, so its own position says nothing about the line; the file is
    rescanned line by line in bytes (a newline byte never occurs inside a UTF-8 sequence)."""
    try:
        yield
    except UnicodeDecodeError:
        where = ""
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    where = f":{line_no}: byte 0x{raw[e.start]:02x} at column {e.start + 1}"
                    break
        raise DataError(f"{path}{where}: not UTF-8 text; convert it first "
                        f"(e.g. iconv -f latin1 -t utf-8 IN > OUT) or drop the bad bytes (iconv -c)") from None


def iter_documents(
    paths: Sequence[str | os.PathLike], json_key: str | None = None, split_paragraphs: bool = False
) -> Iterator[str]:
    """Documents of all ``paths`` in order: JSONL when ``json_key`` is given, else raw text."""
    check_inputs(paths)
    for path in paths:
        if json_key is not None:
            yield from iter_jsonl_documents(path, json_key)
        else:
            yield from iter_text_documents(path, split_paragraphs)


def check_inputs(paths: Sequence[str | os.PathLike]) -> None:
    """Every input is an existing file (a ``DataError`` naming the first that is not)."""
    for path in paths:
        if not os.path.isfile(path):
            what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
            raise DataError(f"input file {os.fspath(path)!r} {what}")


def check_output_prefix(output_prefix: str | os.PathLike) -> None:
    """``PREFIX.*`` can be written: its directory exists or is created, and a file can be made there.
    Probed before any tokenizing or BPE training, so a bad prefix costs nothing. A prefix ending in a
    separator (``data/``) is refused: it would write the hidden files ``data/.bin`` and ``.idx``."""
    if os.fspath(output_prefix).endswith(("/", os.sep)):
        raise DataError(f"output prefix {os.fspath(output_prefix)!r} names a directory: give a file prefix in it, "
                        f"e.g. {os.path.join(os.fspath(output_prefix), 'my_corpus')!r} (writes my_corpus.bin and .idx)")
    parent = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise DataError(f"output prefix {os.fspath(output_prefix)!r}: cannot write in {parent} "
                        f"({exc.strerror or exc})") from None


def count_lines(paths: Sequence[str | os.PathLike]) -> int:
    """Newlines in ``paths`` (a fast pass over bytes; the total a JSONL progress bar counts towards)."""
    check_inputs(paths)  # before opening: a missing file is one DataError line, not an OSError
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                total += chunk.count(b"\n")
    return total


# ---- tokenizing in worker processes -------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _tokenizer_spec(tokenizer: Tokenizer) -> tuple[str, str | None, int]:
    """A picklable description a worker rebuilds the same tokenizer from."""
    if isinstance(tokenizer, ByteTokenizer):
        return "byte", None, tokenizer.eod_id
    if isinstance(tokenizer, HFTokenizer):
        return "hf", tokenizer.backend.to_str(), tokenizer.eod_id
    raise DataError(f"workers > 1 needs a byte or tokenizers-based tokenizer, got {type(tokenizer).__name__}")


def _init_worker(spec: tuple[str, str | None, int], append_eod: bool, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    kind, text, eod_id = spec
    if kind == "byte":
        tok: Tokenizer = ByteTokenizer()
    else:
        from tokenizers import Tokenizer as _Tok

        tok = HFTokenizer(_Tok.from_str(text), eod_id)
    _WORKER.update(tokenizer=tok, append_eod=append_eod, dtype=np.dtype(dtype))


def _encode(tokenizer: Tokenizer, texts: list[str], append_eod: bool, dtype: np.dtype) -> list[np.ndarray]:
    encode_batch = getattr(tokenizer, "encode_batch", None) or (lambda b: [tokenizer.encode(t) for t in b])
    out = []
    for ids in encode_batch(texts):
        if append_eod:
            ids = list(ids) + [tokenizer.eod_id]
        out.append(np.asarray(ids, dtype=np.int64))
    return out


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return _encode(_WORKER["tokenizer"], texts, _WORKER["append_eod"], _WORKER["dtype"])


def _in_order(pool: Any, batches: Iterator[list[str]], depth: int) -> Iterator[list[np.ndarray]]:
    """Results of ``batches`` in input order, at most ``depth`` batches in flight (bounded memory,
    unlike ``Pool.imap``, whose feeder thread reads the whole input ahead)."""
    pending: deque = deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_in_worker, (batch,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def write_tokenized(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    output_prefix: str | os.PathLike,
    *,
    append_eod: bool = True,
    dtype: np.dtype | None = None,
    batch_size: int = 256,
    workers: int = 1,
    progress: Any = None,
) -> dict:
    """Tokenize ``documents`` into ``output_prefix.{bin,idx}``; returns counts.

    ``workers``: tokenizing processes (1 = this one); the output does not depend on it.
    ``progress``: an object with ``update(n)`` / ``set_postfix_str`` (``parallel3d.progress``), told
    about every document written.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise DataError(f"workers={workers!r} must be an integer >= 1")
    dtype = token_dtype_for(tokenizer.vocab_size) if dtype is None else np.dtype(dtype)
    writer = IndexedDatasetWriter(output_prefix, dtype)
    n_docs = n_tokens = 0
    docs = iter(documents)
    batches = iter(lambda: list(islice(docs, batch_size)), [])
    pool = None
    try:
        if workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(
                workers, initializer=_init_worker, initargs=(_tokenizer_spec(tokenizer), append_eod, dtype.str))
            encoded: Iterator[list[np.ndarray]] = _in_order(pool, batches, depth=2 * workers)
        else:
            encoded = (_encode(tokenizer, batch, append_eod, dtype) for batch in batches)
        for arrays in encoded:
            for ids in arrays:
                writer.add_document(ids)
                n_tokens += len(ids)
            n_docs += len(arrays)
            if progress is not None:
                progress.update(len(arrays))
                progress.set_postfix_str(f"{n_tokens:,} tokens")
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    if n_docs == 0:
        writer.abort()
        raise DataError(f"no documents to write to {os.fspath(output_prefix)!r} (inputs empty?)")
    writer.finalize()
    return {"documents": n_docs, "tokens": n_tokens, "dtype": str(dtype)}
