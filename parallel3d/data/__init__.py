"""Data pipeline: Megatron indexed datasets, tokenizers, the default corpus, GPT samples, DP batches.

Typical use by the trainer::

    from parallel3d.data import build_default_corpus, GPTDataset, DistributedBatchIterator

    prefix, tok = build_default_corpus(cache_dir, vocab_size=cfg.vocab_size,
                                       is_builder=(global_rank == 0))      # others wait
    dataset = GPTDataset([prefix], None, seq_len=cfg.seq_len, seed=seed,
                         model_vocab_size=cfg.vocab_size)
    batches = DistributedBatchIterator.for_rank(dataset, pstate, global_batch_size, micro_batch_size,
                                                start_sample=resumed.get("next_sample", 0))
    for step in range(steps):
        microbatches = next(batches)   # list of {"input_ids", "labels", "sample_ids"}
    checkpoint["data"] = batches.state_dict(); batches.load_state_dict(checkpoint["data"])

Contracts:
- ``build_default_corpus(cache_dir, vocab_size, seed=0, *, corpus="pydoc", tokenizer="bpe",
  is_builder=True, wait_timeout_s=600) -> (prefix, tokenizer)``: cached, atomic; non-builders
  poll for the builder's completion marker and fail with ``DataError`` on timeout.
- Tokenizers (``load_tokenizer("byte" | path)``, ``train_byte_level_bpe``) expose
  ``vocab_size``, ``eod_id``, ``encode``, ``decode``; ``check_vocab_fits(tok, model_vocab)``.
- ``IndexedDataset(prefix)`` / ``IndexedDatasetWriter`` / ``write_indexed_dataset``: our own
  reader/writer of Megatron's ``.bin``/``.idx`` format (megatron-core reads ours, we read theirs).
- ``GPTDataset(sources, weights, seq_len, seed)``: infinite deterministic stream of
  ``seq_len + 1`` token samples indexed by global sample id (shuffle per (seed, dataset, epoch),
  blend by weight). ``DistributedBatchIterator``: global step t consumes global samples
  ``[start + t*G, start + (t+1)*G)``; DP rank r takes a contiguous G/dp slice, cut into
  microbatches; same global batch for any dp. ``sample_ids`` are those global ids.
- Every bad input raises ``DataError`` (a ``ValueError``) naming the key, value and what is allowed.
"""

from parallel3d.data.batches import DistributedBatchIterator, document_eod_id
from parallel3d.data.corpus import CORPORA, build_default_corpus, corpus_documents
from parallel3d.data.errors import DataError
from parallel3d.data.gpt_dataset import GPTDataset, blend_pattern
from parallel3d.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    indexed_dataset_exists,
    token_dtype_for,
    write_indexed_dataset,
)
from parallel3d.data.preprocess import iter_documents, write_tokenized
from parallel3d.data.run_tokenizer import indexed_data_tokenizer, load_run_tokenizer, save_run_tokenizer
from parallel3d.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    check_vocab_fits,
    load_tokenizer,
    train_byte_level_bpe,
)

__all__ = [
    "CORPORA",
    "ByteTokenizer",
    "DataError",
    "DistributedBatchIterator",
    "GPTDataset",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "Tokenizer",
    "blend_pattern",
    "build_default_corpus",
    "check_vocab_fits",
    "corpus_documents",
    "document_eod_id",
    "indexed_data_tokenizer",
    "indexed_dataset_exists",
    "iter_documents",
    "load_run_tokenizer",
    "load_tokenizer",
    "save_run_tokenizer",
    "token_dtype_for",
    "train_byte_level_bpe",
    "write_indexed_dataset",
    "write_tokenized",
]
