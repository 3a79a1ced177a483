"""Fixed-length samples of seq_len + 1 tokens, and samplers over them.

The corpus's token stream is split at a document boundary into a train and a valid
region; sample i of a region is tokens [i * seq_len, i * seq_len + seq_len + 1) of it, so
that input ids and labels are the same window shifted by one.

A ``Sampler`` walks an endless stream of sample indices: epoch e is a permutation of all
samples seeded by (seed, e) (or the identity without shuffling). Position p of the
stream depends only on p, so training that resumes at ``consumed_samples`` = k draws
exactly what an uninterrupted run draws from k on, and no sample repeats in an epoch.
"""

from __future__ import annotations

import numpy as np
import torch

from fxmeg.data.corpus import Corpus


class Samples:
    """One region (train or valid) of a corpus cut into windows of seq_len + 1 tokens."""

    def __init__(self, corpus: Corpus, seq_len: int, *, split: str, valid_fraction: float) -> None:
        boundary = _split_point(corpus, valid_fraction)
        lo, hi = (0, boundary) if split == "train" else (boundary, len(corpus))
        self.tokens, self.seq_len = corpus.tokens[lo:hi], seq_len
        self.count = max(0, (hi - lo - 1) // seq_len)
        if self.count == 0:
            raise ValueError(
                f"the {split} split holds {hi - lo} tokens, not one sample of seq_len + 1 = "
                f"{seq_len + 1}; use a larger corpus, a smaller seq_len or another valid_fraction"
            )

    def __len__(self) -> int:
        return self.count

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each (len(indices), seq_len), int64."""
        rows = np.stack([self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in indices])
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class Sampler:
    """Positions of an endless stream of sample indices (see the module docstring)."""

    def __init__(self, count: int, *, seed: int, shuffle: bool) -> None:
        self.count, self.seed, self.shuffle = count, seed, shuffle
        self._perm: tuple[int, np.ndarray] | None = None

    def indices(self, start: int, n: int) -> list[int]:
        """The sample indices at stream positions [start, start + n)."""
        return [self._at(p) for p in range(start, start + n)]

    def _at(self, position: int) -> int:
        epoch, offset = divmod(position, self.count)
        if not self.shuffle:
            return offset
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.count, generator=g).numpy())
        return int(self._perm[1][offset])


def _split_point(corpus: Corpus, valid_fraction: float) -> int:
    """The start of the first document at or after (1 - valid_fraction) of the tokens."""
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    target = int(len(corpus) * (1.0 - valid_fraction))
    later = corpus.doc_starts[corpus.doc_starts >= target]
    return int(later[0]) if len(later) else target
