"""Tokenizers: a byte-level vocabulary, a locally trained byte-level BPE, or a local file/dir.

Every tokenizer has ``vocab_size`` (ids are in ``[0, vocab_size)``), ``eod_id``
(the end-of-document token), ``encode(text) -> list[int]`` and
``decode(ids) -> str``. Nothing here downloads: a real tokenizer (GPT-2, Llama)
loads from a local ``tokenizer.json`` file, a directory holding one, or a
directory with GPT-2 style ``vocab.json`` + ``merges.txt``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

from parallel3d.data.errors import DataError

if TYPE_CHECKING:
    import tokenizers

EOD_TOKEN = "<|endoftext|>"
# Candidate end-of-document tokens of common tokenizers, in order of preference.
EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
# A loaded tokenizer smaller than this is broken (e.g. a silently empty offline load).
MIN_REAL_VOCAB = 256


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus ``eod_id = 256``: ``vocab_size = 257``."""

    kind = "byte"

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps({"kind": "byte"}))


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (byte-level BPE, Llama, ...) with a known end-of-document id."""

    kind = "hf"

    def __init__(self, tokenizer: "tokenizers.Tokenizer", eod_id: int | None = None, source: str = "") -> None:
        self.backend = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        if self.vocab_size < MIN_REAL_VOCAB:
            raise DataError(
                f"tokenizer {source or '<in memory>'} has only {self.vocab_size} tokens "
                f"(< {MIN_REAL_VOCAB}); it is probably a failed offline load"
            )
        if eod_id is None:
            for candidate in EOD_CANDIDATES:
                eod_id = tokenizer.token_to_id(candidate)
                if eod_id is not None:
                    break
        if eod_id is None:
            raise DataError(
                f"tokenizer {source or '<in memory>'} has none of the end-of-document tokens "
                f"{list(EOD_CANDIDATES)}; pass eod_id explicitly"
            )
        self.eod_id = int(eod_id)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        self.backend.save(os.fspath(path))


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, *, show_progress: bool = False,
                         total: int | None = None) -> HFTokenizer:
    """Train a GPT-2 style byte-level BPE (``EOD_TOKEN`` is id 0) on ``texts``.

    ``vocab_size`` is an upper bound: a small corpus may yield fewer merges.
    ``show_progress``: a bar over the documents read (``total`` of them, if known) and, on
    a terminal, the tokenizers library's own bar for the merges.
    """
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{len(alphabet) + 1} (256 bytes + the end-of-document token)"
        )
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    from parallel3d.progress import progress_bar, stderr_is_terminal

    with progress_bar(f"training byte-level BPE (vocab {vocab_size})", total=total, unit="doc",
                      enabled=show_progress) as bar:
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOD_TOKEN], initial_alphabet=alphabet,
            show_progress=show_progress and stderr_is_terminal(),
        )

        def counted() -> Iterable[str]:
            for text in texts:
                bar.update(1)
                yield text

        tok.train_from_iterator(counted(), trainer=trainer)
    return HFTokenizer(tok, source="trained byte-level BPE")


def load_tokenizer(spec: str | os.PathLike, eod_id: int | None = None) -> ByteTokenizer | HFTokenizer:
    """Load a tokenizer from ``"byte"``, a ``tokenizer.json`` file, or a local directory.

    A directory may hold ``tokenizer.json`` (any HF fast tokenizer, e.g. Llama) or
    GPT-2 style ``vocab.json`` + ``merges.txt``. Never downloads.
    """
    if os.fspath(spec) == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as _Tok

    path = Path(spec)
    if not path.exists():
        raise DataError(
            f"tokenizer {os.fspath(spec)!r} does not exist; give 'byte', a tokenizer.json file or a local "
            "directory with tokenizer.json or vocab.json + merges.txt (nothing is downloaded)"
        )
    if path.is_file():
        if path.suffix == ".json" and _is_byte_marker(path):
            return ByteTokenizer()
        return HFTokenizer(_read_tokenizer_json(path), eod_id, source=os.fspath(path))
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(_read_tokenizer_json(path / "tokenizer.json"), eod_id, source=os.fspath(path))
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        from tokenizers import decoders, models, pre_tokenizers

        tok = _Tok(models.BPE.from_file(os.fspath(path / "vocab.json"), os.fspath(path / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return HFTokenizer(tok, eod_id, source=os.fspath(path))
    raise DataError(
        f"directory {os.fspath(path)!r} has neither tokenizer.json nor vocab.json + merges.txt"
    )


def _read_tokenizer_json(path: Path) -> "tokenizers.Tokenizer":
    """``tokenizers.Tokenizer.from_file``, whose bare ``Exception`` on a file that is not a tokenizer
    (any JSON, a truncated download, another format) becomes one ``DataError`` naming the file."""
    from tokenizers import Tokenizer as _Tok

    try:
        return _Tok.from_file(os.fspath(path))
    except Exception as exc:  # tokenizers raises plain Exception for every parse failure
        raise DataError(f"tokenizer file {os.fspath(path)!r} is not a tokenizers tokenizer.json ({exc})") from None


def _is_byte_marker(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("kind") == "byte"
    except (ValueError, AttributeError):
        return False


def check_vocab_fits(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raise unless every token id of ``tokenizer`` is a valid row of the model's embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer vocab_size={tokenizer.vocab_size} is larger than the model's "
            f"vocab_size={model_vocab_size}; use a model vocab >= {tokenizer.vocab_size} or a smaller tokenizer"
        )
