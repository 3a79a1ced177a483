"""The trainer's data (fxmeg/data/megatron.py, ``fxmeg.train.trainer.train_data``) against
megatron-core's BlendedMegatronDatasetBuilder(GPTDataset, ...) built for the sample counts
Megatron's pretrain_gpt.py asks from the same run settings: every train and validation
batch the trainer reads, token by token, for one dataset over several epochs, a blend of
three with weights, a blend of prefixes alone and per-split paths; then the trainer's own
refusals."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from fxmeg.data.corpus import prepare
from fxmeg.data.megatron import DataError, parse_blend, sample_counts
from fxmeg.data.tokenizer import ByteTokenizer
from fxmeg.train.trainer import TrainConfig, train_data
from tests.data.test_gpt_order import SEQ, _Tokenizer, _written, one_process  # noqa: F401  (a fixture)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

GBS = 8
RUN = dict(
    seq_len=SEQ,
    global_batch_size=GBS,
    micro_batch_size=2,
    train_iters=12,
    eval_interval=5,
    eval_iters=2,
    seed=21,
    vocab_size=1000,
)


def _datasets(tmp_path, docs=(40, 25, 60)) -> list[str]:
    prefixes = []
    for k, n in enumerate(docs):
        (tmp_path / str(k)).mkdir()
        prefixes.append(_written(tmp_path / str(k), docs=n))
    return prefixes


def _megatron(tmp_path, sizes, **blend):
    config = GPTDatasetConfig(
        random_seed=RUN["seed"],
        sequence_length=SEQ,
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "cache"),
        **blend,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def _cases(prefixes):
    """(the trainer's data flags, megatron-core's blend arguments) of each case."""
    a, b, c = prefixes
    return {
        "one-dataset-many-epochs": (
            dict(data=a, split="60,40,0"),
            dict(blend=([a], None), split="60,40,0"),
        ),
        "weights": (
            dict(data_path=f"0.3 {a} 0.5 {b} 0.2 {c}", split="80,15,5"),
            dict(blend=([a, b, c], [0.3, 0.5, 0.2]), split="80,15,5"),
        ),
        "prefixes-only": (
            dict(data_path=f"{a} {b} {c}", split="80,15,5"),
            dict(blend=([a, b, c], None), split="80,15,5"),
        ),
        "per-split": (
            dict(train_data_path=f"0.6 {a} 0.4 {b}", valid_data_path=c),
            dict(blend_per_split=[([a, b], [0.6, 0.4]), ([c], None), None]),
        ),
    }


@pytest.mark.parametrize(
    "case", ["one-dataset-many-epochs", "weights", "prefixes-only", "per-split"]
)
def test_the_trainer_reads_megatrons_samples(tmp_path, one_process, case):  # noqa: F811
    prefixes = _datasets(tmp_path)
    ours_flags, theirs_blend = _cases(prefixes)[case]
    cfg = TrainConfig.from_flat(**RUN, **ours_flags)
    sizes = sample_counts(12 * GBS, GBS, 5, 2, 12)
    # Megatron's train, valid and test sample counts
    assert sizes == (96, (12 // 5 + 1) * 2 * GBS, 2 * GBS)
    theirs = _megatron(tmp_path, list(sizes), **theirs_blend)
    data = train_data(cfg)
    for split, their, mine in (("train", theirs[0], data.train), ("valid", theirs[1], data.valid)):
        # prefixes alone: min(the samples asked, those the split holds)
        assert len(mine) == len(their)
        for start in range(0, len(their) - GBS + 1, GBS):  # the trainer's global batches, in order
            ids, labels = data.batch(split, range(start, start + GBS))
            want = [their[j] for j in range(start, start + GBS)]
            assert torch.equal(ids, torch.stack([w["tokens"] for w in want]).long()), (split, start)
            assert torch.equal(labels, torch.stack([w["labels"] for w in want]).long()), (
                split,
                start,
            )


def test_one_dataset_runs_over_several_epochs(tmp_path):
    """The one-dataset case above reads past one epoch of its train split."""
    prefix = _datasets(tmp_path)[0]
    data = train_data(TrainConfig.from_flat(**RUN, data=prefix, split="60,40,0"))
    assert len(np.unique(data.train.order.document_index)) * 2 <= len(
        data.train.order.document_index
    )


def test_megatron_word_lists():
    assert parse_blend(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_blend(["A", "B"]) == (["A", "B"], None)
    assert parse_blend(["A"]) == (["A"], None)
    with pytest.raises(DataError, match="must be non-negative with a positive sum"):
        parse_blend(["0", "A", "0", "B"])


def test_the_valid_stream_wraps_and_resumes(tmp_path):
    """A stream position is a sample index: the same batch from any start, on any
    instance; the validation stream wraps around its samples."""
    prefix = _datasets(tmp_path)[0]
    cfg = TrainConfig.from_flat(**RUN, data=prefix, split="60,40,0")
    one, two = train_data(cfg), train_data(cfg)
    ids, _ = one.batch("train", range(8, 16))
    assert torch.equal(ids, two.batch("train", range(8, 16))[0])
    n = len(one.valid)
    assert torch.equal(one.batch("valid", [n + 3])[0], one.batch("valid", [3])[0])


def test_bad_data_is_refused_naming_it(tmp_path):
    prefix = _datasets(tmp_path)[0]
    with pytest.raises(DataError, match="leaves no validation data"):
        train_data(TrainConfig.from_flat(**RUN, data=prefix, split="100,0,0"))
    with pytest.raises(DataError, match="does not exist"):
        train_data(TrainConfig.from_flat(**RUN, data=str(tmp_path / "missing")))
    with pytest.raises(DataError, match=r"do not say the vocabulary size .* or --vocab-size N"):
        train_data(
            TrainConfig.from_flat(**(RUN | dict(vocab_size=0)), data=prefix, split="60,40,0")
        )
    small = train_data(
        TrainConfig.from_flat(**(RUN | dict(vocab_size=500)), data=prefix, split="60,40,0")
    )
    with pytest.raises(DataError, match="token id .* a vocabulary of 500 cannot hold"):
        small.batch("train", range(8))
    with pytest.raises(DataError, match="either --data-path .* or the per-split paths"):
        TrainConfig.from_flat(**RUN, data_path=prefix, valid_data_path=prefix)


def test_prepared_and_older_corpora_train(tmp_path):
    """`fxmeg prepare-data` output (PREFIX.json gives the vocabulary) and a corpus of
    fxmeg's older format (raw int64 document starts) both read."""
    docs = [f"document {i}: " + "abc" * (i + 5) for i in range(40)]
    new = str(tmp_path / "new")
    prepare(docs, new, ByteTokenizer())
    old = str(tmp_path / "old")
    tokens = np.concatenate(
        [np.asarray(ByteTokenizer().encode(d) + [256], dtype=np.uint16) for d in docs]
    )
    starts = np.concatenate(
        [[0], np.cumsum([len(ByteTokenizer().encode(d)) + 1 for d in docs])[:-1]]
    )
    tokens.tofile(old + ".bin")
    starts.astype(np.int64).tofile(old + ".idx")
    with open(new + ".json") as f:
        meta = json.load(f)
    with open(old + ".json", "w") as f:
        json.dump(meta | {"num_tokens": len(tokens)}, f)
    for prefix in (new, old):
        data = train_data(
            TrainConfig.from_flat(**(RUN | dict(vocab_size=0)), data=prefix, split="90,10,0")
        )
        assert data.vocab_size == 257
        ids, labels = data.batch("train", range(8))
        assert ids.shape == (8, SEQ) and torch.equal(ids[:, 1:], labels[:, :-1])
    same = [train_data(TrainConfig.from_flat(**(RUN | dict(vocab_size=0)), data=p, split="90,10,0"))
            for p in (new, old)]
    assert torch.equal(same[0].batch("train", range(8))[0], same[1].batch("train", range(8))[0])


def test_the_command_line_takes_megatrons_words(tmp_path):
    """`fxmeg train --data-path 0.3 A 0.7 B --split 98,2,0` as Megatron's flags, and a list
    in a config file."""
    import argparse

    from fxmeg.train.cli import _train_parser, config_from

    parser = argparse.ArgumentParser()
    _train_parser(parser)
    cfg = config_from(parser.parse_args(["--data-path", "0.3", "A", "0.7", "B", "--split", "98,2,0",
                                         "--train-iters", "1"]))
    assert cfg.data_paths().blend == ("0.3", "A", "0.7", "B") and cfg.split == "98,2,0"
    toml = tmp_path / "run.toml"
    toml.write_text('data-path = [0.3, "A", 0.7, "B"]\ntrain-iters = 1\n')
    assert config_from(parser.parse_args(["--config", str(toml)])).data_path == "0.3 A 0.7 B"


def test_prepare_data_reads_json_lines_as_megatron(tmp_path):
    """`fxmeg prepare-data --json-keys text` (Megatron's preprocess_data.py flag): each
    line's field is a document, written to PREFIX_text_document as Megatron names it, and
    Megatron's IndexedDataset reads it back; a line without the field is refused naming
    the file and line, and nothing is written."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    from fxmeg.train.cli import main

    docs = [f"document {i}: " + "xyz" * (i + 3) for i in range(12)]
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    assert (
        main(
            [
                "prepare-data",
                "--input",
                str(lines),
                "--output",
                str(tmp_path / "out"),
                "--json-keys",
                "text",
            ]
        )
        == 0
    )
    theirs = MegatronDataset(str(tmp_path / "out_text_document"))
    tok = ByteTokenizer()
    assert len(theirs) == len(docs)
    for doc, ids in zip(docs, (theirs[i] for i in range(len(theirs)))):
        assert ids.tolist() == tok.encode(doc) + [tok.eos_id]
    lines.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(
        DataError, match=r"in.jsonl:2 has no text field 'text' \(it has \['body'\]\)"
    ):
        main(
            [
                "prepare-data",
                "--input",
                str(lines),
                "--output",
                str(tmp_path / "bad"),
                "--json-keys",
                "text",
            ]
        )
    assert not list(tmp_path.glob("bad*"))


def _eod_dataset(tmp_path) -> str:
    """Documents ending in the end-of-document token (as preprocess_data.py --append-eod
    writes them)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "eod")
    rng = np.random.default_rng(8)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(60):
        builder.add_item(
            torch.from_numpy(
                np.append(rng.integers(2, 1000, size=int(rng.integers(1, 12))), _Tokenizer.eod)
            )
        )
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_the_trainer_feeds_megatrons_masks(tmp_path, one_process):  # noqa: F811
    """--eod-mask-loss, --reset-position-ids and --reset-attention-mask: each batch the
    trainer feeds a Hugging Face model (keywords) and its own models (ids, labels) carries
    megatron-core GPTDataset's loss mask (as -100 targets), position ids and attention
    mask for the same samples."""
    from fxmeg.train.trainer import model_batch

    prefix = _eod_dataset(tmp_path)
    flags = dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    sizes = list(sample_counts(12 * GBS, GBS, 5, 2, 12))
    config = GPTDatasetConfig(
        random_seed=RUN["seed"],
        sequence_length=SEQ,
        tokenizer=_Tokenizer(),
        path_to_cache=str(tmp_path / "cache"),
        blend=([prefix], None),
        split="90,10,0",
        **flags,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    data = train_data(
        TrainConfig.from_flat(**RUN, data=prefix, split="90,10,0", eod_id=_Tokenizer.eod, **flags)
    )
    loss_only = train_data(
        TrainConfig.from_flat(
            **RUN, data=prefix, split="90,10,0", eod_id=_Tokenizer.eod, eod_mask_loss=True
        )
    )
    for split, their in (("train", theirs[0]), ("valid", theirs[1])):
        for start in range(0, len(their) - GBS + 1, GBS):
            rows = range(start, start + GBS)
            want = {k: torch.stack([their[j][k] for j in rows]) for k in their[0]}
            target = want["labels"].long().masked_fill(want["loss_mask"] == 0, -100)
            keywords = model_batch(data.fields(split, rows), keywords=True)
            assert torch.equal(keywords["input_ids"], want["tokens"].long())
            assert torch.equal(keywords["shift_labels"], target)
            assert torch.equal(keywords["position_ids"], want["position_ids"].long())
            # Megatron's True: masked
            assert torch.equal(keywords["attention_mask"], ~want["attention_mask"])
            ids, labels = model_batch(loss_only.fields(split, rows), keywords=False)
            assert torch.equal(ids, want["tokens"].long()) and torch.equal(labels, target)
    assert int((target == -100).sum()) > 0 and int(keywords["position_ids"][:, 1:].eq(0).sum()) > 0


@pytest.mark.parametrize("case", ["one-dataset-many-epochs", "weights"])
def test_the_index_cache_is_reused_only_for_the_same_data_and_settings(tmp_path, monkeypatch, case):
    """--data-cache-path: a second run reads the indices the first wrote (building them is
    made to fail) and reads the same batches; another seed, or a dataset with other
    documents at the same path, builds its own."""
    import fxmeg.data.blend as blend
    import fxmeg.data.cache as cache

    prefixes = _datasets(tmp_path)
    flags = _cases(prefixes)[case][0]
    cfg = TrainConfig.from_flat(**RUN, **flags, data_cache_path=str(tmp_path / "cache"))
    first = train_data(cfg)
    written = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert any(n.endswith("-GPTOrder-shuffle_index.npy") for n in written), written
    assert all(not n.endswith(".tmp") for n in written)

    def refuse(*args, **kwargs):
        raise AssertionError("built again")

    with monkeypatch.context() as m:
        m.setattr(cache, "build_order", refuse)
        m.setattr(blend, "blending_indices", refuse)
        again = train_data(cfg)
        for split in ("train", "valid"):
            n = len(getattr(first, split))
            assert torch.equal(first.batch(split, range(n))[0], again.batch(split, range(n))[0])
        with pytest.raises(AssertionError, match="built again"):
            train_data(cfg.replace(seed=22))
        # the first dataset changes in place: as many documents, other lengths
        _rewritten(prefixes[0])
        with pytest.raises(AssertionError, match="built again"):
            train_data(cfg)


def _rewritten(prefix: str) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(99)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(40):
        builder.add_item(torch.from_numpy(rng.integers(2, 1000, size=int(rng.integers(1, 60)))))
        builder.end_document()
    builder.finalize(prefix + ".idx")
