"""Megatron's indexed dataset format (``PREFIX.bin`` / ``PREFIX.idx``), read and written.

``PREFIX.bin`` holds every sequence's token ids end to end, in one dtype. ``PREFIX.idx``:

  magic            9 bytes  ``MMIDIDX\\x00\\x00``
  version          u64      1
  dtype code       u8       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                            7 float32, 8 uint16 (``DTYPE_CODES``)
  sequence count   u64      S
  document count   u64      D + 1 (the entries of the document index)
  lengths          S x i32  tokens of each sequence
  pointers         S x i64  byte offset of each sequence in the .bin
  document index   (D+1) x i64  the first sequence of each document, then S
  modes            S x i8   optional (multimodal datasets): one per sequence

Megatron's ``tools/preprocess_data.py`` writes one sequence per document unless it splits
sentences; fxmeg writes one sequence per document. Neither file says the vocabulary size
or the end-of-document id: fxmeg keeps both in ``PREFIX.json`` beside them
(fxmeg/data/corpus.py), and Megatron ignores that file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


class IndexedDataError(ValueError):
    """A .bin / .idx pair that is not Megatron's format or does not agree with itself."""


def is_indexed(prefix: str) -> bool:
    """Whether ``PREFIX.idx`` starts with Megatron's magic (fxmeg's older corpus format
    wrote raw int64 document starts there)."""
    with open(prefix + ".idx", "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


class IndexedDataset:
    """A memory-mapped ``PREFIX.bin`` / ``PREFIX.idx`` pair, checked when opened: every
    refusal names the file and what is wrong in it."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        with open(idx, "rb") as f:
            head = f.read(_HEADER)
        if len(head) < _HEADER or head[: len(MAGIC)] != MAGIC:
            raise IndexedDataError(
                f"{idx} is not Megatron's indexed format: it does not start with the "
                f"magic {MAGIC!r} (write it with fxmeg prepare-data or Megatron's "
                "tools/preprocess_data.py)"
            )
        version, code, count, documents = struct.unpack("<QBQQ", head[len(MAGIC) :])
        if version != VERSION:
            raise IndexedDataError(
                f"{idx} is version {version} of the indexed format; fxmeg reads version {VERSION}"
            )
        if code not in DTYPE_CODES:
            raise IndexedDataError(f"{idx} names token dtype code {code}, not one of "
                                   f"{ {c: np.dtype(t).name for c, t in DTYPE_CODES.items()} }")
        self.dtype = np.dtype(DTYPE_CODES[code])
        size = os.path.getsize(idx)
        arrays = _HEADER + count * (4 + 8) + documents * 8
        if size not in (arrays, arrays + count):
            raise IndexedDataError(
                f"{idx} holds {size} bytes, but its header ({count} sequences, {documents} "
                f"document index entries) needs {arrays} (or {arrays + count} with modes): "
                "it is truncated or was written by another program"
            )
        index = np.memmap(idx, mode="r", dtype=np.uint8)
        self.lengths = index[_HEADER:][: count * 4].view(np.int32)
        self.pointers = index[_HEADER + count * 4 :][: count * 8].view(np.int64)
        self.document_index = index[_HEADER + count * 12 :][: documents * 8].view(np.int64)
        self.modes = index[arrays:].view(np.int8) if size > arrays else None
        expected = (
            int(self.pointers[-1]) + int(self.lengths[-1]) * self.dtype.itemsize if count else 0
        )
        actual = os.path.getsize(bin_)
        if actual != expected:
            raise IndexedDataError(
                f"{bin_} holds {actual} bytes, but {idx} says its sequences end at byte "
                f"{expected}: the .bin is {'truncated' if actual < expected else 'longer'} "
                "or from another run"
            )
        self.tokens = (
            np.memmap(bin_, mode="r", dtype=self.dtype) if actual else np.zeros(0, self.dtype)
        )

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence ``i``'s tokens (a view of the memory map)."""
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.lengths[i])]

    @property
    def num_documents(self) -> int:
        return len(self.document_index) - 1

    def document_starts(self) -> np.ndarray:
        """The token offset where each document starts in the .bin."""
        return self.pointers[self.document_index[:-1]] // self.dtype.itemsize


def write_indexed(prefix: str, documents: Iterable[np.ndarray], dtype) -> tuple[int, int]:
    """Write ``documents`` (arrays of token ids, one sequence each) as ``PREFIX.bin`` and
    ``PREFIX.idx`` in Megatron's format, each file replaced only once complete (when
    ``documents`` fails, its partial file is removed and nothing at ``prefix`` changes).
    Returns (documents, tokens)."""
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF:
        raise IndexedDataError(f"the indexed format has no code for dtype {dtype.name}")
    lengths = []
    try:
        with open(prefix + ".bin.tmp", "wb") as out:
            for doc in documents:
                arr = np.asarray(doc)
                if arr.size and dtype.kind in "iu":
                    info = np.iinfo(dtype)
                    if arr.min() < info.min or arr.max() > info.max:
                        raise IndexedDataError(
                            f"document {len(lengths)} holds token ids {arr.min()}..{arr.max()}, "
                            f"which {dtype.name} cannot hold"
                        )
                arr.astype(dtype, copy=False).tofile(out)
                lengths.append(arr.size)
    except BaseException:
        os.remove(prefix + ".bin.tmp")
        raise
    lengths_ = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths_[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(prefix + ".idx.tmp", "wb") as f:
        f.write(
            MAGIC + struct.pack("<QBQQ", VERSION, _CODE_OF[dtype], len(lengths), len(lengths) + 1)
        )
        f.write(lengths_.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return len(lengths), int(lengths_.sum())
