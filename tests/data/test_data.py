"""The corpus `fxmeg prepare-data` writes (the trainer's samples: tests/data/test_train_data.py)."""

import pytest

from fxmeg.data.corpus import Corpus, prepare
from fxmeg.data.tokenizer import ByteTokenizer


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
    with pytest.raises(
        ValueError,
        match="c.bin holds 68 bytes, but .*c.idx says its sequences end at byte 72: "
        "the .bin is truncated",
    ):
        Corpus(str(tmp_path / "c"))
