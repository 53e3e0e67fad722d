"""Per-step batches of one data-parallel rank, independent of the layout.

Invariant: global step ``t`` (counted from ``start_sample``) consumes the global
sample ids ``[start + t*G, start + (t+1)*G)``. DP rank ``r`` of ``dp`` takes the
contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of it, cut into microbatches of
``micro_batch_size`` in order. So the union over DP ranks of one step is the
same global batch for any ``dp`` and any micro-batch size; TP ranks of one
replica (same ``dp_rank``) get identical batches. Each pipeline stage gets the
keys ``parallel3d.pipeline.microbatch.stage_keys`` says it reads (middle stages:
only ``sample_ids``, which seed dropout, and no token is read for them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from parallel3d.data.errors import DataError
from parallel3d.data.gpt_dataset import FINGERPRINT_SET_BY, GPTDataset
from parallel3d.context_parallel.documents import document_ids
from parallel3d.pipeline.microbatch import (
    ALL_KEYS, DOCUMENT_IDS, INPUT_IDS, LABELS, SAMPLE_IDS, TOKEN_KEYS, stage_keys,
)

if TYPE_CHECKING:
    from parallel3d.parallel_state import ParallelState

Microbatch = dict[str, torch.Tensor]


def document_eod_id(document_mask: bool, tokenizer: Any) -> int | None:
    """The end-of-document id ``data.document_mask`` cuts documents at (None: no mask); the data's
    tokenizer is the only source of that id, so a masked job without one is a ``DataError``."""
    if not document_mask:
        return None
    if tokenizer is None:
        raise DataError("data.document_mask=true: needs the data's tokenizer for its end-of-document id "
                        "(data.tokenizer_file)")
    return int(tokenizer.eod_id)


class DistributedBatchIterator:
    """Yields, per optimizer step, this DP rank's list of microbatch dicts.

    Each microbatch is ``{"input_ids": int64 [mb, s], "labels": int64 [mb, s],
    "sample_ids": int64 [mb]}`` restricted to ``keys`` (``sample_ids`` is always
    there; see ``pipeline.microbatch``). The iterator never ends: the dataset repeats with a fresh shuffle per
    epoch. ``state_dict()`` records the next unseen global sample.
    """

    def __init__(
        self,
        dataset: GPTDataset,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        start_sample: int = 0,
        *,
        keys: tuple[str, ...] = ALL_KEYS[:3],
        eod_id: int | None = None,
    ) -> None:
        for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size),
                            ("dp_size", dp_size)):
            if not isinstance(value, int) or value < 1:
                raise DataError(f"{name}={value!r} must be a positive int")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch_size % (micro_batch_size * dp_size):
            raise DataError(
                f"global_batch_size={global_batch_size} must be a multiple of "
                f"micro_batch_size * dp_size = {micro_batch_size} * {dp_size}"
            )
        if not isinstance(start_sample, int) or start_sample < 0:
            raise DataError(f"start_sample={start_sample!r} must be a non-negative int")
        unknown = [k for k in keys if k not in ALL_KEYS]
        if unknown or SAMPLE_IDS not in keys:
            raise DataError(f"keys={tuple(keys)}: must include {SAMPLE_IDS!r} and come from {ALL_KEYS}")
        if DOCUMENT_IDS in keys and eod_id is None:
            raise DataError(f"keys={tuple(keys)}: {DOCUMENT_IDS!r} needs the tokenizer's end-of-document id (eod_id)")
        self.eod_id = eod_id
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.keys = tuple(k for k in ALL_KEYS if k in keys)
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        self.next_sample = start_sample

    @classmethod
    def for_rank(
        cls,
        dataset: GPTDataset,
        pstate: "ParallelState",
        global_batch_size: int,
        micro_batch_size: int,
        start_sample: int = 0,
        keys: tuple[str, ...] | None = None,
        eod_id: int | None = None,
    ) -> "DistributedBatchIterator":
        """The iterator of this process: its DP coordinate and its pipeline stage's keys (``keys``: the
        engine's ``microbatch_keys`` where the schedule places the first or last model chunk elsewhere)."""
        return cls(
            dataset, global_batch_size, micro_batch_size, pstate.coord("dp"), pstate.size("dp"), start_sample,
            keys=stage_keys(pstate.is_first_stage, pstate.is_last_stage) if keys is None else keys, eod_id=eod_id,
        )

    def local_sample_ids(self, step_start: int) -> np.ndarray:
        """Global ids of this rank's samples for the step starting at ``step_start``."""
        per_rank = self.global_batch_size // self.dp_size
        first = step_start + self.dp_rank * per_rank
        return np.arange(first, first + per_rank, dtype=np.int64)

    def __iter__(self) -> Iterator[list[Microbatch]]:
        return self

    def __next__(self) -> list[Microbatch]:
        ids = self.local_sample_ids(self.next_sample)
        needs_tokens = any(k in self.keys for k in TOKEN_KEYS)
        tokens = torch.from_numpy(self.dataset.get_samples(ids)) if needs_tokens else None
        microbatches = split_step(tokens, torch.from_numpy(ids), self.keys, self.num_microbatches,
                                  self.micro_batch_size, self.eod_id)
        self.next_sample += self.global_batch_size
        return microbatches

    @property
    def consumed_samples(self) -> int:
        return self.next_sample

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample, "dataset": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue at ``state["next_sample"]``; with ``strict``, the dataset must match the saved one."""
        if "next_sample" not in state:
            raise DataError(f"data state has no 'next_sample' (keys: {sorted(state)})")
        saved = state.get("dataset")
        current = self.dataset.fingerprint()
        if strict and saved is not None and saved != current:
            keys = [k for k in [*current, *(k for k in saved if k not in current)] if saved.get(k) != current.get(k)]
            if len(keys) > 1 and "chunks" in keys:  # a consequence of the others (FINGERPRINT_SET_BY)
                keys.remove("chunks")
            changed = "; ".join(f"{FINGERPRINT_SET_BY.get(k, k)}: {saved.get(k)} there, {current.get(k)} here"
                                for k in keys)
            raise DataError(
                f"the checkpoint's data order differs from this run's ({changed}), so its sample ids would mean "
                "other samples: resume with the checkpoint's settings, or start a new run (another "
                "train.out_dir)"
            )
        next_sample = state["next_sample"]
        if not isinstance(next_sample, int) or next_sample < 0:
            raise DataError(f"data state next_sample={next_sample!r} must be a non-negative int")
        self.next_sample = next_sample


def split_step(tokens: torch.Tensor | None, sample_ids: torch.Tensor, keys: tuple[str, ...], num_microbatches: int,
               micro_batch_size: int, eod_id: int | None = None) -> list[Microbatch]:
    """One step's token rows ``[N, s+1]`` (None where no token key is read) and sample ids ``[N]`` cut into
    microbatches of ``keys``. ``contiguous`` copies only a slice that is not contiguous already, so the ids and
    labels are views of ``tokens`` exactly where ``ids_share_step_buffer`` says (the engine counts the storages
    once per step); the dry run cuts its meta step here too."""
    microbatches = []
    for j in range(num_microbatches):
        rows = slice(j * micro_batch_size, (j + 1) * micro_batch_size)
        mb: Microbatch = {}
        if INPUT_IDS in keys:
            mb[INPUT_IDS] = tokens[rows, :-1].contiguous()
        if LABELS in keys:
            mb[LABELS] = tokens[rows, 1:].contiguous()
        mb[SAMPLE_IDS] = sample_ids[rows].clone()
        if DOCUMENT_IDS in keys:
            mb[DOCUMENT_IDS] = document_ids(tokens[rows, :-1], eod_id)
        microbatches.append(mb)
    return microbatches
