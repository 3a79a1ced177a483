"""Tokenisers: a byte-level one built in, a Hugging Face ``tokenizers`` file when given."""

from __future__ import annotations

import os
from typing import Protocol

from fxmeg.errors import DataError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def require_eos(self, who: str, fix: str) -> int: ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens (0-255); 256 ends a document."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def require_eos(self, who: str, fix: str) -> int:
        return self.eos_id

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` JSON file (e.g. a model's tokenizer.json), or a directory holding
    one. Its end-of-document id is ``eos_id``, else the id of ``eos``, else that of the first
    of EOS_NAMES it has, else None (``require_eos`` refuses that where one is needed)."""

    EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")

    def __init__(self, path: str, eos: str | None = None, *, eos_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise DataError(
                f"tokenizer {path!r}: {file} does not exist (give a tokenizer.json or its "
                "directory)"
            )
        self._tok = _Tokenizer.from_file(file)
        self.name = path
        self.vocab_size = self._tok.get_vocab_size()
        names = [eos] if eos else list(self.EOS_NAMES)
        ids = [self._tok.token_to_id(c) for c in names]
        self.eos_id = (
            eos_id if eos_id is not None else next((i for i in ids if i is not None), None)
        )
        self.file, self._eos_names = file, names

    def require_eos(self, who: str, fix: str) -> int:
        """The end-of-document id, which ``who`` needs; without one, refused naming ``fix``."""
        if self.eos_id is None:
            raise DataError(
                f"{who} needs the end-of-document id, and tokenizer {self.file} has none of the "
                f"tokens {self._eos_names}: {fix}"
            )
        return self.eos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` as it stands (no special tokens added) and each one's
        character span [start, end)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def token(self, i: int) -> str:
        return self._tok.id_to_token(i)


def load_tokenizer(spec: str | None) -> Tokenizer:
    """None or "bytes": the byte tokenizer; otherwise a path to a tokenizers JSON file."""
    return ByteTokenizer() if spec in (None, "bytes") else HFTokenizer(spec)
