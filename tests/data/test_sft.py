"""SFT data (fxmeg/data/sft.py) as the trainer reads it (``train_data`` with --sft): the
targets a sample counts are exactly the assistant turns of each conversation (their words
and the template's end-of-turn token, looked up in the tokenizer's vocabulary, not
rendered) or each pair's response and end-of-document token; no prompt token's label ever
counts. A conversation's token ids, rendered text and targets are those of transformers'
``apply_chat_template`` (the oracle) on the same tokenizer files. Packed windows keep
examples whole and apart (positions restart, a block-causal attention mask); padded rows
are bucketed. Then the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fxmeg.data.sft import ChatTemplate, SFTFormat, read_examples
from fxmeg.data.tokenizer import HFTokenizer
from fxmeg.errors import ConfigError, DataError
from fxmeg.train.trainer import TrainConfig, train_data
from tests.harness import sft_data

SEQ, GBS = 64, 8
RUN = dict(
    seq_len=SEQ,
    global_batch_size=GBS,
    micro_batch_size=2,
    train_iters=4,
    eval_iters=1,
    seed=3,
    sft=True,
)


@pytest.fixture
def files(tmp_path):
    tok = sft_data.write_tokenizer(str(tmp_path / "tok"))
    return dict(
        tokenizer_model=tok,
        chat_template=sft_data.write_template(str(tmp_path / "chat.jinja")),
        conversations=sft_data.write_lines(
            str(tmp_path / "c.jsonl"), sft_data.conversations(40, seed=1)
        ),
        pairs=sft_data.write_lines(str(tmp_path / "p.jsonl"), sft_data.pairs(40, seed=2)),
    )


def _ids(words: str) -> list[int]:
    vocab = sft_data.SPECIALS + sft_data.WORDS
    return [vocab.index(w) for w in words.split()]


def _expected(record: dict) -> list[int]:
    """The targets of a line, from the vocabulary alone."""
    if "messages" in record:
        return [
            i
            for m in record["messages"]
            if m["role"] == "assistant"
            for i in _ids(m["content"] + " <|end|>")
        ]
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
            tokens, labels, positions, attend = (
                f[k][row] for k in ("tokens", "labels", "position_ids", "attend")
            )
            starts = (positions == 0).nonzero().flatten().tolist() + [s]
            for a, b in zip(starts, starts[1:]):  # one example (or the padding after the last)
                assert torch.equal(positions[a:b], torch.arange(b - a))
                block = torch.zeros(s, s, dtype=torch.bool)
                block[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
                assert torch.equal(attend[a:b], block[a:b])
                keep = labels[a:b] != -100
                # the next token
                assert torch.equal(labels[a : b - 1][keep[:-1]], tokens[a + 1 : b][keep[:-1]])
                if keep.any():
                    counted.append(labels[a:b][keep].tolist())
        assert counted == [_expected(r) for r in lines]


TURNS = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|end|>\n{% endif "
    "%}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""sft_data.TEMPLATE with its assistant turns in ``{% generation %}`` blocks: the same text."""
FANCY = """{{ bos_token }}
{% for m in messages %}
    {% if loop.first and m['role'] != 'system' %}
<|system|>
{{ {'role': 'system', 'content': 'you are one'} | tojson(separators=(',', ':'), sort_keys=True) }}<|end|>
    {% endif %}
    {% if m['role'] == 'assistant' %}
<|assistant|>
{% generation %}{{ m['content'] | trim }}{{ eos_token }}{% endgeneration %}

    {% else %}
<|{{ m['role'] }}|>
{{ m['content'] }}<|end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""  # noqa: E501 (a chat template: its lines are the text)
"""Block tags on indented lines of their own (trim_blocks and lstrip_blocks decide the
text), the tokenizer_config.json's bos_token and eos_token, loop.first, tojson's keywords."""
TEMPLATES = {"turns": (sft_data.TEMPLATE, TURNS), "fancy": (FANCY, FANCY)}
"""name -> (the template fxmeg reads, its twin with ``{% generation %}`` blocks, from which
transformers computes the assistant mask)."""


@pytest.mark.parametrize("name", TEMPLATES)
def test_conversations_are_transformers_apply_chat_template(tmp_path, name):
    """Every conversation, read by fxmeg from a tokenizer_config.json's chat_template, is
    what transformers' ``apply_chat_template`` makes of it with the same tokenizer.json and
    tokenizer_config.json: the same rendered text, token ids and targets (its assistant
    mask, ``return_assistant_tokens_mask``: the tokens of the ``{% generation %}`` blocks of
    the template or of its twin, which renders the same text)."""
    import json

    from transformers import AutoTokenizer

    read, masked = TEMPLATES[name]
    tok = sft_data.write_tokenizer(str(tmp_path / "tok"))
    config = tmp_path / "tok" / "tokenizer_config.json"
    config.write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|system|>",
                "eos_token": "<|end|>",
                "chat_template": read,
            }
        )
    )
    records = sft_data.conversations(12, seed=4) + [{"messages": [  # a system turn, three exchanges
        {"role": "system", "content": "you are the one"}, {"role": "user", "content": "what is it"},
        {"role": "assistant", "content": "a word"}, {"role": "user", "content": "and"},
        {"role": "assistant", "content": "two"}, {"role": "user", "content": "then"},
        {"role": "assistant", "content": "the end of it"}]}]
    lines = sft_data.write_lines(str(tmp_path / "c.jsonl"), records)
    ours = read_examples(lines, HFTokenizer(tok), SFTFormat(chat_template=str(config)))
    render = ChatTemplate(str(config), HFTokenizer(tok))
    theirs = AutoTokenizer.from_pretrained(tok)  # a local directory: nothing is downloaded
    for record, example in zip(records, ours, strict=True):
        messages = record["messages"]
        text = theirs.apply_chat_template(messages, tokenize=False)
        assert (
            render(messages)
            == text
            == theirs.apply_chat_template(messages, chat_template=masked, tokenize=False)
        )
        want = theirs.apply_chat_template(
            messages,
            chat_template=masked,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert example.tokens.tolist() == want["input_ids"], text
        assert example.targets.astype(int).tolist() == want["assistant_masks"], text
        assert 0 < sum(want["assistant_masks"]) < len(want["input_ids"])


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
    bad = sft_data.write_lines(
        str(tmp_path / "bad.jsonl"), [{"question": "a", "answer": "b"}, {"question": "c"}]
    )
    with pytest.raises(
        DataError, match=r"bad.jsonl:2 has no string fields 'question' and 'answer'"
    ):
        train_data(
            TrainConfig.from_flat(
                **RUN,
                data_path=bad,
                tokenizer_model=files["tokenizer_model"],
                sft_prompt_key="question",
                sft_response_key="answer",
            )
        )
    alone = sft_data.write_lines(
        str(tmp_path / "alone.jsonl"), [{"messages": [{"role": "user", "content": "a"}]}]
    )
    with pytest.raises(
        DataError, match=r"alone.jsonl:1 has no assistant message to learn \(roles \['user'\]\)"
    ):
        train_data(_config(files, "conversations", data_path=alone))
    with pytest.raises(
        ConfigError, match="--sft tokenises its JSON lines with the model's tokenizer"
    ):
        TrainConfig.from_flat(**RUN, data_path=files["pairs"])
    with pytest.raises(
        ConfigError, match="--sft-layout padded pads each global batch to its own length"
    ):
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
    config.write_text(
        json.dumps(
            {
                "eos_token": {"content": "<|end|>"},
                "chat_template": [
                    {"name": "tool_use", "template": "{{ raise_exception('no') }}"},
                    {"name": "default", "template": template},
                ],
            }
        )
    )
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
    cfg = TrainConfig.from_flat(
        seq_len=8,
        global_batch_size=4,
        micro_batch_size=2,
        train_iters=2,
        eval_iters=1,
        data=prefix,
        split="80,20,0",
        tokenizer_model=files["tokenizer_model"],
        eod_mask_loss=True,
    )
    data = train_data(cfg)
    assert (data.vocab.size, data.vocab.eod) == (len(sft_data.SPECIALS + sft_data.WORDS), 5)
    f = data.fields("train", range(4))
    assert (
        f["labels"][f["tokens"] == 5].eq(-100).all()
        and f["labels"][f["tokens"] != 5].ne(-100).all()
    )
    assert train_data(cfg.replace(eod_id=6)).vocab.eod == 6


def test_what_the_review_found_stays_fixed(files, tmp_path):
    """Templates with transformers' extras ({% generation %}, tojson's keywords) and the
    bos_token of the tokenizer_config.json beside the tokenizer; an example with no target
    within seq_len left out and counted; an empty training split, --sft-* flags without
    --sft, and a padded seq_len off the multiple refused; a tokenizer with no known
    end-of-document token still gives pretraining data its vocabulary."""
    import json
    import shutil

    tok = tmp_path / "tok2"
    shutil.copytree(files["tokenizer_model"], tok)
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|system|>"}))
    fancy = tmp_path / "fancy.jinja"
    fancy.write_text(
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' "
        "%}"
        "{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}{% else %}"
        "{% set _ = m | tojson(separators=(',', ':'), sort_keys=True) %}{{ m['content'] }}<|end|>"
        "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    data = train_data(
        _config(files, "conversations", tokenizer_model=str(tok), chat_template=str(fancy))
    )
    plain = train_data(_config(files, "conversations"))
    first, again = data.examples[0][0], plain.examples[0][0]
    assert first.tokens[0] == sft_data.SPECIALS.index("<|system|>")  # the bos_token, rendered
    assert np.array_equal(first.tokens[1:], again.tokens) and np.array_equal(
        first.targets[1:], again.targets
    )

    long = [{"question": " ".join(["the"] * 70), "answer": "a"}] + sft_data.pairs(20, seed=5)
    lines = sft_data.write_lines(str(tmp_path / "long.jsonl"), long)
    cut = train_data(_config(files, "pairs", data_path=lines))
    assert (
        "1 with no response token in their first 64 left out" in cut.summary
        and len(cut.examples[0]) == 16
    )
    with pytest.raises(
        DataError, match="leaves no training example with a target within seq_len 64"
    ):
        train_data(_config(files, "pairs", split="0,100,0"))
    with pytest.raises(ConfigError, match="sft_layout, chat_template read SFT data: add --sft"):
        TrainConfig.from_flat(
            **(RUN | dict(sft=False)), data_path="x", sft_layout="padded", chat_template="c"
        )
    with pytest.raises(ConfigError, match="which is not one: make seq_len a multiple of it"):
        _config(files, "pairs", sft_layout="padded", variable_seq_lengths=True, sft_pad_multiple=5)

    from fxmeg.data.megatron import vocabulary
    from fxmeg.data.tokenizer import HFTokenizer

    config = json.loads((tok / "tokenizer.json").read_text())
    config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] != "</s>"]
    config["model"]["vocab"].pop("</s>")
    (tok / "tokenizer.json").write_text(json.dumps(config))
    assert HFTokenizer(str(tok)).eos_id is None
    assert vocabulary([], tokenizer=str(tok)).eod is None
    with pytest.raises(
        DataError,
        match="--sft needs the end-of-document id, and tokenizer .* name it with --eod-id",
    ):
        train_data(_config(files, "pairs", tokenizer_model=str(tok)))


def test_masks_need_sdpa_attention(tmp_path):
    """A 4-D boolean mask is a mask only to sdpa: eager attention would add it to the scores."""
    from fxmeg.train.trainer import _check_model_takes
    from tests.harness.models import hf_model

    cfg = TrainConfig.from_flat(
        seq_len=16,
        global_batch_size=4,
        micro_batch_size=2,
        train_iters=2,
        eval_iters=1,
        data="x",
        reset_attention_mask=True,
    )
    _check_model_takes(cfg, hf_model("llama", attn_implementation="sdpa"), keywords=True)
    with pytest.raises(
        ConfigError,
        match="runs 'eager' attention, which does not take a boolean 4-D attention mask",
    ):
        _check_model_takes(cfg, hf_model("llama", attn_implementation="eager"), keywords=True)


def test_the_passes_over_the_data_are_said_and_past_one_warned(files):
    """The trainer says at start how many passes over its rows the run makes
    (trainer.passes_report, printed by Trainer on rank 0); past one pass, SFT warns."""
    from fxmeg.train.trainer import passes_report

    cfg = _config(files, "pairs", train_iters=100)
    data = train_data(cfg)
    windows, examples = len(data.windows[0]["tokens"]), len(data.examples[0])
    passes = 100 * GBS / windows
    assert passes > 1 and data.passes == passes
    assert passes_report(cfg, data, GBS) == (
        f"WARNING: SFT: 100 steps x {GBS} samples = {100 * GBS} samples is {passes:.1f} passes "
        f"over {windows} "
        f"packed windows ({examples} examples): each example is trained on about {passes:.0f} "
        "times; for one "
        f"pass, --train-iters {max(1, windows // GBS)}, or give more examples (each pass reads "
        "them in a new order)"
    )
    # within one pass: said, not warned
    one = _config(files, "pairs", train_iters=1, global_batch_size=4)
    assert windows >= 4 and passes_report(one, train_data(one), 4) == (
        f"SFT: 1 step x 4 samples = 4 samples is {4 / windows:.1f} passes over {windows} packed "
        "windows "
        f"({examples} examples)"
    )
