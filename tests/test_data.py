"""The corpus format, samples and samplers."""

import numpy as np
import pytest
import torch

from fxmeg.data import ByteTokenizer, Corpus, Sampler, Samples, prepare


@pytest.fixture
def corpus(tmp_path):
    docs = [f"document {i}: " + "abc" * (i + 5) for i in range(40)]
    prepare(docs, str(tmp_path / "c"), ByteTokenizer())
    return docs, Corpus(str(tmp_path / "c"))


def test_corpus_round_trip(corpus):
    docs, c = corpus
    tok = ByteTokenizer()
    assert c.meta["num_documents"] == 40 and c.vocab_size == 257
    ends = list(c.doc_starts[1:]) + [len(c)]
    for doc, start, end in zip(docs, c.doc_starts, ends):
        ids = c.tokens[start:end].tolist()
        assert ids[-1] == tok.eos_id and tok.decode(ids[:-1]) == doc


def test_truncated_corpus_is_detected(tmp_path):
    prepare(["hello world"] * 3, str(tmp_path / "c"), ByteTokenizer())
    data = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="c.bin holds 68 bytes, but .*c.idx says its sequences end at byte 72: "
                                         "the .bin is truncated"):
        Corpus(str(tmp_path / "c"))


def test_samples_are_windows_shifted_by_one(corpus):
    _, c = corpus
    train = Samples(c, 16, split="train", valid_fraction=0.2)
    valid = Samples(c, 16, split="valid", valid_fraction=0.2)
    ids, labels = train.batch([0, 3])
    assert ids.shape == (2, 16) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    assert torch.equal(ids[1], torch.from_numpy(c.tokens[48:64].astype(np.int64)))
    assert len(train) > len(valid) > 0
    boundary = len(c.tokens) - len(valid.tokens)
    assert boundary in set(c.doc_starts.tolist())  # the split falls on a document start


def test_sampler_resumes_the_same_stream():
    full = Sampler(100, seed=7, shuffle=True).indices(0, 350)
    for k in (0, 1, 99, 100, 137, 250):
        assert Sampler(100, seed=7, shuffle=True).indices(k, 100) == full[k : k + 100]


def test_no_sample_repeats_within_an_epoch():
    s = Sampler(100, seed=7, shuffle=True)
    first, second = s.indices(0, 100), s.indices(100, 100)
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != second  # a new permutation every epoch
    assert Sampler(100, seed=8, shuffle=True).indices(0, 100) != first
    assert Sampler(10, seed=7, shuffle=False).indices(8, 4) == [8, 9, 0, 1]
