"""The default corpus: text every machine has, tokenized once and cached.

``build_default_corpus`` returns ``(prefix, tokenizer)`` for an indexed dataset
of Python's own English documentation (``pydoc_data.topics``) and optionally the
standard-library sources, tokenized with a byte-level BPE trained locally or
with raw bytes. Nothing is downloaded.

Cache layout: ``cache_dir/<corpus>-<tokenizer><vocab>-<key>/`` holding
``tokenizer.json``, ``corpus.{bin,idx}``, ``meta.json`` and a ``COMPLETE``
marker; ``key`` hashes the corpus text, tokenizer kind, vocab size and the
format version, so a different Python (different docs) gets its own entry. The
builder writes into a temporary directory and renames it into place, so the
entry appears complete or not at all. Under several ranks, exactly one passes
``is_builder=True`` (global rank 0); the others wait for the marker.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sysconfig
import time
from pathlib import Path

from parallel3d.data.errors import DataError
from parallel3d.data.preprocess import write_tokenized
from parallel3d.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_byte_level_bpe
from parallel3d.progress import progress_bar

CORPORA = ("pydoc", "stdlib", "pydoc+stdlib")
TOKENIZER_KINDS = ("bpe", "byte")
CACHE_FORMAT_VERSION = 1
COMPLETE_MARKER = "COMPLETE"


def corpus_documents(corpus: str = "pydoc") -> list[str]:
    """Documents of a built-in corpus, in a fixed order.

    ``pydoc``: the ~80 help topics of ``pydoc_data.topics`` (~465k characters).
    ``stdlib``: the top-level ``.py`` files of the standard library (~4.7 MB).
    """
    if corpus not in CORPORA:
        raise DataError(f"corpus={corpus!r} is not a built-in corpus; choose from {list(CORPORA)}")
    docs: list[str] = []
    if "pydoc" in corpus:
        from pydoc_data.topics import topics

        docs += [topics[name] for name in sorted(topics)]
    if "stdlib" in corpus:
        for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
            with open(path, encoding="utf-8", errors="replace") as f:
                docs.append(f.read())
    return docs


def _cache_key(docs: list[str], tokenizer: str, vocab_size: int) -> str:
    h = hashlib.sha256(f"v{CACHE_FORMAT_VERSION}|{tokenizer}|{vocab_size}|{len(docs)}".encode())
    for doc in docs:
        h.update(hashlib.sha256(doc.encode("utf-8", errors="replace")).digest())
    return h.hexdigest()[:16]


def _load_entry(entry: Path) -> tuple[str, ByteTokenizer | HFTokenizer]:
    return os.fspath(entry / "corpus"), load_tokenizer(entry / "tokenizer.json")


def _build_entry(entry: Path, docs: list[str], tokenizer_kind: str, vocab_size: int, show_progress: bool) -> None:
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        if show_progress:
            print(f"building the built-in corpus (first use; cached in {entry})", flush=True)
        tok = (ByteTokenizer() if tokenizer_kind == "byte"
               else train_byte_level_bpe(docs, vocab_size, show_progress=show_progress, total=len(docs)))
        tok.save(tmp / "tokenizer.json")
        with progress_bar("tokenizing the corpus", total=len(docs), unit="doc", enabled=show_progress) as bar:
            stats = write_tokenized(docs, tok, tmp / "corpus", progress=bar)
        meta = {**stats, "tokenizer": tokenizer_kind, "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
                "requested_vocab_size": vocab_size, "build_seconds": round(time.perf_counter() - t0, 3)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        try:
            os.rename(tmp, entry)
        except OSError:
            # Another builder (another job sharing the cache) got there first; its entry is equivalent.
            if not (entry / COMPLETE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_default_corpus(
    cache_dir: str | os.PathLike,
    vocab_size: int,
    seed: int = 0,
    *,
    corpus: str = "pydoc",
    tokenizer: str = "bpe",
    is_builder: bool = True,
    wait_timeout_s: float = 600.0,
    poll_interval_s: float = 0.1,
    show_progress: bool = True,
) -> tuple[str, ByteTokenizer | HFTokenizer]:
    """Tokenized default corpus (cached): returns ``(prefix, tokenizer)`` with ``tokenizer.vocab_size <= vocab_size``.

    ``vocab_size`` is the model's vocabulary: the BPE is trained to at most that
    many tokens (``tokenizer="byte"`` needs >= 257). ``seed`` does not change the
    result (the corpus and BPE training are deterministic); the sample order is
    seeded by ``GPTDataset``. With ``is_builder=False`` this waits up to
    ``wait_timeout_s`` for the builder's ``COMPLETE`` marker instead of building.
    The builder shows progress (``parallel3d.progress``) unless ``show_progress=False``.
    """
    del seed  # accepted so callers can pass the run seed; the build is seed-independent
    entry, docs = _entry(cache_dir, vocab_size, corpus, tokenizer)
    if not (entry / COMPLETE_MARKER).exists():
        if is_builder:
            entry.parent.mkdir(parents=True, exist_ok=True)
            _build_entry(entry, docs, tokenizer, vocab_size, show_progress)
        else:
            deadline = time.monotonic() + wait_timeout_s
            while not (entry / COMPLETE_MARKER).exists():
                if time.monotonic() > deadline:
                    raise DataError(
                        f"timed out after {wait_timeout_s:.0f}s waiting for {entry / COMPLETE_MARKER}; "
                        "did the builder rank (is_builder=True, normally global rank 0) fail or use another cache_dir?"
                    )
                time.sleep(poll_interval_s)
    return _load_entry(entry)


def cached_default_corpus(cache_dir: str | os.PathLike, vocab_size: int, *, corpus: str = "pydoc",
                          tokenizer: str = "bpe") -> str | None:
    """The prefix ``build_default_corpus`` returns for these arguments if its cache entry is complete, else None
    (nothing is built: preflight counts the corpus here when it can)."""
    entry, _ = _entry(cache_dir, vocab_size, corpus, tokenizer)
    return os.fspath(entry / "corpus") if (entry / COMPLETE_MARKER).exists() else None


def _entry(cache_dir: str | os.PathLike, vocab_size: int, corpus: str, tokenizer: str) -> tuple[Path, list[str]]:
    """The cache entry of a built-in corpus and its documents (DataError for a tokenizer or vocabulary it refuses)."""
    if tokenizer not in TOKENIZER_KINDS:
        raise DataError(
            f"tokenizer={tokenizer!r} is not a default-corpus tokenizer; choose from {list(TOKENIZER_KINDS)}"
        )
    min_vocab = ByteTokenizer().vocab_size
    if not isinstance(vocab_size, int) or vocab_size < min_vocab:
        raise DataError(f"vocab_size={vocab_size!r} must be an int >= {min_vocab} (256 bytes + end-of-document)")
    docs = corpus_documents(corpus)
    # The byte vocabulary does not depend on vocab_size: share one entry.
    key_vocab = min_vocab if tokenizer == "byte" else vocab_size
    name = f"{corpus.replace('+', '_')}-{tokenizer}{key_vocab}-{_cache_key(docs, tokenizer, key_vocab)}"
    return Path(cache_dir) / name, docs
