"""Our Megatron indexed-dataset reader/writer: round trip, interop with megatron-core, errors."""

from __future__ import annotations

import numpy as np
import pytest

from parallel3d.data import DataError, IndexedDataset, IndexedDatasetWriter, write_indexed_dataset


def _random_docs(rng: np.random.Generator, n: int, vocab: int) -> list[np.ndarray]:
    # Include an empty document: the format allows zero-length sequences.
    lengths = [0] + list(rng.integers(1, 50, size=n - 1))
    return [rng.integers(0, vocab, size=int(k)) for k in lengths]


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 65000), (np.int32, 200_000)])
def test_round_trip(tmp_path, dtype, vocab):
    rng = np.random.default_rng(0)
    docs = _random_docs(rng, 20, vocab)
    prefix = write_indexed_dataset(tmp_path / "d", docs, dtype=dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert ds.num_documents == len(docs) == ds.num_sequences
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.get_document(i), doc)
        np.testing.assert_array_equal(ds[i], doc)
    assert ds.is_contiguous()
    np.testing.assert_array_equal(ds.token_stream(), np.concatenate(docs))
    assert ds.num_tokens == sum(len(d) for d in docs)
    assert not list(tmp_path.glob("*.tmp*")), "temporaries must be renamed away"


@pytest.mark.slow
def test_megatron_core_interop(tmp_path):
    """megatron-core reads what we write identically, and we read what its builder writes."""
    import megatron.core.datasets.indexed_dataset as mc  # a dev dependency (costly import: only here)
    import torch
    rng = np.random.default_rng(1)
    docs = _random_docs(rng, 15, 50000)

    ours = write_indexed_dataset(tmp_path / "ours", docs, dtype=np.uint16)
    theirs_view = mc.IndexedDataset(ours, mmap=True)
    assert len(theirs_view) == len(docs)
    np.testing.assert_array_equal(theirs_view.document_indices, np.arange(len(docs) + 1))
    np.testing.assert_array_equal(theirs_view.sequence_lengths, [len(d) for d in docs])
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs_view[i], doc)
        np.testing.assert_array_equal(theirs_view.get(i, offset=0, length=len(doc)), doc)

    # Their builder, with multi-sequence documents (add_item x k, end_document) and int32.
    builder = mc.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.int32)
    expected_docs = []
    for d in range(6):
        parts = [rng.integers(0, 100_000, size=int(rng.integers(1, 30))) for _ in range(d % 3 + 1)]
        for part in parts:
            builder.add_item(torch.from_numpy(part))
        builder.end_document()
        expected_docs.append(np.concatenate(parts))
    builder.finalize(str(tmp_path / "theirs.idx"))
    ds = IndexedDataset(tmp_path / "theirs")
    assert ds.dtype == np.dtype(np.int32)
    assert ds.num_documents == 6
    for d, doc in enumerate(expected_docs):
        np.testing.assert_array_equal(ds.get_document(d), doc)
    np.testing.assert_array_equal(ds.token_stream(), np.concatenate(expected_docs))


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(DataError, match=r"nope\.idx.*does not exist"):
        IndexedDataset(tmp_path / "nope")
    prefix = write_indexed_dataset(tmp_path / "d", [np.arange(5)])
    idx = tmp_path / "d.idx"
    raw = idx.read_bytes()
    idx.write_bytes(b"XXXXXXX\x00\x00" + raw[9:])
    with pytest.raises(DataError, match="bad magic"):
        IndexedDataset(prefix)
    idx.write_bytes(raw[:-8])
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(prefix)
    idx.write_bytes(raw[:5])
    with pytest.raises(DataError, match="too short"):
        IndexedDataset(prefix)


def test_writer_rejects_ids_outside_dtype(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    with pytest.raises(DataError, match="does not fit dtype uint16"):
        writer.add_document([1, 70000])
    writer.abort()
    with pytest.raises(DataError, match="not in the indexed format"):
        IndexedDatasetWriter(tmp_path / "e", np.uint32)
