"""Megatron's GPT sample order (fxmeg/data/gpt_order.py) and blends (fxmeg/data/blend.py)
against megatron-core's own GPTDataset and BlendedMegatronDatasetBuilder (the oracle, a test
dependency only): the document, sample and shuffle indices and every sample's tokens, for
one epoch, several epochs with the last one shuffled apart or not, a split's subset of
documents, ``--split`` strings, and blends of three datasets with weights and by prefixes
alone."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fxmeg.data.gpt_order import build_order, sample
from fxmeg.data.indexed import IndexedDataset

with warnings.catch_warnings():  # megatron-core warns that transformer-engine and apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.datasets.utils import Split

SEQ = 16


class _Tokenizer:
    """What GPTDataset reads of a tokenizer."""

    eod, pad, vocab_size = 0, 1, 1000
    unique_identifiers = {"class": "test"}


def _written(tmp_path, docs: int = 25) -> str:
    prefix = str(tmp_path / "data")
    rng = np.random.default_rng(3)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(docs):
        builder.add_item(torch.from_numpy(rng.integers(2, 1000, size=int(rng.integers(1, 60)))))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize(
    "documents, num_samples, seed, apart",
    [
        (slice(None), None, 1234, False),  # one epoch, as many samples as it holds
        (slice(None), 40, 7, False),  # within the first epoch
        # 4 epochs (689 tokens each), the last gives 41 samples: with the rest
        (slice(None), 170, 1, False),
        (
            slice(None),
            110,
            5,
            True,
        ),  # 3 epochs, the last gives 24 < 80% of 43 samples: shuffled apart
        (
            slice(5, 20),
            90,
            11,
            False,
        ),  # a split's documents only (4 epochs, the last with the rest)
    ],
)
def test_the_order_and_the_samples_are_megatrons(tmp_path, documents, num_samples, seed, apart):
    prefix = _written(tmp_path)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=SEQ,
        blend=([prefix], None),
        split="100,0,0",
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "cache"),
    )
    theirs_data = MegatronDataset(prefix)
    ids = np.arange(len(theirs_data), dtype=np.int32)[documents]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = GPTDataset(theirs_data, prefix, ids, num_samples, Split.train, config)
    ours_data = IndexedDataset(prefix)
    order = build_order(ours_data.lengths, ids, seq_len=SEQ, num_samples=num_samples, seed=seed)
    assert np.array_equal(order.document_index, theirs.document_index)
    assert np.array_equal(order.sample_index, theirs.sample_index)
    assert np.array_equal(order.shuffle_index, theirs.shuffle_index)
    assert len(order) >= (num_samples or 1)
    epochs = int(order.document_index.size // len(ids))
    before_last = ((epochs - 1) * int(ours_data.lengths[ids].sum()) - 1) // SEQ
    tail = np.sort(order.shuffle_index[before_last:])
    assert epochs > 1 or not apart
    assert apart == (epochs > 1 and np.array_equal(tail, np.arange(before_last, len(order))))
    for i in range(len(order)):
        got = sample(lambda d: ours_data[d], order, i, seq_len=SEQ)
        want = theirs[i]
        assert np.array_equal(got[:-1], want["tokens"].numpy()) and np.array_equal(
            got[1:], want["labels"].numpy()
        )


@pytest.mark.parametrize(
    "split, sizes", [("90,8,2", [60, 8, 2]), ("98,2", [200, 3, None]), ("1", [30, None, None])]
)
def test_a_split_reads_megatrons_samples(tmp_path, split, sizes):
    """One prefix, ``--split``: each split's documents, and the samples the builder asked for
    each split (train iterations x global batch, evaluations), in Megatron's order."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    from fxmeg.data.gpt_order import split_documents

    prefix = _written(tmp_path, docs=60)
    config = GPTDatasetConfig(
        random_seed=9,
        sequence_length=SEQ,
        blend=([prefix], None),
        split=split,
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "cache"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    data = IndexedDataset(prefix)
    for ranges, size, their in zip(split_documents(split, data.num_documents), sizes, theirs):
        assert (ranges is None) == (their is None)
        if ranges is None:
            continue
        order = build_order(
            data.lengths, np.arange(*ranges, dtype=np.int32), seq_len=SEQ, num_samples=size, seed=9
        )
        assert len(order) == len(their)
        for i in range(len(order)):
            assert np.array_equal(
                sample(lambda d: data[d], order, i, seq_len=SEQ)[:-1], their[i]["tokens"].numpy()
            )


def test_an_empty_split_is_refused():
    """Megatron's builder loops forever on a split without tokens (969,30,1 of 60 documents
    leaves test none); fxmeg refuses it."""
    from fxmeg.data.gpt_order import split_documents

    assert split_documents("969,30,1", 60) == [(0, 58), (58, 60), (60, 60)]
    with pytest.raises(ValueError, match="0 documents of 0 tokens hold no sample of 17 tokens"):
        build_order(
            np.ones(60, dtype=np.int32), np.arange(60, 60), seq_len=SEQ, num_samples=2, seed=0
        )


@pytest.fixture
def one_process(tmp_path):
    """Megatron's BlendedDataset asks torch.distributed for its rank: a group of one."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("weights", [[0.3, 0.5, 0.2], None], ids=["weights", "prefixes-only"])
def test_a_blend_reads_megatrons_samples(tmp_path, one_process, weights):
    """Three datasets, ``--split 80,15,5``: every sample of every split as Megatron's
    BlendedMegatronDatasetBuilder gives it, with weights and with prefixes alone (weights
    from their sample counts)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    from fxmeg.data.blend import build_blend

    prefixes = []
    for k, docs in enumerate((40, 25, 60)):
        (tmp_path / str(k)).mkdir()
        prefixes.append(_written(tmp_path / str(k), docs=docs))
    sizes = [150, 12, 3]
    config = GPTDatasetConfig(
        random_seed=4,
        sequence_length=SEQ,
        blend=(prefixes, weights),
        split="80,15,5",
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "cache"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    ours = build_blend(prefixes, weights, "80,15,5", sizes, seq_len=SEQ, seed=4)
    for mine, their in zip(ours, theirs):
        assert len(mine) == len(their)
        assert np.array_equal(mine.dataset, their.dataset_index)
        for j in range(len(mine)):
            assert np.array_equal(mine.tokens(j)[:-1], their[j]["tokens"].numpy())


@pytest.mark.parametrize(
    "weights", [[0.3, 0.7], [1 / 3, 1 / 3, 1 / 3], [0.05, 0.15, 0.2, 0.25, 0.35], [0.5, 0.5]]
)
def test_the_blending_index_is_megatrons_helper(weights):
    """100,000 samples, ties included (equal weights): the same dataset and sample for each
    as megatron-core's C++ ``build_blending_indices``."""
    from megatron.core.datasets import helpers

    from fxmeg.data.blend import blending_indices

    size = 100_000
    index, within = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        index, within, np.asarray(weights, dtype=np.float64), len(weights), size, False
    )
    ours = blending_indices(weights, size)
    assert np.array_equal(ours[0], index) and np.array_equal(ours[1], within)


@pytest.mark.parametrize("eod_mask_loss", [False, True])
@pytest.mark.parametrize("reset", ["none", "positions", "attention", "both"])
def test_masks_and_positions_are_megatrons(tmp_path, eod_mask_loss, reset):
    """Documents ending in the end-of-document token packed into samples: tokens, labels,
    loss mask, position ids and attention mask as GPTDataset gives them for each switch,
    and no field more or less than it gives."""
    from fxmeg.data.masks import gpt_fields

    prefix = str(tmp_path / "eod")
    rng = np.random.default_rng(8)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(30):
        doc = np.append(rng.integers(2, 1000, size=int(rng.integers(1, 12))), _Tokenizer.eod)
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    positions, attention = reset in ("positions", "both"), reset in ("attention", "both")
    config = GPTDatasetConfig(
        random_seed=2,
        sequence_length=SEQ,
        blend=([prefix], None),
        split="1",
        tokenizer=_Tokenizer(),
        reset_position_ids=positions,
        reset_attention_mask=attention,
        eod_mask_loss=eod_mask_loss,
        path_to_cache=str(tmp_path / "cache"),
    )
    data = IndexedDataset(prefix)
    ids = np.arange(len(data), dtype=np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = GPTDataset(MegatronDataset(prefix), prefix, ids, None, Split.train, config)
    order = build_order(data.lengths, ids, seq_len=SEQ, num_samples=None, seed=2)
    ends = 0
    for i in range(len(order)):
        text = sample(lambda d: data[d], order, i, seq_len=SEQ)
        mine = gpt_fields(text, eod=_Tokenizer.eod, pad=_Tokenizer.pad, eod_mask_loss=eod_mask_loss,
                          reset_position_ids=positions, reset_attention_mask=attention)
        want = theirs[i]
        # a field either side lacks fails
        assert mine.keys() == want.keys(), (i, sorted(mine), sorted(want))
        for key, value in mine.items():
            assert np.array_equal(value, want[key].numpy()), (i, key)
        ends += int((mine["tokens"] == _Tokenizer.eod).sum())
    assert ends > len(order)  # more than one document per sample on average
