"""``DataOptions``: where the training and validation tokens come from (``data.*``).

Invariant: a constructed ``DataOptions`` is one consistent choice (the built-in corpus, or
indexed datasets given one way: ``paths`` + ``weights`` or ``blend``; one validation set);
errors are ``ConfigError`` naming ``data.<key>``. Whether the files exist is checked by
``parallel3d.preflight``.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.data.blend import BlendError, resolve_blend
from parallel3d.data.corpus import CORPORA, TOKENIZER_KINDS
from parallel3d.option_checks import ConfigError, as_tuples, check_bool, check_choice, check_path, check_range

SOURCES: tuple[str, ...] = ("default", "indexed")
Blend = tuple[list[str], "list[float] | None"]  # (prefixes, weights or None: by dataset size)


@dataclass(frozen=True)
class DataOptions:
    source: str = "default"  # default (built-in corpus) | indexed (Megatron .bin/.idx prefixes)
    corpus: str = "pydoc"  # built-in corpus (source=default): pydoc | stdlib | pydoc+stdlib
    tokenizer: str = "bpe"  # built-in corpus tokenizer: bpe (trained locally to model.vocab_size) | byte
    paths: tuple[str, ...] = ()  # dataset prefixes (source=indexed)
    weights: tuple[float, ...] | None = None  # blending weights, one per path; null = by dataset size
    cache_dir: str = ".cache/parallel3d"  # where the built-in corpus is tokenized once
    # source=indexed: the tokenizer the data was made with (saved into the run for HF export);
    # null = <first path>.tokenizer.json when it exists
    tokenizer_file: str | None = None
    # Megatron's blend string "0.3 prefix_a 0.7 prefix_b" (or "a b"): instead of paths + weights.
    blend: str | None = None
    # Validation set: the tail of each training dataset (a fraction of its tokens, cut at a
    # document boundary), or separate prefixes (same syntax as paths; source=indexed).
    valid_fraction: float = 0.0
    valid_paths: tuple[str, ...] = ()
    # Packed documents: attention stays inside each document (ended by the tokenizer's EOD token)
    # and positions restart at each document's first token.
    document_mask: bool = False

    def __post_init__(self) -> None:
        as_tuples(self)
        check_choice("data.source", self.source, SOURCES)
        (paths, weights), (valid_paths, _) = self.blends()
        if self.source == "indexed" and not paths:
            raise ConfigError("data.paths=[]: data.source=indexed needs at least one dataset prefix (or data.blend)")
        if self.source == "default" and paths:
            given = f"data.blend={self.blend!r}" if self.blend else f"data.paths={list(self.paths)}"
            raise ConfigError(f"{given}: only used with data.source=indexed")
        if self.source == "default" and weights is not None:
            raise ConfigError(f"data.weights={weights}: only used with data.source=indexed")
        if self.source == "default" and valid_paths:
            raise ConfigError(f"data.valid_paths={list(self.valid_paths)}: only used with data.source=indexed "
                              f"(the built-in corpus holds out data.valid_fraction)")
        valid_fraction = check_range("data.valid_fraction", self.valid_fraction, 0.0)
        if valid_fraction >= 1.0:
            raise ConfigError(f"data.valid_fraction={self.valid_fraction!r}: must be >= 0 and < 1")
        if valid_paths and valid_fraction > 0:
            raise ConfigError(f"data.valid_fraction={self.valid_fraction!r}: give one validation set, either "
                              f"data.valid_paths (with data.valid_fraction=0) or a held-out data.valid_fraction")
        if self.tokenizer_file is not None and self.source != "indexed":
            raise ConfigError(self.tokenizer_file_error())
        check_choice("data.corpus", self.corpus, CORPORA)
        check_choice("data.tokenizer", self.tokenizer, TOKENIZER_KINDS)
        check_bool("data.document_mask", self.document_mask)
        check_path("data.cache_dir", self.cache_dir)  # '' would build the corpus cache in the working directory

    def blends(self) -> tuple[Blend, Blend]:
        """``((train prefixes, weights), (validation prefixes, weights))``, however the blend was spelled."""
        try:
            train = resolve_blend(self.paths, self.weights, self.blend)
            valid = resolve_blend(self.valid_paths, None, None, prefix_key="data.valid")
        except BlendError as exc:
            raise ConfigError(str(exc)) from None
        return train, valid

    @property
    def has_valid_set(self) -> bool:
        return bool(self.valid_paths) or self.valid_fraction > 0

    def tokenizer_file_error(self) -> str:
        return (f"data.tokenizer_file={self.tokenizer_file!r}: must be an existing tokenizer.json (or a "
                f"directory holding one) and is only used with data.source=indexed")

    def check_vocab(self, vocab_size: int) -> None:
        """The built-in corpus's tokens (256 bytes + end-of-document) fit the model's vocabulary."""
        if self.source == "default" and vocab_size < 257:
            raise ConfigError(
                f"model.vocab_size={vocab_size}: the built-in corpus needs >= 257 (256 bytes + end-of-document)"
            )
