"""The run's tokenizer, kept in the run directory so a checkpoint exports without anything else.

``<train.out_dir>/tokenizer/`` holds ``tokenizer.json`` (a ``tokenizers`` file; the byte
tokenizer is written as the equivalent byte-level BPE without merges: byte b is id b,
end-of-document 256) and ``eod.json`` (the end-of-document token and id). Written once
by global rank 0 when training starts; HF export turns it into a transformers tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING

from parallel3d.data.errors import DataError
from parallel3d.data.tokenizer import EOD_TOKEN, ByteTokenizer, HFTokenizer, load_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers

RUN_TOKENIZER_DIR = "tokenizer"
EOD_FILE = "eod.json"


def byte_level_equivalent() -> "tokenizers.Tokenizer":
    """A ``tokenizers`` tokenizer with the ids of ``ByteTokenizer`` (bytes 0..255, EOD 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters standing for bytes
    to_char = _bytes_to_unicode()
    assert sorted(to_char.values()) == sorted(alphabet)
    tok = Tokenizer(models.BPE(vocab={to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOD_TOKEN])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel pre-tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def save_run_tokenizer(tokenizer: ByteTokenizer | HFTokenizer, run_dir: str) -> str:
    """Write ``run_dir/tokenizer/`` (replacing an older one atomically); returns its path."""
    if isinstance(tokenizer, ByteTokenizer):
        backend, eod_token = byte_level_equivalent(), EOD_TOKEN
    else:
        backend, eod_token = tokenizer.backend, tokenizer.backend.id_to_token(tokenizer.eod_id)
    target = os.path.join(run_dir, RUN_TOKENIZER_DIR)
    tmp = target + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    backend.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, EOD_FILE), "w") as fh:
        json.dump({"eod_token": eod_token, "eod_id": tokenizer.eod_id, "vocab_size": tokenizer.vocab_size}, fh)
    old = target + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(target):
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def load_run_tokenizer(path: str) -> tuple["tokenizers.Tokenizer", dict]:
    """``(tokenizers.Tokenizer, {"eod_token", "eod_id", "vocab_size"})`` of a saved run tokenizer
    directory, or of a plain ``tokenizer.json`` file / directory (EOD found by name)."""
    from tokenizers import Tokenizer

    file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise DataError(f"no tokenizer at {path!r} (expected a tokenizer.json file or a directory holding one)")
    backend = Tokenizer.from_file(file)
    eod_file = os.path.join(os.path.dirname(file), EOD_FILE)
    if os.path.isfile(eod_file):
        with open(eod_file) as fh:
            return backend, json.load(fh)
    wrapped = HFTokenizer(backend, source=file)
    return backend, {"eod_token": backend.id_to_token(wrapped.eod_id), "eod_id": wrapped.eod_id,
                     "vocab_size": wrapped.vocab_size}


def indexed_tokenizer_path(tokenizer_file: str | None, prefixes: list[str]) -> str | None:
    """Where indexed data's tokenizer is: ``data.tokenizer_file``, else ``<first prefix>.tokenizer.json``
    when ``scripts/preprocess_data.py --train-bpe`` wrote one, else None."""
    if tokenizer_file:
        return tokenizer_file
    beside = prefixes[0] + ".tokenizer.json" if prefixes else ""
    return beside if beside and os.path.isfile(beside) else None


def indexed_data_tokenizer(tokenizer_file: str | None, prefixes: list[str]) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer of indexed data, found by ``indexed_tokenizer_path`` (None: it has none)."""
    path = indexed_tokenizer_path(tokenizer_file, prefixes)
    return load_tokenizer(path) if path is not None else None
