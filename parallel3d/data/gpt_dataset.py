"""GPT pretraining samples over one or more indexed datasets, shuffled and blended.

Invariants:
- Component dataset ``d`` is its token stream (documents back to back; each
  document already ends with the end-of-document token, written by preprocessing)
  cut into ``n_d = (tokens - 1) // seq_len`` chunks; chunk ``c`` is
  ``stream[c*seq_len : c*seq_len + seq_len + 1]`` (consecutive chunks share one
  token, so every token is a label exactly once). ``input = chunk[:-1]``,
  ``labels = chunk[1:]``.
- The sample stream is infinite and indexed by a global sample id ``k >= 0``.
  ``k`` is assigned to a dataset by a fixed interleaving pattern of period
  ``blend_period`` whose counts follow the weights (each prefix of the pattern is
  within one sample of the ideal share per dataset). The ``j``-th sample that goes
  to dataset ``d`` is chunk ``perm(seed, d, epoch)[j % n_d]`` with
  ``epoch = j // n_d``: every epoch of a dataset visits all its chunks once, in a
  fresh order seeded by ``(seed, d, epoch)``.
- Everything is a pure function of ``(k, seed, seq_len, weights, datasets, split)``:
  no state, so any rank can read any sample and a resumed run reads what it would
  have read.
- Held-out validation (``split="train"`` / ``"valid"`` with ``valid_fraction = f``):
  each dataset's token stream is cut once, at the document boundary nearest to
  ``(1 - f) * tokens`` (at that token if no boundary leaves both sides a sample);
  ``train`` samples come only from the head, ``valid`` only from the tail, so the two
  never share a token. The cut depends on the data and ``f`` alone (not on the layout).
- Start-up reads only the index: the token-id check (``0 <= id < vocab_size``; a
  negative id is what a signed dtype too narrow for the vocabulary leaves) uses the
  ``.stats.json`` sidecar when there is one, else a bounded sample of the tokens, and,
  always, the tokens of every sample read (lazily), so start-up time does not grow
  with the dataset.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Sequence, Union

import numpy as np

from parallel3d.data.errors import DataError
from parallel3d.data.indexed import IndexedDataset, bin_path
from parallel3d.option_checks import check_weights

DEFAULT_BLEND_PERIOD = 10_000
SPLITS = ("all", "train", "valid")
_PERM_CACHE_SIZE = 8

DatasetSource = Union[str, os.PathLike, IndexedDataset]


def check_token_ids(ds: IndexedDataset, low: int, high: int, vocab_size: int) -> None:
    """Raise one line naming ``ds``'s file unless its token ids ``low .. high`` lie in ``[0, vocab_size)``
    (an embedding lookup would otherwise fail mid-step with a bare IndexError)."""
    if low < 0:
        wrap = (f": ids above {np.iinfo(ds.dtype).max} wrap to negative numbers in {ds.dtype}; rewrite it with "
                f"an unsigned or wider dtype (uint16 below 65,536 ids, else int32)") if ds.dtype.kind == "i" else ""
        raise DataError(f"dataset {bin_path(ds.prefix)!r} holds token id {low} < 0 ({ds.dtype} tokens){wrap}")
    if high >= vocab_size:
        raise DataError(f"dataset {ds.prefix!r} holds token id {high} >= model vocab_size={vocab_size}")


def blend_pattern(weights: Sequence[float], period: int) -> np.ndarray:
    """Dataset index for each of ``period`` slots, spreading dataset ``d`` evenly at rate ``weights[d]``.

    Dataset ``d``'s ``m``-th slot ideally sits at ``(m + 0.5) / w_d``; merging those
    ideal positions of all datasets and keeping the first ``period`` gives a pattern
    whose every prefix of length ``L`` holds ``L * w_d`` slots of ``d``, up to one.
    """
    w = np.asarray(weights, dtype=np.float64)
    keys, labels = [], []
    for d, wd in enumerate(w):
        # Enough candidates that the first `period` merged keys are the true first ones.
        m = np.arange(math.ceil(period * wd) + len(w) + 1, dtype=np.float64)
        keys.append((m + 0.5) / wd)
        labels.append(np.full(len(m), d, dtype=np.int64))
    key, label = np.concatenate(keys), np.concatenate(labels)
    order = np.lexsort((label, key))[:period]  # ties go to the lower dataset index
    return label[order]


# Which setting each ``GPTDataset.fingerprint`` key follows: a resume refused for a mismatch names it.
# "chunks" also follows seq_len and valid_fraction, so it is named only when nothing else differs.
FINGERPRINT_SET_BY = {
    "seq_len": "train.seq_len",
    "seed": "train.seed",
    "chunks": "samples per dataset (the data: data.paths, data.corpus, data.tokenizer, model.vocab_size or the "
              "files)",
    "weights": "data.weights (the blend)",
    "blend_period": "data.weights (the blend)",
    "split": "the split",
    "valid_fraction": "data.valid_fraction",
}


class GPTDataset:
    """Infinite, deterministic stream of ``seq_len + 1``-token samples; see module doc.

    ``sources``: one prefix / ``IndexedDataset`` or a list of them. ``weights``:
    blend weights (any positive scale, normalised here); ``None`` means in
    proportion to each dataset's sample count. ``model_vocab_size``: if given,
    every token id is checked to be below it (one pass over the data).
    """

    def __init__(
        self,
        sources: DatasetSource | Sequence[DatasetSource],
        weights: Sequence[float] | None = None,
        seq_len: int = 128,
        seed: int = 0,
        *,
        blend_period: int = DEFAULT_BLEND_PERIOD,
        model_vocab_size: int | None = None,
        split: str = "all",
        valid_fraction: float = 0.0,
    ) -> None:
        if isinstance(sources, (str, os.PathLike, IndexedDataset)):
            sources = [sources]
        if len(sources) == 0:
            raise DataError("GPTDataset needs at least one dataset prefix")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"seq_len={seq_len!r} must be a positive int")
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"seed={seed!r} must be a non-negative int")
        if blend_period < 1:
            raise DataError(f"blend_period={blend_period} must be >= 1")
        if split not in SPLITS:
            raise DataError(f"split={split!r} must be one of {SPLITS}")
        if split != "all" and not 0.0 < valid_fraction < 1.0:
            raise DataError(f"valid_fraction={valid_fraction!r}: a held-out split needs 0 < valid_fraction < 1")
        self.seq_len = seq_len
        self.seed = seed
        self.split = split
        self.valid_fraction = float(valid_fraction) if split != "all" else 0.0
        self.model_vocab_size = model_vocab_size
        self.datasets = [s if isinstance(s, IndexedDataset) else IndexedDataset(s) for s in sources]
        self.streams = [self._split_stream(ds) for ds in self.datasets]
        self.chunks = np.array([(len(s) - 1) // seq_len if len(s) else 0 for s in self.streams], dtype=np.int64)
        for ds, stream, n in zip(self.datasets, self.streams, self.chunks):
            if n < 1:
                raise DataError(
                    f"dataset {ds.prefix!r} has {len(stream)} tokens: too few for one sample of "
                    f"seq_len={seq_len} (needs seq_len + 1 = {seq_len + 1}); use a shorter seq_len or more data"
                )
        if model_vocab_size is not None:
            for ds in self.datasets:  # recorded at write time (sidecar; its writer refuses ids < 0), else sampled
                top = ds.max_token_id
                # No sidecar: a bounded sample now, every sample when it is read.
                low, top = (0, top) if top is not None else ds.sampled_token_range()
                check_token_ids(ds, low, top, model_vocab_size)
        self.weights = self._normalise_weights(weights)
        period = 1 if len(self.datasets) == 1 else blend_period
        self.pattern = blend_pattern(self.weights, period)
        self.per_period = np.bincount(self.pattern, minlength=len(self.datasets))
        for d, count in enumerate(self.per_period):
            if count == 0:
                raise DataError(
                    f"blend weight {self.weights[d]:.3g} of dataset {self.datasets[d].prefix!r} gets no sample "
                    f"in a blend period of {period}; raise the weight or blend_period"
                )
        # rank_in_period[p]: how many earlier slots of the period went to the same dataset.
        self.rank_in_period = np.zeros(period, dtype=np.int64)
        for d in range(len(self.datasets)):
            slots = self.pattern == d
            self.rank_in_period[slots] = np.arange(int(slots.sum()))
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _split_stream(self, ds: IndexedDataset) -> np.ndarray:
        """This split's part of ``ds``'s token stream (a view of the memmap: no token is read)."""
        stream = ds.token_stream()
        if self.split == "all":
            return stream
        n = len(stream)
        target = n - int(round(n * self.valid_fraction))
        need = self.seq_len + 1
        seq_starts = np.zeros(ds.num_sequences + 1, dtype=np.int64)
        np.cumsum(ds.sequence_lengths, dtype=np.int64, out=seq_starts[1:])
        doc_starts = seq_starts[np.asarray(ds.document_indices[:-1], dtype=np.int64)]
        cut = target
        j = int(np.searchsorted(doc_starts, target))
        candidates = [int(b) for b in doc_starts[max(j - 1, 0) : j + 1] if need <= b <= n - need]
        if candidates:
            cut = min(candidates, key=lambda b: abs(b - target))
        if cut < need or n - cut < need:
            raise DataError(
                f"dataset {ds.prefix!r} has {n} tokens: data.valid_fraction={self.valid_fraction} leaves "
                f"{cut} for training and {n - cut} for validation, each needs >= seq_len + 1 = {need}"
            )
        return stream[:cut] if self.split == "train" else stream[cut:]

    def _normalise_weights(self, weights: Sequence[float] | None) -> np.ndarray:
        if weights is None:
            return self.chunks / self.chunks.sum()
        w = np.asarray(check_weights("weights", list(weights), error=DataError), dtype=np.float64)
        if len(w) != len(self.datasets):
            raise DataError(f"weights={list(weights)} must have one entry per dataset ({len(self.datasets)})")
        return w / w.sum()

    @property
    def num_datasets(self) -> int:
        return len(self.datasets)

    @property
    def samples_per_epoch(self) -> int:
        """Chunks in all datasets together (one pass over every dataset)."""
        return int(self.chunks.sum())

    def fingerprint(self) -> dict:
        """What a resumed run must match for a sample id to mean the same sample (each key's
        setting, for a refused resume's message: ``FINGERPRINT_SET_BY``)."""
        out = {
            "seq_len": self.seq_len,
            "seed": self.seed,
            "chunks": [int(n) for n in self.chunks],
            "weights": [round(float(w), 12) for w in self.weights],
            "blend_period": len(self.pattern),
        }
        if self.split != "all":
            out.update(split=self.split, valid_fraction=self.valid_fraction)
        return out

    def _perm(self, d: int, epoch: int) -> np.ndarray:
        key = (d, epoch)
        if key in self._perms:
            self._perms.move_to_end(key)
            return self._perms[key]
        perm = np.random.default_rng([self.seed, d, epoch]).permutation(int(self.chunks[d]))
        self._perms[key] = perm
        if len(self._perms) > _PERM_CACHE_SIZE:
            self._perms.popitem(last=False)
        return perm

    def locate(self, sample_ids: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dataset, epoch, chunk)`` arrays for global sample ids."""
        k = np.asarray(sample_ids, dtype=np.int64)
        if k.size and k.min() < 0:
            raise DataError(f"sample ids must be >= 0, got {int(k.min())}")
        period = len(self.pattern)
        block, pos = np.divmod(k, period)
        d = self.pattern[pos]
        j = block * self.per_period[d] + self.rank_in_period[pos]
        epoch, local = np.divmod(j, self.chunks[d])
        chunk = np.empty_like(k)
        for dd, ee in np.unique(np.stack([d.ravel(), epoch.ravel()]), axis=1).T.tolist():
            sel = (d == dd) & (epoch == ee)
            chunk[sel] = self._perm(dd, ee)[local[sel]]
        return d, epoch, chunk

    def get_samples(self, sample_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Tokens ``int64 [n, seq_len + 1]`` of the given global sample ids."""
        k = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        d, _, chunk = self.locate(k)
        out = np.empty((len(k), self.seq_len + 1), dtype=np.int64)
        offsets = np.arange(self.seq_len + 1, dtype=np.int64)
        for dd in np.unique(d):
            sel = d == dd
            starts = chunk[sel] * self.seq_len
            out[sel] = self.streams[int(dd)][starts[:, None] + offsets]
            if self.model_vocab_size is not None:
                check_token_ids(self.datasets[int(dd)], int(out[sel].min()), int(out[sel].max()), self.model_vocab_size)
        return out

    def __getitem__(self, sample_id: int) -> np.ndarray:
        return self.get_samples([sample_id])[0]
