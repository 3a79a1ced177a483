"""``--data-cache-path``: the sample-order indices of a run's data on disk, so later runs (and
every rank of this one after the first to finish) read them memory-mapped instead of
building them again, as Megatron's ``path_to_cache`` does.

An entry is the arrays one build makes (a dataset split's document, sample and shuffle
indices; a blend's dataset and sample indices) under a key: the MD5 of a JSON description of
everything the arrays depend on (for an order, the dataset's path, its document and token
counts and the MD5 of its document lengths, the documents of the split, seq_len, the
samples, the seed). Files:

  DIR/KEY-KIND-NAME.npy        each array
  DIR/KEY-KIND-description.txt the description, written last: an entry without it is not
                               complete and is built again

Each file is written under a unique temporary name and renamed into place, so ranks (on
any machine sharing the directory) building the same entry at once never read a partial
file (they write the same bytes). Megatron's own
cache is not read: its key hashes its tokenizer object's identifiers, which fxmeg does not
have, so the files are named differently on purpose.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable

import numpy as np

from fxmeg.data.gpt_order import GPTOrder, build_order
from fxmeg.errors import DataError

ORDER = ("document_index", "sample_index", "shuffle_index")
BLEND = ("dataset", "within")


def cached(directory: str, kind: str, description: dict, names: tuple[str, ...],
           build: Callable[[], tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """The arrays ``names`` of the entry ``description`` in ``directory`` (memory-mapped),
    else ``build()``'s, written there; with no directory, ``build()``'s."""
    if not directory:
        return build()
    text = json.dumps({"kind": kind} | description, indent=4, sort_keys=True)
    base = os.path.join(directory, f"{hashlib.md5(text.encode()).hexdigest()}-{kind}")
    try:
        with open(f"{base}-description.txt") as f:
            if f.read() == text:
                return tuple(np.load(f"{base}-{name}.npy", mmap_mode="r") for name in names)
    except FileNotFoundError:
        pass
    arrays = build()
    try:
        os.makedirs(directory, exist_ok=True)
        for name, array in zip(names, arrays):
            _write(f"{base}-{name}.npy", lambda f, a=array: np.save(f, a))
        _write(f"{base}-description.txt", lambda f: f.write(text.encode()))
    except OSError as e:
        raise DataError(
            f"--data-cache-path {directory}: cannot write the index cache there ({e}); give a "
            "writable directory, or none"
        ) from e
    return arrays


def _write(path: str, fill: Callable) -> None:
    handle, temporary = tempfile.mkstemp(
        dir=os.path.dirname(path),
        prefix=os.path.basename(path) + ".",
        # unique across ranks and machines sharing the directory
        suffix=".tmp",
    )
    try:
        with os.fdopen(handle, "wb") as f:
            fill(f)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def order(
    directory: str,
    data,
    documents: tuple[int, int],
    *,
    seq_len: int,
    num_samples: int | None,
    seed: int,
) -> GPTOrder:
    """``gpt_order.build_order`` of the documents [begin, end) of ``data`` (an indexed
    dataset: ``prefix``, ``lengths``, ``num_documents``), through the cache in ``directory``."""
    description = {
        "dataset": os.path.realpath(data.prefix),
        "documents_in_dataset": int(data.num_documents),
        "tokens_in_dataset": int(np.sum(data.lengths, dtype=np.int64)),
        "lengths_md5": hashlib.md5(np.ascontiguousarray(data.lengths).tobytes()).hexdigest(),
        "documents": list(documents),
        "seq_len": seq_len,
        "num_samples": num_samples,
        "seed": seed,
    }

    def build():
        ids = np.arange(*documents, dtype=np.int32)
        made = build_order(data.lengths, ids, seq_len=seq_len, num_samples=num_samples, seed=seed)
        assert made.epochs == len(made.document_index) // len(ids)
        return made.document_index, made.sample_index, made.shuffle_index

    arrays = cached(directory, "GPTOrder", description, ORDER, build)
    # a cached index records no epoch count: its document index lists each document once per epoch
    return GPTOrder(*arrays, epochs=len(arrays[0]) // (documents[1] - documents[0]))
