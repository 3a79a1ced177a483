"""Tokenisers: a byte-level one built in, a Hugging Face ``tokenizers`` file when given."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens (0-255); 256 ends a document."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` JSON file (e.g. a model's tokenizer.json)."""

    def __init__(self, path: str, eos: str | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(path)
        self.name = path
        self.vocab_size = self._tok.get_vocab_size()
        candidates = [eos] if eos else ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]
        ids = [self._tok.token_to_id(c) for c in candidates if c]
        self.eos_id = next((i for i in ids if i is not None), self.vocab_size - 1)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids


def load_tokenizer(spec: str | None) -> Tokenizer:
    """None or "bytes": the byte tokenizer; otherwise a path to a tokenizers JSON file."""
    return ByteTokenizer() if spec in (None, "bytes") else HFTokenizer(spec)
