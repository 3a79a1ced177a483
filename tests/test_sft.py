"""SFT data (fxmeg/data/sft.py) as the trainer reads it (``train_data`` with --sft): the
targets a sample counts are exactly the assistant turns of each conversation (their words
and the template's end-of-turn token, looked up in the tokenizer's vocabulary, not
rendered) or each pair's response and end-of-document token; no prompt token's label ever
counts. Packed windows keep examples whole and apart (positions restart, a block-causal
attention mask); padded rows are bucketed. Then the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fxmeg.errors import ConfigError, DataError
from fxmeg.trainer import TrainConfig, train_data
from tests import sft_data

SEQ, GBS = 64, 8
RUN = dict(seq_len=SEQ, global_batch_size=GBS, micro_batch_size=2, train_iters=4, eval_iters=1, seed=3, sft=True)


@pytest.fixture
def files(tmp_path):
    tok = sft_data.write_tokenizer(str(tmp_path / "tok"))
    return dict(tokenizer_model=tok, chat_template=sft_data.write_template(str(tmp_path / "chat.jinja")),
                conversations=sft_data.write_lines(str(tmp_path / "c.jsonl"), sft_data.conversations(40, seed=1)),
                pairs=sft_data.write_lines(str(tmp_path / "p.jsonl"), sft_data.pairs(40, seed=2)))


def _ids(words: str) -> list[int]:
    vocab = sft_data.SPECIALS + sft_data.WORDS
    return [vocab.index(w) for w in words.split()]


def _expected(record: dict) -> list[int]:
    """The targets of a line, from the vocabulary alone."""
    if "messages" in record:
        return [i for m in record["messages"] if m["role"] == "assistant" for i in _ids(m["content"] + " <|end|>")]
    return _ids(record["answer"] + " </s>")


def _epoch(data, split: str) -> list[int]:
    """Stream positions reading each sample of the split once, in sample order."""
    order = (data.train if split == "train" else data.valid).order
    n = order.max() + 1
    return list(np.argsort(order[:n]))


def _config(files, kind: str, **flags) -> TrainConfig:
    what = (dict(chat_template=files["chat_template"]) if kind == "conversations"
            else dict(sft_prompt_key="question", sft_response_key="answer"))
    where = dict(data_path=files[kind], split="80,20,0", tokenizer_model=files["tokenizer_model"])
    return TrainConfig.from_flat(**(RUN | where | what | flags))


@pytest.mark.parametrize("kind", ["conversations", "pairs"])
def test_packed_windows_count_the_responses_alone(files, kind):
    import json

    records = [json.loads(line) for line in open(files[kind])]
    data = train_data(_config(files, kind))
    for split, lines in (("train", records[:32]), ("valid", records[32:])):
        f = data.fields(split, _epoch(data, split))
        counted, s = [], SEQ
        for row in range(len(f["tokens"])):
            tokens, labels, positions, attend = (f[k][row] for k in ("tokens", "labels", "position_ids", "attend"))
            starts = (positions == 0).nonzero().flatten().tolist() + [s]
            for a, b in zip(starts, starts[1:]):  # one example (or the padding after the last)
                assert torch.equal(positions[a:b], torch.arange(b - a))
                block = torch.zeros(s, s, dtype=torch.bool)
                block[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
                assert torch.equal(attend[a:b], block[a:b])
                keep = labels[a:b] != -100
                assert torch.equal(labels[a:b - 1][keep[:-1]], tokens[a + 1:b][keep[:-1]])  # the next token
                if keep.any():
                    counted.append(labels[a:b][keep].tolist())
        assert counted == [_expected(r) for r in lines]


def test_padded_rows_are_bucketed_and_count_the_responses_alone(files):
    import json

    records = [json.loads(line) for line in open(files["conversations"])]
    data = train_data(_config(files, "conversations", sft_layout="padded", sft_pad_multiple=8,
                              variable_seq_lengths=True))
    positions = _epoch(data, "train")
    for start in range(0, 32, GBS):
        rows = positions[start:start + GBS]
        f = data.fields("train", rows)
        longest = max(int(f["attend"][r].sum()) for r in range(GBS))
        assert f["tokens"].shape[1] == -(-longest // 8) * 8 <= SEQ
        for r, p in enumerate(rows):
            labels = f["labels"][r]
            assert labels[f["attend"][r] == 0].eq(-100).all()
            assert labels[labels != -100].tolist() == _expected(records[data.train.order[p]])


def test_sft_input_is_refused_naming_it(files, tmp_path):
    bad = sft_data.write_lines(str(tmp_path / "bad.jsonl"), [{"question": "a", "answer": "b"}, {"question": "c"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2 has no string fields 'question' and 'answer'"):
        train_data(TrainConfig.from_flat(**RUN, data_path=bad, tokenizer_model=files["tokenizer_model"],
                                         sft_prompt_key="question", sft_response_key="answer"))
    alone = sft_data.write_lines(str(tmp_path / "alone.jsonl"), [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(DataError, match=r"alone.jsonl:1 has no assistant message to learn \(roles \['user'\]\)"):
        train_data(_config(files, "conversations", data_path=alone))
    with pytest.raises(ConfigError, match="--sft tokenises its JSON lines with the model's tokenizer"):
        TrainConfig.from_flat(**RUN, data_path=files["pairs"])
    with pytest.raises(ConfigError, match="--sft-layout padded pads each global batch to its own length"):
        _config(files, "pairs", sft_layout="padded")
    with pytest.raises(ConfigError, match="--sft lays out its own masks"):
        _config(files, "pairs", reset_attention_mask=True)
    with pytest.raises(DataError, match="--sft reads one JSON-lines file per split, not a blend"):
        train_data(_config(files, "pairs", data_path=f"0.5 {files['pairs']} 0.5 {files['pairs']}"))


def test_a_chat_template_from_tokenizer_config_json(files, tmp_path):
    """--chat-template tokenizer_config.json: its chat_template (here the default of a list of
    named ones) rendered with its eos_token; the targets as from the template file."""
    import json

    config = tmp_path / "tokenizer_config.json"
    template = sft_data.TEMPLATE.replace("<|end|>", "{{ eos_token }}")
    config.write_text(json.dumps({"eos_token": {"content": "<|end|>"},
                                  "chat_template": [{"name": "tool_use", "template": "{{ raise_exception('no') }}"},
                                                    {"name": "default", "template": template}]}))
    from_file = train_data(_config(files, "conversations"))
    from_config = train_data(_config(files, "conversations", chat_template=str(config)))
    for a, b in zip(from_file.examples[0], from_config.examples[0]):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.targets, b.targets)


def test_pretraining_data_takes_its_vocabulary_from_the_tokenizer(files, tmp_path):
    """--tokenizer-model gives indexed data (no PREFIX.json) its vocabulary size and
    end-of-document id ("</s>"), which the masks need; --eod-id overrides the id."""
    from fxmeg.data.indexed import write_indexed

    prefix = str(tmp_path / "data")
    write_indexed(prefix, (np.append(np.arange(k % 7 + 1) + 6, 5) for k in range(40)), np.uint16)
    cfg = TrainConfig.from_flat(seq_len=8, global_batch_size=4, micro_batch_size=2, train_iters=2, eval_iters=1,
                                data=prefix, split="80,20,0", tokenizer_model=files["tokenizer_model"],
                                eod_mask_loss=True)
    data = train_data(cfg)
    assert (data.vocab.size, data.vocab.eod) == (len(sft_data.SPECIALS + sft_data.WORDS), 5)
    f = data.fields("train", range(4))
    assert f["labels"][f["tokens"] == 5].eq(-100).all() and f["labels"][f["tokens"] != 5].ne(-100).all()
    assert train_data(cfg.replace(eod_id=6)).vocab.eod == 6
