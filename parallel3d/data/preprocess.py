"""Raw text / JSONL files -> tokenized Megatron indexed dataset.

One document per JSONL line (``json_key`` names the text field) or per text
file (optionally one per blank-line-separated paragraph). Each document is
stored as one sequence and, with ``append_eod``, ends with the tokenizer's
``eod_id``, so a dataset's token stream is already the documents joined by the
end-of-document token.
"""

from __future__ import annotations

import json
import os
import re
from itertools import islice
from typing import Iterable, Iterator, Sequence

import numpy as np

from parallel3d.data.errors import DataError
from parallel3d.data.indexed import IndexedDatasetWriter, token_dtype_for
from parallel3d.data.tokenizer import Tokenizer

_BLANK_LINES = re.compile(r"\n\s*\n")


def iter_jsonl_documents(path: str | os.PathLike, json_key: str) -> Iterator[str]:
    """Texts under ``json_key`` of each non-empty line; errors name the file and line."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
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
            yield text


def iter_text_documents(path: str | os.PathLike, split_paragraphs: bool = False) -> Iterator[str]:
    """The whole file as one document, or each blank-line-separated paragraph."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not split_paragraphs:
        if text.strip():
            yield text
        return
    for paragraph in _BLANK_LINES.split(text):
        if paragraph.strip():
            yield paragraph


def iter_documents(
    paths: Sequence[str | os.PathLike], json_key: str | None = None, split_paragraphs: bool = False
) -> Iterator[str]:
    """Documents of all ``paths`` in order: JSONL when ``json_key`` is given, else raw text."""
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"input file {os.fspath(path)!r} does not exist")
    for path in paths:
        if json_key is not None:
            yield from iter_jsonl_documents(path, json_key)
        else:
            yield from iter_text_documents(path, split_paragraphs)


def write_tokenized(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    output_prefix: str | os.PathLike,
    *,
    append_eod: bool = True,
    dtype: np.dtype | None = None,
    batch_size: int = 256,
) -> dict:
    """Tokenize ``documents`` into ``output_prefix.{bin,idx}``; returns counts."""
    dtype = token_dtype_for(tokenizer.vocab_size) if dtype is None else np.dtype(dtype)
    writer = IndexedDatasetWriter(output_prefix, dtype)
    n_docs = n_tokens = 0
    encode_batch = getattr(tokenizer, "encode_batch", None) or (lambda texts: [tokenizer.encode(t) for t in texts])
    docs = iter(documents)
    try:
        while batch := list(islice(docs, batch_size)):
            for ids in encode_batch(batch):
                if append_eod:
                    ids = list(ids) + [tokenizer.eod_id]
                writer.add_document(np.asarray(ids, dtype=np.int64))
                n_docs += 1
                n_tokens += len(ids)
    except BaseException:
        writer.abort()
        raise
    if n_docs == 0:
        writer.abort()
        raise DataError(f"no documents to write to {os.fspath(output_prefix)!r} (inputs empty?)")
    writer.finalize()
    return {"documents": n_docs, "tokens": n_tokens, "dtype": str(dtype)}
