"""Megatron's blends (``--data-path 0.3 A 0.7 B``, or prefixes alone) with ``--split``: the
samples of each split of several indexed datasets, in Megatron's order
(``BlendedMegatronDatasetBuilder`` with ``GPTDataset`` and ``BlendedDataset``).

  * Each prefix is split by documents (``gpt_order.split_documents``), and each of its
    splits ordered by ``gpt_order.build_order`` with the same seed.
  * With weights (normalised), dataset d is built for ceil(ceil(n * w_d) * (1 + surplus))
    samples of a split asked n samples, and the blend holds sum_d ceil(n * w_d) samples.
  * Prefixes alone: each dataset is one epoch of its split, its weight its sample count,
    and the blend min(n, their sum) samples.
  * Blend sample j comes from the dataset whose share lags most: argmax_d of
    w_d * max(j, 1) - (samples taken from d so far), the lowest d on ties; it is that
    dataset's next sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fxmeg.data import cache
from fxmeg.data.gpt_order import GPTOrder, normalise, sample, split_documents
from fxmeg.data.indexed import IndexedDataset

SURPLUS = 0.005
"""Megatron's mid_level_dataset_surplus: each dataset is built for this share more samples."""


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blend sample, its sample index in that dataset) for ``size`` samples."""
    # Python floats: the same doubles as Megatron's C++, without numpy's per-call cost
    w = [float(x) for x in weights]
    taken = [0] * len(w)
    dataset, within = [0] * size, [0] * size
    others = range(1, len(w))
    for j in range(size):
        x = max(float(j), 1.0)
        best, error = 0, w[0] * x - taken[0]
        for d in others:
            e = w[d] * x - taken[d]
            if e > error:
                best, error = d, e
        dataset[j], within[j] = best, taken[best]
        taken[best] += 1
    return np.asarray(dataset, dtype=np.int16), np.asarray(within, dtype=np.int64)


@dataclass(frozen=True)
class Part:
    """One dataset's split: its data and sample order."""

    data: IndexedDataset
    order: GPTOrder


@dataclass(frozen=True)
class Blended:
    """One split of a blend: ``tokens(j)`` is blend sample j (seq_len + 1 tokens)."""

    parts: list[Part]
    dataset: np.ndarray
    within: np.ndarray
    seq_len: int

    def __len__(self) -> int:
        return len(self.dataset)

    def tokens(self, j: int) -> np.ndarray:
        part = self.parts[int(self.dataset[j])]
        return sample(lambda d: part.data[d], part.order, int(self.within[j]), seq_len=self.seq_len)


def build_blend(prefixes: Sequence[str], weights: Sequence[float] | None, split: str,
                sizes: Sequence[int | None], *, seq_len: int, seed: int,
                open: Callable[[str], IndexedDataset] = IndexedDataset,
                cache_path: str = "") -> list[Blended | None]:
    """Each split (train, valid, test) of the blend of ``prefixes`` (None where the split
    has weight 0 or is asked 0 samples: not built), asked ``sizes`` samples each; ``open``
    reads a prefix; the indices go through the cache in ``cache_path`` (fxmeg/data/cache.py)."""
    datas = [open(p) for p in prefixes]
    ranges = [split_documents(split, d.num_documents) for d in datas]
    if weights is not None:
        weights = normalise(weights)
    out: list[Blended | None] = []
    for i, size in enumerate(sizes):
        if ranges[0][i] is None or size == 0:
            out.append(None)
            continue
        if weights is not None:
            if size is None:
                raise ValueError("a blend with weights needs the number of samples of each split")
            asked = [math.ceil(size * w) for w in weights]
            built = [int(math.ceil(a * (1 + SURPLUS))) for a in asked]
            parts = [_part(d, r[i], seq_len, n, seed, cache_path) for d, r, n in zip(datas, ranges,
                                                                                     built)]
            share, count = normalise(weights), sum(asked)  # Megatron normalises them twice
        else:
            parts = [_part(d, r[i], seq_len, None, seed, cache_path) for d, r in zip(datas, ranges)]
            lengths = [len(p.order) for p in parts]
            empty = [prefixes[d] for d, n in enumerate(lengths) if n == 0]
            if empty:
                raise ValueError(
                    f"{empty[0]!r} holds no sample of {seq_len + 1} tokens in split {i} of "
                    f"{split!r}: a "
                                 "blend of prefixes alone weighs each by its samples; give the "
                                 "split more weight")
            if size is None:
                raise ValueError(
                    "fxmeg reads a blend of prefixes only for a given number of samples")
            count = min(size, sum(lengths))
            share = normalise(lengths)
        dataset, within = cache.cached(cache_path, "Blend", {"weights": share, "samples": count},
                                       cache.BLEND,
                                       lambda: blending_indices(share, count))
        for d, part in enumerate(parts):
            needed = int(np.sum(dataset == d))
            if needed > len(part.order):
                raise ValueError(
                    f"the blend takes {needed} samples from {prefixes[d]!r}, which holds "
                                 f"{len(part.order)} for this split")
        out.append(Blended(parts, dataset, within, seq_len))
    return out


def _part(data: IndexedDataset, documents: tuple[int, int], seq_len: int, num_samples: int | None,
          seed: int, cache_path: str) -> Part:
    return Part(
        data,
        cache.order(
            cache_path, data, documents, seq_len=seq_len, num_samples=num_samples, seed=seed
        ),
    )
