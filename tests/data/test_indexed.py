"""Megatron's indexed dataset format against megatron-core's own reader and writer (the
oracle, a test dependency only): what Megatron's IndexedDatasetBuilder writes fxmeg reads
sequence by sequence, what ``fxmeg prepare-data`` writes Megatron's IndexedDataset reads,
fxmeg's older corpus format still reads, and a broken pair is refused naming the file."""

from __future__ import annotations

import os
import struct
import warnings

import numpy as np
import pytest
import torch

from fxmeg.data.corpus import Corpus, prepare, read_documents
from fxmeg.data.indexed import IndexedDataError, IndexedDataset, is_indexed
from fxmeg.data.tokenizer import ByteTokenizer

with warnings.catch_warnings():  # megatron-core warns that transformer-engine and apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def _documents(rng: np.random.Generator, high: int) -> list[list[np.ndarray]]:
    """Documents of one to three sequences each, some of one token."""
    return [
        [
            rng.integers(0, high, size=int(rng.integers(1, 40)))
            for _ in range(int(rng.integers(1, 4)))
        ]
        for _ in range(30)
    ]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64])
@pytest.mark.parametrize("multimodal", [False, True])
def test_fxmeg_reads_what_megatron_writes(tmp_path, dtype, multimodal):
    prefix = str(tmp_path / "data")
    docs = _documents(np.random.default_rng(0), min(np.iinfo(dtype).max, 50_000))
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for d, doc in enumerate(docs):
        for s, seq in enumerate(doc):
            builder.add_item(
                torch.from_numpy(seq.astype(np.int64)), (d + s) % 3
            ) if multimodal else builder.add_item(torch.from_numpy(seq.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ours, theirs = IndexedDataset(prefix), MegatronDataset(prefix, multimodal=multimodal)
    assert is_indexed(prefix) and ours.dtype == np.dtype(dtype) and len(ours) == len(theirs)
    flat = [seq for doc in docs for seq in doc]
    for i, seq in enumerate(flat):
        assert np.array_equal(ours[i], seq.astype(dtype))
    assert np.array_equal(ours.document_index, theirs.document_indices)
    assert np.array_equal(ours.lengths, theirs.sequence_lengths)
    assert np.array_equal(ours.pointers, theirs.index.sequence_pointers)
    assert ours.num_documents == len(docs)
    assert (ours.modes is not None) == multimodal
    if multimodal:
        assert np.array_equal(ours.modes, theirs.index.sequence_modes)
    starts = np.cumsum([0] + [sum(len(s) for s in doc) for doc in docs[:-1]])
    assert np.array_equal(ours.document_starts(), starts)


def test_megatron_reads_what_fxmeg_prepares(tmp_path):
    prefix = str(tmp_path / "corpus")
    tokenizer = ByteTokenizer()
    meta = prepare(read_documents(["pydoc:topics"]), prefix, tokenizer)
    theirs = MegatronDataset(prefix)
    texts = [t for t in read_documents(["pydoc:topics"]) if tokenizer.encode(t)]
    assert len(theirs) == meta["num_documents"] == len(texts)
    assert np.array_equal(theirs.document_indices, np.arange(len(texts) + 1))
    for i, text in enumerate(texts):
        assert theirs[i].tolist() == tokenizer.encode(text) + [tokenizer.eos_id]
    corpus = Corpus(prefix)
    assert len(corpus) == meta["num_tokens"] == int(theirs.sequence_lengths.sum())
    assert np.array_equal(corpus.doc_starts, theirs.index.sequence_pointers // 2)  # uint16


def test_the_older_fxmeg_format_still_reads(tmp_path):
    """``PREFIX.idx`` raw int64 document starts (no magic) and ``PREFIX.bin`` the tokens."""
    prefix = str(tmp_path / "old")
    tokens = np.arange(10, dtype=np.uint16)
    tokens.tofile(prefix + ".bin")
    np.asarray([0, 4], dtype=np.int64).tofile(prefix + ".idx")
    with open(prefix + ".json", "w") as f:
        f.write('{"dtype": "uint16", "num_tokens": 10, "vocab_size": 16, "eos_id": 15}')
    corpus = Corpus(prefix)
    assert (
        not is_indexed(prefix)
        and corpus.doc_starts.tolist() == [0, 4]
        and corpus.tokens.tolist() == list(range(10))
    )


def _broken(tmp_path, how: str) -> str:
    prefix = str(tmp_path / "data")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in (5, 7):
        builder.add_item(torch.arange(n))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    if how == "truncated-bin":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(os.path.getsize(prefix + ".bin") - 2)
    elif how in ("version", "dtype-code"):
        with open(prefix + ".idx", "r+b") as f:
            f.seek(9 if how == "version" else 17)
            f.write(struct.pack("<Q", 2) if how == "version" else bytes([9]))
    elif how == "truncated-idx":
        with open(prefix + ".idx", "r+b") as f:
            f.truncate(os.path.getsize(prefix + ".idx") - 8)
    elif how == "magic":
        with open(prefix + ".idx", "r+b") as f:
            f.write(b"NOTMEGA")
    return prefix


@pytest.mark.parametrize(
    "how, message",
    [
        (
            "truncated-bin",
            (
                "data.bin holds 22 bytes, but {p}.idx says its sequences end at byte 24: the .bin "
                "is "
                "truncated"
            ),
        ),
        ("version", "data.idx is version 2 of the indexed format; fxmeg reads version 1"),
        ("dtype-code", "data.idx names token dtype code 9, not one of"),
        (
            "truncated-idx",
            (
                "data.idx holds 74 bytes, but its header (2 sequences, 3 document index entries) "
                "needs "
                "82"
            ),
        ),
        ("magic", "data.idx is not Megatron's indexed format"),
    ],
)
def test_a_broken_pair_is_refused_naming_the_file(tmp_path, how, message):
    prefix = _broken(tmp_path, how)
    with pytest.raises(IndexedDataError) as err:
        IndexedDataset(prefix)
    assert message.format(p=prefix) in str(err.value), str(err.value)
