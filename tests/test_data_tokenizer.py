"""Tokenizers: byte vocabulary, locally trained BPE, loading local files; loud failures."""

from __future__ import annotations

import pytest

from parallel3d.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    check_vocab_fits,
    corpus_documents,
    load_tokenizer,
    train_byte_level_bpe,
)

SAMPLE = "def f(x):\n    return x ** 2  # squäre ✓\n\n\tTabs, ünïcode and emoji 🙂 too."


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_byte_level_bpe(corpus_documents("pydoc")[:30], vocab_size=1024)


def test_byte_tokenizer_is_utf8():
    tok = ByteTokenizer()
    assert tok.encode(SAMPLE) == list(SAMPLE.encode("utf-8"))
    assert tok.decode(tok.encode(SAMPLE) + [tok.eod_id]) == SAMPLE
    assert tok.vocab_size == 257 and tok.eod_id == 256


def test_trained_bpe_round_trips_and_compresses(bpe):
    assert 257 < bpe.vocab_size <= 1024
    assert bpe.eod_id == 0  # the special token comes first
    ids = bpe.encode(SAMPLE)
    assert bpe.decode(ids) == SAMPLE
    assert all(0 <= i < bpe.vocab_size for i in ids)
    english = corpus_documents("pydoc")[0][:2000]
    assert len(bpe.encode(english)) < 0.5 * len(english.encode("utf-8"))
    # The end-of-document text is a special token, never produced by plain text.
    assert bpe.eod_id not in bpe.encode("hello world")


def test_load_local_files_match_transformers(tmp_path, bpe):
    """tokenizer.json file, a dir holding one, and a GPT-2 style vocab.json + merges.txt dir."""
    bpe.save(tmp_path / "tokenizer.json")
    from_file = load_tokenizer(tmp_path / "tokenizer.json")
    from_dir = load_tokenizer(tmp_path)
    assert from_file.encode(SAMPLE) == from_dir.encode(SAMPLE) == bpe.encode(SAMPLE)

    gpt2_dir = tmp_path / "gpt2_style"
    gpt2_dir.mkdir()
    bpe.backend.model.save(str(gpt2_dir))
    assert (gpt2_dir / "vocab.json").exists() and (gpt2_dir / "merges.txt").exists()
    from_vocab = load_tokenizer(gpt2_dir)
    assert from_vocab.eod_id == bpe.eod_id
    # Independent reference: transformers' GPT-2 tokenizer built from the same local files.
    from transformers import GPT2TokenizerFast

    ref = GPT2TokenizerFast.from_pretrained(str(gpt2_dir))
    assert len(ref) == bpe.vocab_size
    text = corpus_documents("pydoc")[3][:3000]
    assert from_vocab.encode(text) == ref.encode(text) == bpe.encode(text)


def test_byte_marker_file_loads_byte_tokenizer(tmp_path):
    ByteTokenizer().save(tmp_path / "tokenizer.json")
    assert isinstance(load_tokenizer(tmp_path / "tokenizer.json"), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_errors(tmp_path, bpe):
    with pytest.raises(DataError, match="does not exist.*nothing is downloaded"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="neither tokenizer.json nor vocab.json"):
        load_tokenizer(tmp_path / "empty")
    # A broken tokenizer with a handful of tokens (what an offline hub load can give) fails loudly.
    tiny = tmp_path / "tiny.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="<|endoftext|>")).save(str(tiny))
    with pytest.raises(DataError, match="only 2 tokens"):
        load_tokenizer(tiny)
    with pytest.raises(DataError, match="vocab_size=1024 is larger than the model's vocab_size=512"):
        check_vocab_fits(_Sized(1024), 512)
    check_vocab_fits(bpe, bpe.vocab_size)
    with pytest.raises(DataError, match="too small for a byte-level BPE"):
        train_byte_level_bpe(["abc"], 100)


class _Sized:
    """Only the attribute check_vocab_fits reads."""

    def __init__(self, n: int) -> None:
        self.vocab_size = n
        self.eod_id = 0
