"""SFT data for the tests: a word-level tokenizer.json (106 ids: a tiny Hugging Face model's
vocabulary holds them), a chat template, and JSON-lines files of random conversations or
prompt/response pairs over its words."""

from __future__ import annotations

import json
import os

import numpy as np

SPECIALS = ["[UNK]", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "</s>"]
WORDS = sorted(
    set(
        "the a of to and is in it you that was for on are with as his they be at one have this "
        "from or had by word "
        "but what some we can out other were all there when up use your how said an each she which "
        "do their time if "
        "will way about many then them write would like so these her long make thing see him two "
        "has look more day "
        "could go come did number sound no most people my over know water than call first who may "
        "down side been "
        "now find".split()
    )
)[:100]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def write_tokenizer(directory: str) -> str:
    """tokenizer.json in ``directory`` (returned): whitespace words, SPECIALS split out
    whole, "</s>" the end-of-document token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(
        models.WordLevel({t: i for i, t in enumerate(SPECIALS + WORDS)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS[1:])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    return directory


def write_template(path: str) -> str:
    with open(path, "w") as f:
        f.write(TEMPLATE)
    return path


def _words(rng, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))


def conversations(n: int, seed: int) -> list[dict]:
    """n conversations: an optional system turn, then 1 to 3 user / assistant exchanges."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": _words(rng, 1, 4)}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 4))):
            turns += [{"role": "user", "content": _words(rng, 1, 6)},
                      {"role": "assistant", "content": _words(rng, 1, 8)}]
        out.append({"messages": turns})
    return out


def pairs(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"question": _words(rng, 1, 8), "answer": _words(rng, 1, 8)} for _ in range(n)]


def write_lines(path: str, records: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path
