"""Which keys of a microbatch each pipeline stage reads: the one contract between the
batch iterator (``parallel3d.data.batches``) and the engine (``pipeline.engine``).

A microbatch is a dict of int64 tensors:

- ``sample_ids`` ``[mb]``: global sample index of each row. Every stage needs it:
  dropout masks are seeded by (seed, step, sample id, layer), whatever the layout.
- ``input_ids`` ``[mb, s]``: only the stage holding the first model chunk (the
  embedding), i.e. pipeline stage 0.
- ``labels`` ``[mb, s]``: only the stage holding the last model chunk (head and
  loss), i.e. pipeline stage ``pp - 1`` (with interleaving too: its last chunk is the
  model's last).

With ``pp == 1`` one stage is both and reads all three. Middle stages read only
``sample_ids`` and never touch the token stream, except with ``data.document_mask``:
- ``document_ids`` ``[mb, s]`` (every stage, the whole sequence even with context
  parallel): which packed document each token belongs to (attention stays inside it).

On the host, ``input_ids`` and ``labels`` share the step's one ``[N, s+1]`` token buffer exactly when
``ids_share_step_buffer`` says so; the data path, the dry run and the planner all ask it.
"""

from __future__ import annotations

SAMPLE_IDS = "sample_ids"
INPUT_IDS = "input_ids"
LABELS = "labels"
DOCUMENT_IDS = "document_ids"
ALL_KEYS = (INPUT_IDS, LABELS, SAMPLE_IDS, DOCUMENT_IDS)
TOKEN_KEYS = (INPUT_IDS, LABELS, DOCUMENT_IDS)


def document_kwargs(microbatch: dict) -> dict:
    """The chunk call's ``document_ids=`` when the microbatch carries them (data.document_mask);
    nothing otherwise, so modules without packed documents need not take the keyword."""
    return {DOCUMENT_IDS: microbatch[DOCUMENT_IDS]} if DOCUMENT_IDS in microbatch else {}


def key_shape(key: str, micro_batch_size: int, seq_len: int, cp: int = 1) -> tuple[int, ...]:
    """The shape of ``key`` of one microbatch as the engine gets it on a rank of ``cp`` context-parallel ranks:
    ``[mb]`` sample ids; ``[mb, s/cp]`` token ids and labels (the rank's share); ``[mb, s]`` document ids (the
    whole sequence, on every cp rank). The one shape rule: the dry run's meta step and the planner read it."""
    if key == SAMPLE_IDS:
        return (micro_batch_size,)
    if key not in TOKEN_KEYS:
        raise ValueError(f"{key!r} is not a microbatch key ({ALL_KEYS})")
    return (micro_batch_size, seq_len if key == DOCUMENT_IDS else seq_len // cp)


def with_documents(keys: tuple[str, ...], documents: bool) -> tuple[str, ...]:
    """The keys the step's microbatches carry: a stage's ``keys`` and, with ``data.document_mask``
    (``documents``), the document ids, which every stage reads."""
    return keys + ((DOCUMENT_IDS,) if documents else ())


def stage_keys(is_first_stage: bool, is_last_stage: bool) -> tuple[str, ...]:
    """The keys a stage reads, in ``ALL_KEYS`` order."""
    keys = []
    if is_first_stage:
        keys.append(INPUT_IDS)
    if is_last_stage:
        keys.append(LABELS)
    keys.append(SAMPLE_IDS)
    return tuple(keys)


def ids_share_step_buffer(micro_batch_size: int, cp: int) -> bool:
    """Whether a host microbatch's token ids and labels are views of the step's one ``[N, s+1]`` token buffer
    (``data.batches.split_step``) rather than storages of their own: a one-row slice is contiguous already, so
    nothing copies it; wider microbatches are copied to be contiguous, and cp cuts each into new tensors of
    its share (``Trainer._to_device``)."""
    return micro_batch_size == 1 and cp == 1
