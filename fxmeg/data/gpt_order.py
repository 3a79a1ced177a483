"""Megatron's GPT sample order over one indexed dataset (``GPTDataset``'s document, sample
and shuffle indices), written here in numpy so that a run reads Megatron's samples in
Megatron's order (tests/data/test_gpt_order.py compares both, index by index and token by token).

For the documents of a split (one sequence each), ``num_samples`` samples of
``seq_len + extra`` tokens (``extra`` = 1: inputs and labels are the same window shifted by
one) that run across document boundaries:

  epochs          the fewest whole passes over the split's tokens that hold
                  num_samples * seq_len + extra tokens
  document index  each epoch's documents, shuffled (``numpy.random.RandomState(seed)``);
                  with more than one epoch, when the last epoch contributes fewer than
                  80% of an epoch's samples, the earlier epochs are shuffled together and
                  the last one apart, so a short final epoch does not repeat documents
                  of the earlier ones more than once
  sample index    where sample k starts: token k * seq_len of the documents laid end to end
                  in document-index order, as (position in the document index, offset)
  shuffle index   a permutation of the samples by the same random state (the final
                  epoch's samples permuted apart when it was shuffled apart)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

LAST_EPOCH_THRESHOLD = 0.80
"""A final epoch contributing fewer than this share of an epoch's samples is shuffled apart."""


@dataclass(frozen=True)
class GPTOrder:
    document_index: np.ndarray
    """int32: document ids in the order their tokens are laid end to end."""
    sample_index: np.ndarray
    """(samples + 1, 2): (position in ``document_index``, token offset) where each sample
    starts; the last row ends the last sample."""
    shuffle_index: np.ndarray
    """The order samples are read in."""
    epochs: int
    """Megatron's num_epochs: the passes over the split's documents the document index lays
    end to end (the last one maybe partly read)."""

    def __len__(self) -> int:
        return len(self.shuffle_index)


def build_order(
    lengths: np.ndarray,
    documents: np.ndarray,
    *,
    seq_len: int,
    num_samples: int | None,
    seed: int,
    extra: int = 1,
    drop_last: bool = True,
) -> GPTOrder:
    """The order of ``num_samples`` samples (None: one epoch's) of ``seq_len + extra``
    tokens over ``documents`` (ids into ``lengths``, the sequences' token counts); ``drop_last``
    False keeps a last partial sample (Megatron's validation default drops it too)."""
    tokens_per_epoch = int(np.sum(lengths[documents], dtype=np.int64))
    if tokens_per_epoch <= extra:  # Megatron's builder loops forever here
        raise ValueError(
            f"{len(documents)} documents of {tokens_per_epoch} tokens hold no sample of "
            f"{seq_len + extra} tokens; give that split more weight or more data"
        )
    epochs = 1
    if num_samples is not None:
        needed = num_samples * seq_len + extra
        epochs = max(1, -(-needed // tokens_per_epoch))
    separate = False
    if epochs > 1:
        before_last = ((epochs - 1) * tokens_per_epoch - extra) // seq_len
        per_epoch = (tokens_per_epoch - extra) // seq_len
        separate = num_samples - before_last < int(LAST_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = _document_index(documents, epochs, rng, separate)
    sample_index = _sample_index(
        lengths, document_index, seq_len, epochs * tokens_per_epoch, extra, drop_last
    )
    total = len(sample_index) - 1
    first = before_last if separate else total
    return GPTOrder(document_index, sample_index, _shuffle_index(first, total, rng), epochs)


def normalise(weights) -> list[float]:
    """Weights over their sum, in float64 as Megatron's ``normalize`` computes them (the
    blending index compares them exactly)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_documents(split: str, count: int) -> list[tuple[int, int] | None]:
    """Megatron's ``--split`` ("969,30,1", weights of train, valid and test; missing ones
    are 0): the document range [begin, end) of each split of ``count`` documents, None for
    a split of weight 0. Bookends are the cumulative normalised weights, rounded to
    documents."""
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    if len(weights) > 3 or not weights or sum(weights) <= 0:
        raise ValueError(
            f"split {split!r} must give one to three non-negative weights of train, valid and test "
            "with a positive sum, e.g. '969,30,1'"
        )
    weights = normalise(weights + [0.0] * (3 - len(weights)))
    edges = [0.0]
    for w in weights:
        edges.append(edges[-1] + w)
    return [(int(round(lo * count)), int(round(hi * count))) if hi > lo else None
            for lo, hi in zip(edges[:-1], edges[1:])]


def _document_index(
    documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate: bool
) -> np.ndarray:
    if separate:
        return np.concatenate([_document_index(documents, epochs - 1, rng, False),
                               _document_index(documents, 1, rng, False)])
    index = np.tile(np.asarray(documents), epochs).astype(np.int32)
    rng.shuffle(index)
    return index


def _sample_index(
    lengths: np.ndarray,
    document_index: np.ndarray,
    seq_len: int,
    tokens: int,
    extra: int,
    drop_last: bool,
) -> np.ndarray:
    """Sample k starts at token k * seq_len of the documents end to end: in the document
    whose span [start, end) holds it (an empty document holds nothing), at that offset. A
    kept partial last sample ends at the last document's end less ``extra``."""
    count = (tokens - extra) // seq_len if drop_last else -(-(tokens - extra) // seq_len)
    sizes = lengths[document_index].astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    positions = np.minimum(np.arange(count + 1, dtype=np.int64) * seq_len, tokens - extra)
    where = np.searchsorted(starts, positions, side="right") - 1
    dtype = (
        np.int32
        if len(document_index) < np.iinfo(np.int32).max and tokens < np.iinfo(np.int32).max
        else np.int64
    )
    return np.stack([where, positions - starts[where]], axis=1).astype(dtype)


def _shuffle_index(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


def sample(
    tokens_of, order: GPTOrder, i: int, *, seq_len: int, extra: int = 1, pad: int = 0
) -> np.ndarray:
    """The ``seq_len + extra`` tokens of the ``i``-th sample read (``tokens_of(doc)``: a
    document's tokens), padded with ``pad`` when a kept partial sample is short."""
    k = int(order.shuffle_index[i])
    (d0, o0), (d1, o1) = order.sample_index[k], order.sample_index[k + 1]
    parts = []
    for d in range(int(d0), int(d1) + 1):
        doc = tokens_of(int(order.document_index[d]))
        lo = int(o0) if d == d0 else 0
        parts.append(doc[lo : int(o1) + extra] if d == d1 else doc[lo:])
    out = np.concatenate(parts)
    if len(out) < seq_len + extra:
        out = np.concatenate([out, np.full(seq_len + extra - len(out), pad, dtype=out.dtype)])
    return out
