"""A tokenised corpus on disk, in Megatron's indexed format (fxmeg/data/indexed.py):
``PREFIX.bin`` holds every document's token ids end to end, each followed by the
end-of-document token, ``PREFIX.idx`` Megatron's index of them (one sequence per
document); ``PREFIX.json`` the dtype, counts and tokenizer, which the two files do not
say. The token array is memory-mapped, so a corpus larger than memory trains the same
way. Files of fxmeg's older format (``PREFIX.idx`` raw int64 document starts, told apart
by the missing ``MMIDIDX`` magic) still read."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import numpy as np

from fxmeg.data.indexed import IndexedDataset, is_indexed, write_indexed
from fxmeg.data.tokenizer import Tokenizer
from fxmeg.errors import DataError


class Corpus:
    def __init__(self, prefix: str) -> None:
        with open(prefix + ".json") as f:
            self.meta = json.load(f)
        if is_indexed(prefix):
            data = IndexedDataset(prefix)
            self.tokens, self.doc_starts = data.tokens, data.document_starts()
        else:  # fxmeg's older format
            self.tokens = np.memmap(prefix + ".bin", dtype=self.meta["dtype"], mode="r")
            self.doc_starts = np.fromfile(prefix + ".idx", dtype=np.int64)
        if len(self.tokens) != self.meta["num_tokens"]:
            raise ValueError(
                f"{prefix}.bin holds {len(self.tokens)} tokens but {prefix}.json says "
                f"{self.meta['num_tokens']}: the corpus is truncated or from another run"
            )

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def __len__(self) -> int:
        return len(self.tokens)


def prepare(documents: Iterable[str], prefix: str, tokenizer: Tokenizer) -> dict:
    """Tokenise ``documents`` into the corpus at ``prefix`` (Megatron's indexed format, each
    document followed by the end-of-document token); returns its metadata. When reading
    the documents fails, nothing at ``prefix`` changes (``write_indexed``)."""
    eos = tokenizer.require_eos(
        "prepare-data", "it ends every document with it; use a tokenizer that has one"
    )
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    encoded = (tokenizer.encode(text) for text in documents)
    count, total = write_indexed(prefix, (np.asarray(ids + [eos]) for ids in encoded if ids), dtype)
    meta = {
        "dtype": np.dtype(dtype).name, "num_tokens": total, "num_documents": count,
        "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "tokenizer": tokenizer.name,
        "format": "megatron-indexed",
    }
    with open(prefix + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def read_documents(inputs: Iterable[str]) -> Iterator[str]:
    """Documents from inputs: a text file is one document, a directory gives its .txt,
    .md, .rst and .py files (sorted), ``pydoc:topics`` gives each topic of the Python
    reference that ships with CPython, and ``stdlib:PKG`` the sources of a standard-library
    package (real text, no download)."""
    for spec in inputs:
        if spec == "pydoc:topics":
            from pydoc_data.topics import topics

            yield from (topics[k] for k in sorted(topics))
        elif spec.startswith("stdlib:"):
            import importlib.util

            found = importlib.util.find_spec(spec.split(":", 1)[1])
            if found is None or not found.submodule_search_locations:
                raise FileNotFoundError(f"{spec!r} names no standard-library package")
            yield from read_documents(list(found.submodule_search_locations))
        elif os.path.isdir(spec):
            for root, dirs, files in os.walk(spec):
                dirs.sort()
                for name in sorted(files):
                    if name.endswith((".txt", ".md", ".rst", ".py")):
                        yield _read(os.path.join(root, name))
        elif os.path.isfile(spec):
            yield _read(spec)
        else:
            raise FileNotFoundError(
                f"prepare-data input {spec!r} is neither a file, a directory, pydoc:topics nor "
                "stdlib:PKG"
            )


def read_json_lines(inputs: Iterable[str], key: str) -> Iterator[str]:
    """The ``key`` field of every line of JSON-lines files, as Megatron's
    ``tools/preprocess_data.py --json-keys`` reads them (a directory: its .jsonl and .json
    files, sorted). A line that is not a JSON object with a string ``key`` is refused,
    naming the file and line."""
    for spec in inputs:
        paths = [spec]
        if os.path.isdir(spec):
            paths = sorted(os.path.join(root, n) for root, _, files in os.walk(spec) for n in files
                           if n.endswith((".jsonl", ".json")))
        elif not os.path.isfile(spec):
            raise FileNotFoundError(
                f"prepare-data input {spec!r} is neither a JSON-lines file nor a directory"
            )
        for path in paths:
            for number, record in json_records(path, "--json-keys reads"):
                value = record.get(key)
                if not isinstance(value, str):
                    raise DataError(
                        f"{path}:{number} has no text field {key!r} (it has {sorted(record)}); "
                        "pass --json-keys with the field that holds the text"
                    )
                yield value


def json_records(path: str, reader: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of the JSON-lines file ``path``; a line
    that is not a JSON object is refused naming the file, the line and ``reader`` (who
    reads it: "--json-keys reads")."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{number} is not a JSON line ({e.msg}); {reader} one JSON object "
                    "per line"
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}:{number} is a JSON {type(record).__name__}, not an object; {reader} "
                    "one JSON object per line"
                )
            yield number, record


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
