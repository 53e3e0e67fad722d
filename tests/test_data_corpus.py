"""Default corpus: built from local text, cached, atomic, non-builders wait; bad input fails loudly."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from parallel3d.data import DataError, IndexedDataset, build_default_corpus, corpus_documents


def test_bpe_corpus_round_trips_and_is_cached(tmp_path):
    prefix, tok = build_default_corpus(tmp_path, 1024)
    assert tok.vocab_size <= 1024
    docs = corpus_documents("pydoc")
    ds = IndexedDataset(prefix)
    assert ds.num_documents == len(docs) > 50
    for d in (0, len(docs) // 2, len(docs) - 1):
        ids = ds.get_document(d)
        assert ids[-1] == tok.eod_id and tok.eod_id not in ids[:-1]
        assert tok.decode(ids[:-1].tolist()) == docs[d]
    assert int(ds.tokens.max()) < tok.vocab_size
    entries = [p for p in tmp_path.iterdir()]
    assert len(entries) == 1 and not entries[0].name.startswith(".tmp")
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    t0 = time.perf_counter()
    prefix2, tok2 = build_default_corpus(tmp_path, 1024, is_builder=False, wait_timeout_s=0.0)
    assert time.perf_counter() - t0 < 1.0
    assert prefix2 == prefix and os.stat(prefix + ".bin").st_mtime_ns == stamp
    assert tok2.encode(docs[1][:500]) == tok.encode(docs[1][:500])
    # Another vocab size is another cache entry.
    prefix3, tok3 = build_default_corpus(tmp_path, 600)
    assert prefix3 != prefix and tok3.vocab_size <= 600


def test_byte_corpus_is_utf8(tmp_path):
    prefix, tok = build_default_corpus(tmp_path, 50257, tokenizer="byte")
    assert tok.vocab_size == 257
    doc = corpus_documents("pydoc")[5]
    ids = IndexedDataset(prefix).get_document(5)
    np.testing.assert_array_equal(ids[:-1], np.frombuffer(doc.encode("utf-8"), dtype=np.uint8))
    assert ids[-1] == 256


def test_errors(tmp_path):
    with pytest.raises(DataError, match=r"timed out after 0s waiting for .*COMPLETE.*builder rank"):
        build_default_corpus(tmp_path, 512, is_builder=False, wait_timeout_s=0.2, poll_interval_s=0.05)
    with pytest.raises(DataError, match="vocab_size=100 must be an int >= 257"):
        build_default_corpus(tmp_path, 100)
    with pytest.raises(DataError, match="corpus='wiki' is not a built-in corpus"):
        build_default_corpus(tmp_path, 512, corpus="wiki")
    with pytest.raises(DataError, match="tokenizer='gpt2' is not a default-corpus tokenizer"):
        build_default_corpus(tmp_path, 512, tokenizer="gpt2")
    assert not any(tmp_path.iterdir()), "failed calls must leave no cache entry behind"
