"""The trainer's data as Megatron-LM builds it from ``--data-path``, ``--split`` and the
per-split paths (docs/cli.md, "Data"): the same samples, in the same order, as Megatron-Core's
``BlendedMegatronDatasetBuilder(GPTDataset, sizes, ...)`` for the same seed and sequence
length, with ``sizes`` from the run's own settings as Megatron's ``pretrain_gpt.py`` asks
them (``sample_counts``).

  one prefix               a GPTDataset over the split's documents, ``size`` samples
  prefixes alone           a blend weighted by each dataset's samples in the split (one
                           epoch each), ``min(size, their sum)`` samples
  weights and prefixes     a blend of ``size`` samples, each dataset built for its share
                           and 0.5% more
  per-split paths          each split its own blend, over all documents of its datasets

Sample ``j`` of a split is ``tokens(j)``, seq_len + 1 tokens; a trainer reads its stream
position ``p`` as sample ``p``, so resuming at ``consumed_samples`` reads what an
uninterrupted run reads, at any data-parallel size. ``TrainData.fields`` adds Megatron's
loss mask, position ids and attention mask (``MaskRule``; fxmeg/data/masks.py); the indices
can live on disk between runs (``cache_path``: fxmeg/data/cache.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fxmeg.data import cache
from fxmeg.data.blend import Blended, build_blend
from fxmeg.data.corpus import Corpus
from fxmeg.data.gpt_order import GPTOrder, sample, split_documents
from fxmeg.data.indexed import IndexedDataset, is_indexed
from fxmeg.data.masks import gpt_fields
from fxmeg.errors import ConfigError, DataError


def parse_blend(words: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path`` words: 'W1 P1 W2 P2 ...' (weights and prefixes), else
    prefixes alone."""
    words = list(words)
    if len(words) >= 2 and len(words) % 2 == 0:
        try:
            weights = [float(w) for w in words[::2]]
        except ValueError:
            return words, None
        if sum(weights) <= 0 or min(weights) < 0:
            raise DataError(
                f"--data-path weights {words[::2]} must be non-negative with a positive sum"
            )
        return words[1::2], weights
    return words, None


@dataclass(frozen=True)
class DataPaths:
    """Where a run's data is: ``blend`` (``--data-path`` words) cut by ``split``, or one
    blend per split (``--train-data-path`` ...; then ``blend`` is empty)."""

    blend: tuple[str, ...] = ()
    split: str = "969,30,1"
    per_split: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = ((), (), ())

    def check(self) -> None:
        if self.blend and any(self.per_split):
            raise DataError("give either --data-path (cut by --split) or the per-split paths "
                            "(--train-data-path, --valid-data-path, --test-data-path), not both")
        if not self.blend and not self.per_split[0]:
            raise DataError(
                "no training data: give --data-path PREFIX (or 'W1 P1 W2 P2 ...'; --data PREFIX "
                "is the one-prefix case) or --train-data-path, prefixes of `fxmeg prepare-data` "
                "or Megatron's tools/preprocess_data.py output"
            )
        for words in (self.blend, *self.per_split):
            if words:
                parse_blend(words)

    def check_files(self) -> None:
        for prefix in self.prefixes:
            for ext in (".bin", ".idx"):
                if not os.path.exists(prefix + ext):
                    raise DataError(f"data prefix {prefix!r}: {prefix + ext} does not exist")

    @property
    def prefixes(self) -> list[str]:
        return [
            p for words in (self.blend, *self.per_split) if words for p in parse_blend(words)[0]
        ]


def sample_counts(train_samples: int, global_batch_size: int, eval_interval: int, eval_iters: int,
                  train_iters: int) -> tuple[int, int, int]:
    """The samples each split is built for, as Megatron asks them: every training sample;
    eval_iters batches at each evaluation (every eval_interval steps, and one at the end);
    eval_iters batches for the test."""
    evaluations = (train_iters // eval_interval if eval_interval else 0) + 1
    return (
        train_samples,
        evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    )


class _Single:
    """One dataset's split: ``tokens(j)`` is sample j."""

    def __init__(self, data, order: GPTOrder, seq_len: int) -> None:
        self.data, self.order, self.seq_len = data, order, seq_len

    def __len__(self) -> int:
        return len(self.order)

    def tokens(self, j: int) -> np.ndarray:
        return sample(lambda d: self.data[d], self.order, j, seq_len=self.seq_len)


class _OldCorpus:
    """A corpus of fxmeg's older format (``PREFIX.idx``: raw int64 document starts; read
    and checked by ``Corpus``) seen as an indexed dataset of one sequence per document."""

    def __init__(self, prefix: str) -> None:
        corpus = Corpus(prefix)
        self.prefix = prefix
        self.tokens, self._starts = corpus.tokens, corpus.doc_starts
        self.lengths = np.diff(np.append(self._starts, len(self.tokens))).astype(np.int32)

    @property
    def num_documents(self) -> int:
        return len(self.lengths)

    def __getitem__(self, d: int) -> np.ndarray:
        return self.tokens[int(self._starts[d]) : int(self._starts[d]) + int(self.lengths[d])]


def open_dataset(prefix: str):
    """Megatron's indexed dataset at ``prefix``, or a corpus of fxmeg's older format."""
    return IndexedDataset(prefix) if is_indexed(prefix) else _OldCorpus(prefix)


def build_splits(paths: DataPaths, sizes: tuple[int, int, int], *, seq_len: int, seed: int,
                 cache_path: str = "") -> list[_Single | Blended | None]:
    """The train, valid and test splits for ``sizes`` samples each (None: of weight 0, or
    asked 0 samples: not built); their indices through the cache in ``cache_path``
    (fxmeg/data/cache.py; "": none)."""
    paths.check()
    paths.check_files()
    if paths.blend:
        return _build(paths.blend, paths.split, sizes, seq_len, seed, cache_path)
    out: list[_Single | Blended | None] = []
    for i, words in enumerate(paths.per_split):
        whole = ",".join("1" if k == i else "0" for k in range(3))  # every document in split i
        out.append(
            _build(words, whole, sizes, seq_len, seed, cache_path)[i]
            if words and sizes[i]
            else None
        )
    return out


def _build(words, split: str, sizes, seq_len: int, seed: int, cache_path: str) -> list:
    prefixes, weights = parse_blend(words)
    try:
        if len(prefixes) == 1 and weights is None:
            data = open_dataset(prefixes[0])
            out = []
            for i, documents in enumerate(split_documents(split, data.num_documents)):
                if documents is None or sizes[i] == 0:
                    out.append(None)
                    continue
                order = cache.order(
                    cache_path, data, documents, seq_len=seq_len, num_samples=sizes[i], seed=seed
                )
                out.append(_Single(data, order, seq_len))
            return out
        return build_blend(
            prefixes,
            weights,
            split,
            sizes,
            seq_len=seq_len,
            seed=seed,
            open=open_dataset,
            cache_path=cache_path,
        )
    except ConfigError:
        raise
    except ValueError as e:
        raise DataError(f"data {' '.join(words)!r}, split {split!r}: {e}") from e


@dataclass(frozen=True)
class Vocabulary:
    """The data's vocabulary size and end-of-document id (None: not known; only the masks
    need it). Megatron's .bin / .idx say neither."""

    size: int
    eod: int | None


def vocabulary(
    prefixes: Sequence[str], *, size: int = 0, eod: int = -1, tokenizer: str = ""
) -> Vocabulary:
    """Each of the two from, first to last: the flag (``size`` > 0, ``eod`` >= 0), the
    tokenizer named (``tokenizer``: a tokenizer.json, or a directory holding one, as
    Megatron's --tokenizer-model names it), the ``PREFIX.json`` files `fxmeg prepare-data`
    writes (the largest vocabulary; their one end-of-document id)."""
    if tokenizer:
        from fxmeg.data.tokenizer import HFTokenizer

        tok = HFTokenizer(tokenizer, eos_id=eod if eod >= 0 else None)
        return Vocabulary(size or tok.vocab_size, tok.eos_id)
    metas = [_meta(p) for p in prefixes] if not size or eod < 0 else []
    if not size:
        missing = [p for p, m in zip(prefixes, metas) if m is None]
        if missing:
            raise DataError(
                f"{missing[0]}.idx / .bin do not say the vocabulary size and {missing[0]}.json "
                "does not exist (Megatron's preprocess_data.py writes none): pass "
                "--tokenizer-model PATH (the tokenizer.json the data was made with) or "
                "--vocab-size N"
            )
        size = max(int(m["vocab_size"]) for m in metas)
    if eod < 0:
        ids = {m.get("eos_id") for m in metas if m is not None}
        eod = ids.pop() if len(ids) == 1 and None not in ids else None
    return Vocabulary(size, eod)


def _meta(prefix: str) -> dict | None:
    if not os.path.exists(prefix + ".json"):
        return None
    with open(prefix + ".json") as f:
        return json.load(f)


@dataclass(frozen=True)
class MaskRule:
    """Megatron's --eod-mask-loss, --reset-position-ids and --reset-attention-mask
    (fxmeg/data/masks.py says what each does)."""

    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    def __bool__(self) -> bool:
        return self.eod_mask_loss or self.reset_position_ids or self.reset_attention_mask

    def flags(self) -> list[str]:
        return ["--" + f.replace("_", "-") for f, on in vars(self).items() if on]


class TrainData:
    """A run's train and valid splits, its vocabulary (``batch`` checks every token id
    against it) and its masks."""

    def __init__(
        self,
        paths: DataPaths,
        sizes: tuple[int, int, int],
        *,
        seq_len: int,
        seed: int,
        vocab: Vocabulary | None = None,
        masks: MaskRule = MaskRule(),
        cache_path: str = "",
    ) -> None:
        self.vocab = vocab or vocabulary(paths.prefixes)
        if masks and self.vocab.eod is None:
            raise DataError(
                f"{' '.join(masks.flags())} needs the end-of-document id, which the data does not "
                "say: pass --tokenizer-model PATH (the tokenizer.json the data was made with) or "
                "--eod-id N"
            )
        # the test split is not built: nothing in fxmeg reads it (Megatron builds it, and
        # loops forever when the split leaves it no document)
        self.train, self.valid, _ = build_splits(paths, (*sizes[:2], 0), seq_len=seq_len, seed=seed,
                                                 cache_path=cache_path)
        if self.valid is None or len(self.valid) == 0:
            raise DataError(
                f"split {paths.split!r} leaves no validation data, which evaluation reads: give "
                "the valid split a weight (e.g. '98,2,0') or --valid-data-path"
            )
        if len(self.train) < sizes[0]:
            raise DataError(
                f"the training data holds {len(self.train)} samples of {seq_len + 1} tokens, fewer "
                f"than the {sizes[0]} the run trains on"
            )
        self.vocab_size, self.masks, self.seq_len = self.vocab.size, masks, seq_len
        self.epochs = (
            max(p.order.epochs for p in self.train.parts)
            if isinstance(self.train, Blended)
            else self.train.order.epochs
        )
        """Megatron's num_epochs of the train split's sample index (a blend: its datasets' most)."""
        self.passes = (
            None if isinstance(self.train, Blended) else sizes[0] * self.epochs / len(self.train)
        )
        """The passes over the train split the run's samples make (one dataset; None for a blend).
        """
        self.summary = (
            f"data: {len(self.train)} train and {len(self.valid)} valid samples of {seq_len + 1} "
            "tokens"
            + (f"; {' '.join(masks.flags())}" if masks else "")
        )

    def rows(self, split: str, positions: Sequence[int]) -> np.ndarray:
        """The seq_len + 1 tokens of stream positions ``positions``: sample p of the train
        split; of the valid split, p modulo its samples (evaluation reads one stream)."""
        data = self.train if split == "train" else self.valid
        wrap = split != "train"
        rows = np.stack([data.tokens(p % len(data) if wrap else p) for p in positions]).astype(
            np.int64
        )
        top = int(rows.max())
        if top >= self.vocab_size:
            raise DataError(
                f"the {split} data holds token id {top} (stream positions {positions[0]}..."
                f"{positions[-1]}), which a vocabulary of {self.vocab_size} cannot hold: the data "
                "was made with another tokenizer, or --vocab-size is too small"
            )
        return rows

    def batch(self, split: str, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of stream positions ``positions`` (``rows``), without masks."""
        rows = torch.from_numpy(self.rows(split, positions))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def fields(self, split: str, positions: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples at ``positions`` with the run's masks, as Megatron's GPTDataset makes
        them (``gpt_fields``): "tokens"; "labels", -100 where the loss mask is 0; with
        --reset-position-ids "position_ids"; with --reset-attention-mask "attend", (rows,
        s, s) bool, True where a query may attend to a key."""
        if not self.masks:
            tokens, labels = self.batch(split, positions)
            return {"tokens": tokens, "labels": labels}
        rule = self.masks
        made = [gpt_fields(row, eod=self.vocab.eod, pad=-1, eod_mask_loss=rule.eod_mask_loss,
                           reset_position_ids=rule.reset_position_ids,
                           reset_attention_mask=rule.reset_attention_mask,
                           # else the causal mask: the model's own
                           create_attention_mask=rule.reset_attention_mask)
                for row in self.rows(split, positions)]
        f = {k: torch.from_numpy(np.stack([m[k] for m in made])) for k in made[0]}
        out = {"tokens": f["tokens"], "labels": f["labels"].masked_fill(f["loss_mask"] == 0, -100)}
        if rule.reset_position_ids:
            out["position_ids"] = f["position_ids"]
        if rule.reset_attention_mask:
            out["attend"] = ~f["attention_mask"][:, 0]
        return out
