"""Reader and writer of the Megatron indexed-dataset format (``prefix.bin`` + ``prefix.idx``).

Byte layout of ``prefix.idx`` (little-endian), as megatron-core reads it::

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     token dtype of the .bin (see ``DTYPE_CODES``)
    sequence count   uint64    S
    document count   uint64    D + 1 (boundaries, including the leading 0)
    sequence lengths int32[S]  tokens per sequence
    sequence ptrs    int64[S]  byte offset of each sequence in the .bin
    document indices int64[D+1] sequence index where each document starts; last == S

``prefix.bin`` is the raw token array. A document is a run of sequences; the
writer here stores one sequence per document (what text pretraining needs) and the
reader accepts any number. Both files are written to temporaries and renamed, so
a reader never sees a half-written pair. Reading memory-maps the files: opening a
dataset costs O(1) in its size.

Sidecar ``prefix.stats.json`` (ours, optional; megatron-core ignores it, the .idx
format is untouched): ``{"max_token_id", "num_tokens", "bin_bytes"}``, written by
``IndexedDatasetWriter`` so a vocabulary check at start-up needs no pass over the
tokens. It is trusted only while ``bin_bytes`` matches the ``.bin`` on disk.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

from parallel3d.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's numeric codes for the token dtype; part of the on-disk format.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")


def token_dtype_for(vocab_size: int) -> np.dtype:
    """The smallest token dtype Megatron would pick for ``vocab_size`` ids."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".bin"


def stats_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".stats.json"


def indexed_dataset_exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDatasetWriter:
    """Streams documents into ``prefix.bin``; ``finalize()`` writes ``prefix.idx``.

    Each ``add_document(tokens)`` appends one document made of one sequence. Until
    ``finalize()`` both files live under temporary names.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            allowed = sorted(str(d) for d in _CODE_OF)
            raise DataError(f"token dtype {self.dtype} is not in the indexed format; allowed: {allowed}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp_suffix = f".tmp{os.getpid()}"
        self._bin = open(bin_path(self.prefix) + self._tmp_suffix, "wb")
        self._lengths: list[int] = []
        self._max_token = -1
        self._max_value = np.iinfo(self.dtype).max if self.dtype.kind in "iu" else None

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"a document must be a 1-D token array, got shape {arr.shape}")
        if arr.size and self._max_value is not None and (arr.max() > self._max_value or arr.min() < 0):
            raise DataError(
                f"token id range [{arr.min()}, {arr.max()}] does not fit dtype {self.dtype} "
                f"(max {self._max_value}); pick a wider dtype"
            )
        if arr.size:
            self._max_token = max(self._max_token, int(arr.max()))
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def finalize(self) -> str:
        """Write the index and move both files into place; returns the prefix."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
        tmp_idx = idx_path(self.prefix) + self._tmp_suffix
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(doc_index)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_index.tobytes())
        bin_bytes = os.path.getsize(bin_path(self.prefix) + self._tmp_suffix)
        stats = {"max_token_id": self._max_token, "num_tokens": int(lengths.sum(dtype=np.int64)),
                 "bin_bytes": bin_bytes}
        tmp_stats = stats_path(self.prefix) + self._tmp_suffix
        with open(tmp_stats, "w") as f:
            json.dump(stats, f)
        # .bin (and stats) first: a reader checks for the .idx, which only appears once all are complete.
        os.replace(bin_path(self.prefix) + self._tmp_suffix, bin_path(self.prefix))
        os.replace(tmp_stats, stats_path(self.prefix))
        os.replace(tmp_idx, idx_path(self.prefix))
        return self.prefix

    def abort(self) -> None:
        self._bin.close()
        for p in (bin_path(self.prefix) + self._tmp_suffix, idx_path(self.prefix) + self._tmp_suffix,
                  stats_path(self.prefix) + self._tmp_suffix):
            if os.path.exists(p):
                os.remove(p)


def write_indexed_dataset(
    prefix: str | os.PathLike, documents: Iterable[Iterable[int] | np.ndarray], dtype: np.dtype | type = np.uint16
) -> str:
    """Write all ``documents`` (token sequences) as one indexed dataset; returns the prefix."""
    writer = IndexedDatasetWriter(prefix, dtype)
    try:
        for doc in documents:
            writer.add_document(doc)
    except BaseException:
        writer.abort()
        raise
    return writer.finalize()


class IndexedDataset:
    """Memory-mapped view of an indexed dataset.

    ``tokens`` is the whole .bin as one flat array; ``sequence_lengths``,
    ``sequence_pointers`` (bytes) and ``document_indices`` are the index arrays.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        for path in (idx_path(self.prefix), bin_path(self.prefix)):
            if not os.path.isfile(path):
                raise DataError(f"indexed dataset file {path!r} does not exist (prefix {self.prefix!r})")
        idx_bytes = os.path.getsize(idx_path(self.prefix))
        if idx_bytes < _HEADER.size:
            raise DataError(f"{idx_path(self.prefix)!r} is too short ({idx_bytes} bytes) to be an index")
        index = np.memmap(idx_path(self.prefix), dtype=np.uint8, mode="r")
        magic, version, code, n_seq, n_doc = _HEADER.unpack(index[: _HEADER.size].tobytes())
        if magic != MAGIC:
            raise DataError(f"{idx_path(self.prefix)!r}: bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise DataError(f"{idx_path(self.prefix)!r}: unsupported version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx_path(self.prefix)!r}: unknown dtype code {code}; known {sorted(DTYPE_CODES)}")
        self.dtype = DTYPE_CODES[code]
        offset = _HEADER.size
        need = offset + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if index.size < need:
            raise DataError(f"{idx_path(self.prefix)!r}: truncated ({index.size} bytes, header needs {need})")
        buf = index
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=offset)
        if n_doc < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n_seq:
            raise DataError(
                f"{idx_path(self.prefix)!r}: document indices must run from 0 to the sequence count {n_seq}"
            )
        bin_bytes = os.path.getsize(bin_path(self.prefix))
        if bin_bytes % self.dtype.itemsize:
            raise DataError(f"{bin_path(self.prefix)!r}: size {bin_bytes} is not a multiple of {self.dtype}")
        # np.memmap refuses empty files; an empty dataset has no tokens to map.
        self.tokens = (
            np.memmap(bin_path(self.prefix), dtype=self.dtype, mode="r")
            if bin_bytes
            else np.zeros(0, dtype=self.dtype)
        )
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n_seq else 0
        if end > bin_bytes:
            raise DataError(f"{bin_path(self.prefix)!r}: truncated or not the data of {idx_path(self.prefix)!r}: "
                            f"the index points to byte {end}, the file has {bin_bytes}")
        if end < bin_bytes:  # a writer's .bin is exactly the sequences the .idx lists
            raise DataError(f"{bin_path(self.prefix)!r} does not match {idx_path(self.prefix)!r}: the index "
                            f"describes {end} bytes, the file has {bin_bytes} (another dataset's index?)")

    @property
    def max_token_id(self) -> int | None:
        """The largest token id, from the sidecar written with the data; None when unknown (no pass
        over the tokens: a dataset written by another tool, or a .bin changed since)."""
        try:
            with open(stats_path(self.prefix)) as f:
                stats = json.load(f)
            if int(stats["bin_bytes"]) == os.path.getsize(bin_path(self.prefix)):
                return int(stats["max_token_id"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        """Number of sequences, as in megatron-core."""
        return self.num_sequences

    def get_sequence(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start : start + int(self.sequence_lengths[i])])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get_sequence(i)

    def get_document(self, d: int) -> np.ndarray:
        """All tokens of document ``d`` (its sequences concatenated)."""
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document {d} out of range [0, {self.num_documents})")
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        return np.concatenate([self.get_sequence(i) for i in range(first, last)] or [np.zeros(0, self.dtype)])

    def is_contiguous(self) -> bool:
        """True when the sequences lie back to back in order, so ``tokens`` is the token stream."""
        if self.num_sequences == 0:
            return True
        expected = np.zeros(self.num_sequences, dtype=np.int64)
        expected[1:] = np.cumsum(self.sequence_lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        return bool(np.array_equal(expected, self.sequence_pointers)) and self.num_tokens == len(self.tokens)

    def sampled_token_range(self, head: int = 1 << 20, strided: int = 1 << 16) -> tuple[int, int]:
        """(smallest, largest) token id among the first ``head`` tokens and ``strided`` evenly spaced
        ones: a bounded start-up check for data without a stats sidecar (every sample is checked when
        read). ``(0, -1)`` for no tokens."""
        n = len(self.tokens)
        if n == 0:
            return 0, -1
        step = max(1, n // strided)
        parts = [np.asarray(self.tokens[: min(n, head)]), np.asarray(self.tokens[::step])]
        return min(int(p.min()) for p in parts), max(int(p.max()) for p in parts)

    def token_stream(self) -> np.ndarray:
        """All tokens in sequence order (the memmap itself when contiguous; else a copy)."""
        if self.is_contiguous():
            return self.tokens
        return np.concatenate([self.get_sequence(i) for i in range(self.num_sequences)])
