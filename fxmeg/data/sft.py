"""Supervised fine-tuning data (``fxmeg train --sft``): JSON-lines files of prompt/response
pairs, or of conversations rendered with a chat template, tokenised with the model's
tokenizer (``--tokenizer-model``, a tokenizer.json); the loss counts response tokens only.

  a line       {"prompt": ..., "response": ...} (the keys: --sft-prompt-key,
               --sft-response-key); with --chat-template, {"messages": [{"role": "user",
               "content": ...}, {"role": "assistant", "content": ...}, ...]}
               (--sft-messages-key)
  an example   its tokens and which of them are targets: of a pair, the prompt (with the
               tokenizer's special tokens), then the response and the end-of-document token,
               the targets; of a conversation, the rendered text, the targets the tokens that
               start inside what each assistant turn adds to the rendering (its content and
               the template's end-of-turn text, never the next turn's header)
  a sample     input x[:-1], labels x[1:] with -100 where x[t + 1] is no target

Two layouts (--sft-layout): ``packed`` (examples fill windows whole, each attending only to
itself) and ``padded`` (one example per row, variable lengths): docs/architecture.md §8.8.

Each split (--split over the examples of one file, or --train-data-path and
--valid-data-path) is shuffled every epoch (numpy RandomState(seed + epoch).permutation of
its samples); stream position p reads sample order[p], so a resume continues at any dp.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from fxmeg.data.corpus import json_records
from fxmeg.data.gpt_order import split_documents
from fxmeg.data.tokenizer import HFTokenizer
from fxmeg.errors import DataError

LAYOUTS = ("packed", "padded")


@dataclass(frozen=True)
class SFTFormat:
    """How to read the lines and lay the examples out (the --sft-* flags)."""

    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str = "messages"
    chat_template: str = ""
    """A Jinja template file, or a tokenizer_config.json holding ``chat_template``."""
    layout: str = "packed"
    pad_multiple: int = 8


class Example(NamedTuple):
    tokens: np.ndarray  # int64
    targets: np.ndarray  # bool, per token: a response token the loss learns


class ChatTemplate:
    """A chat template rendered as transformers renders it: sandboxed Jinja (trim_blocks,
    lstrip_blocks, loop controls, ``{% generation %}`` blocks rendered as they stand),
    ``tojson``, ``raise_exception`` and ``strftime_now``; the variables ``messages`` and
    ``add_generation_prompt``, and ``bos_token`` / ``eos_token`` from the tokenizer_config.json
    beside the tokenizer (or the one holding the template), else "" and the tokenizer's
    end-of-document token. A template error is refused naming the file."""

    def __init__(self, path: str, tokenizer: HFTokenizer) -> None:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        eos = tokenizer.token(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        specials = {"bos_token": "", "eos_token": eos} | _specials(
            os.path.join(os.path.dirname(tokenizer.file), "tokenizer_config.json")
        )
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".json"):
            config = json.loads(text)
            text = config.get("chat_template")
            if isinstance(text, list):  # named templates: the default one
                text = next((t["template"] for t in text if t.get("name") == "default"), None)
            if not isinstance(text, str):
                raise DataError(f"chat template {path}: the file has no chat_template string")
            specials |= _specials(path)

        def fail(message: str):
            raise DataError(f"chat template {path}: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _generation_extension()])
        env.filters["tojson"] = _tojson
        env.globals |= {
            "raise_exception": fail,
            "strftime_now": lambda f: datetime.datetime.now().strftime(f),
        }
        self.path, self._specials, self._errors = path, specials, TemplateError
        try:
            self._template = env.from_string(text)
        except TemplateError as e:
            raise DataError(f"chat template {path}: {type(e).__name__}: {e}") from e

    def __call__(self, messages: list, add_generation_prompt: bool = False) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._specials
            )
        except (self._errors, TypeError, KeyError) as e:
            raise DataError(
                f"chat template {self.path} failed to render: {type(e).__name__}: {e}"
            ) from e


def _specials(config_path: str) -> dict[str, str]:
    """bos_token and eos_token of a tokenizer_config.json (a string, or a dict with "content")."""
    if not os.path.isfile(config_path):
        return {}
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    found = {k: config.get(k) for k in ("bos_token", "eos_token")}
    return {k: v["content"] if isinstance(v, dict) else str(v) for k, v in found.items() if v}


def _tojson(
    value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _generation_extension():
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with
        it): its body, rendered as it stands; the targets come from rendering prefixes."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


def read_examples(path: str, tokenizer: HFTokenizer, fmt: SFTFormat) -> list[Example]:
    """Every line of the JSON-lines file ``path`` as an example; a line without the fields
    its format needs, or a conversation without an assistant turn, is refused naming the
    file and line."""
    if not os.path.isfile(path):
        raise DataError(f"--sft data {path!r} does not exist (one JSON-lines file per split)")
    template = ChatTemplate(fmt.chat_template, tokenizer) if fmt.chat_template else None
    examples = []
    for number, record in json_records(path, "--sft reads"):
        where = f"{path}:{number}"
        examples.append(
            _conversation(record, tokenizer, template, fmt.messages_key, where)
            if template
            else _pair(record, tokenizer, fmt, where)
        )
    if not examples:
        raise DataError(f"--sft data {path} holds no example")
    return examples


def _pair(record: dict, tokenizer: HFTokenizer, fmt: SFTFormat, where: str) -> Example:
    texts = [record.get(fmt.prompt_key), record.get(fmt.response_key)]
    if not all(isinstance(t, str) for t in texts):
        raise DataError(
            f"{where} has no string fields {fmt.prompt_key!r} and {fmt.response_key!r} (it has "
            f"{sorted(record)}); name them with --sft-prompt-key and --sft-response-key, or give "
            "--chat-template for conversations"
        )
    prompt = tokenizer.encode(texts[0])
    response = tokenizer.encode(texts[1], add_special_tokens=False) + [tokenizer.eos_id]
    return Example(np.array(prompt + response, dtype=np.int64),
                   np.array([False] * len(prompt) + [True] * len(response)))


def _conversation(
    record: dict, tokenizer: HFTokenizer, template: ChatTemplate, key: str, where: str
) -> Example:
    messages = record.get(key)
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise DataError(
            f"{where} has no conversation {key!r} (a list of messages with a 'role'; the line has "
            f"{sorted(record)}); name it with --sft-messages-key"
        )
    text = template(messages)
    chars = np.zeros(len(text) + 1, dtype=bool)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = (
            template(messages[:i], add_generation_prompt=True),
            template(messages[: i + 1]),
        )
        if not (text.startswith(upto) and upto.startswith(before)):
            raise DataError(
                f"{where}: chat template {template.path} does not render this conversation prefix "
                f"by prefix (message {i}), so its assistant turns cannot be told apart"
            )
        chars[len(before):len(upto)] = True
    if not chars.any():
        raise DataError(
            f"{where} has no assistant message to learn (roles {[m['role'] for m in messages]})"
        )
    ids, offsets = tokenizer.encode_offsets(text)
    return Example(
        np.array(ids, dtype=np.int64),
        np.array([end > start and bool(chars[start]) for start, end in offsets], dtype=bool),
    )


def pack(examples: Sequence[Example], seq_len: int, pad: int) -> dict[str, np.ndarray]:
    """The packed layout: (windows, seq_len) arrays "tokens", "labels" (-100: no target),
    "position_ids" and "segment" (the example of each position; padding is one more)."""
    windows: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for example in examples:
        pairs = _pairs(example, seq_len)
        if used + len(pairs[0]) > seq_len and windows[-1]:
            windows.append([])
            used = 0
        windows[-1].append(pairs)
        used += len(pairs[0])
    names = ("tokens", "labels", "position_ids", "segment")
    out = {k: np.zeros((len(windows), seq_len), dtype=np.int64) for k in names}
    for w, parts in enumerate(windows):
        rest = seq_len - sum(len(inputs) for inputs, _ in parts)
        padding = (np.full(rest, pad), np.full(rest, -100))
        start = 0
        for k, (inputs, labels) in enumerate([*parts, padding]):
            end = start + len(inputs)
            out["tokens"][w, start:end], out["labels"][w, start:end] = inputs, labels
            out["position_ids"][w, start:end] = np.arange(end - start)
            out["segment"][w, start:end] = k
            start = end
    return out


def _pairs(example: Example, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """An example's inputs and labels (-100 where the next token is no target), at most
    ``limit`` of them."""
    x, t = example
    return x[:-1][:limit], np.where(t[1:], x[1:], -100)[:limit]


def _learnable(examples: list[Example], seq_len: int) -> tuple[list[Example], int]:
    """The examples with a target within their first seq_len positions, and how many had none."""
    kept = [e for e in examples if (_pairs(e, seq_len)[1] != -100).any()]
    return kept, len(examples) - len(kept)


class _Split:
    """One split's samples and its order: every epoch a permutation of them."""

    def __init__(self, samples: int, needed: int, seed: int) -> None:
        epochs = max(1, -(-needed // samples))
        self.order = np.concatenate(
            [np.random.RandomState(seed + e).permutation(samples) for e in range(epochs)]
        )

    def __len__(self) -> int:
        return len(self.order)


class SFTData:
    """A run's SFT splits (the trainer's data when --sft): ``fields`` as TrainData's."""

    def __init__(self, paths, sizes: tuple[int, int, int], *, seq_len: int, seed: int,
                 tokenizer: HFTokenizer,
                 fmt: SFTFormat) -> None:
        files = _split_files(paths)
        self.pad = tokenizer.require_eos("--sft",
                                         "it ends each response with it: name it with --eod-id N")
        self.vocab_size, self.seq_len, self.fmt = tokenizer.vocab_size, seq_len, fmt
        if len(files) == 1:
            examples = read_examples(files[0], tokenizer, fmt)
            ranges = split_documents(paths.split, len(examples))
            parts = [examples[slice(*r)] if r else [] for r in ranges[:2]]
        else:
            parts = [read_examples(f, tokenizer, fmt) for f in files]
        (parts[0], skipped), (parts[1], skipped_valid) = (_learnable(p, seq_len) for p in parts)
        for part, name, fix in ((parts[0], "training", "--train-data-path"), (parts[1],
                                                                              "validation",
                                                                             "--valid-data-path")):
            if not part:
                raise DataError(
                    f"split {paths.split!r} leaves no {name} example with a target within seq_len "
                                f"{seq_len}: give that split a weight (e.g. '98,2,0') or {fix}")
        self.examples = parts
        self.windows = [pack(p, seq_len,
                             self.pad) for p in parts] if fmt.layout == "packed" else None
        counts = [len(w["tokens"]) for w in self.windows] if self.windows else [len(p)
                                                                                for p in parts]
        self.train, self.valid = (_Split(n, sizes[i], seed) for i, n in enumerate(counts))
        self.passes = sizes[0] / counts[0]
        """The passes over the train split the run's samples make (each pass a new permutation)."""
        self.rows = (f"{counts[0]} packed windows ({len(parts[0])} examples)" if self.windows
                     else f"{counts[0]} examples")
        """What one pass reads: the train split's rows."""
        cut = sum(len(x) - 1 > seq_len for p in parts for x, _ in p)
        skipped += skipped_valid
        self.summary = (f"sft: {len(parts[0])} train and {len(parts[1])} valid examples"
                        + (f" packed into {counts[0]} and {counts[1]} windows of {seq_len} tokens"
                           if self.windows
                           else f", one per row, padded to at most {seq_len} tokens")
                        + (f"; {cut} longer than {seq_len} tokens cut to it" if cut else "")
                        + (f"; {skipped} with no response token in their first {seq_len} left out"
                           if skipped else ""))

    def fields(self, split: str, positions: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples at stream ``positions`` (of the valid split: modulo its length):
        "tokens", "labels" (-100: no loss) and "position_ids" / "attend" (module docstring)."""
        k = 0 if split == "train" else 1
        order = (self.train, self.valid)[k].order
        rows = [int(order[p if k == 0 else p % len(order)]) for p in positions]
        if self.windows:
            w = {name: torch.from_numpy(a[rows]) for name, a in self.windows[k].items()}
            segment, s = w.pop("segment"), self.seq_len
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            return w | {"attend": (segment[:, :, None] == segment[:, None, :]) & causal}
        return self._padded([self.examples[k][r] for r in rows])

    def _padded(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        longest = max(len(x) - 1 for x, _ in examples)
        s = min(self.seq_len, -(-longest // self.fmt.pad_multiple) * self.fmt.pad_multiple)
        tokens = torch.full((len(examples), s), self.pad, dtype=torch.long)
        labels = torch.full((len(examples), s), -100, dtype=torch.long)
        attend = torch.zeros((len(examples), s), dtype=torch.long)
        for r, example in enumerate(examples):
            inputs, targets = _pairs(example, s)
            n = len(inputs)
            tokens[r, :n], labels[r, :n] = torch.from_numpy(inputs), torch.from_numpy(targets)
            attend[r, :n] = 1
        return {"tokens": tokens, "labels": labels, "attend": attend}


def _split_files(paths) -> list[str]:
    """The JSON-lines file cut by --split ([one]), or the train and valid files."""
    if paths.blend:
        if len(paths.blend) != 1:
            raise DataError("--sft reads one JSON-lines file per split, not a blend: --data-path "
                            + " ".join(paths.blend))
        return list(paths.blend)
    files = [paths.per_split[0], paths.per_split[1]]
    if any(len(f) != 1 for f in files):
        raise DataError(
            "--sft reads one JSON-lines file per split: give --train-data-path FILE and "
            "--valid-data-path FILE"
        )
    return [f[0] for f in files]
