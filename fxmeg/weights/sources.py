"""Weights sources that read only the boxes of a tensor a rank holds.

A model built on the meta device is materialised rank by rank: each rank asks a weights
source for the boxes (``fxmeg.weights.sharding.Box``) of each full tensor that its shards cover,
and nothing else is read. Every source answers the same small interface (``Weights``):

- ``names()`` and ``shape(name)`` come from metadata only (a safetensors header, a DCP
  ``.metadata`` file, the pickle of a memory-mapped ``torch.save`` file), so every rank
  can check the source against the model (``check``) before any collective;
- ``fill(requests)`` copies ``full_tensor[global_box]`` into ``view(out, local_box)`` for
  every (global box, local box) pair, converting the dtype; ``reads`` counts the
  requests per name, so a test can see that a rank read only what it needs.

Sources (``open_weights``): an in-memory state_dict; a ``torch.save`` file (memory-mapped:
only the pages of the boxes read are touched); a ``.safetensors`` file or a Hugging Face
directory (``model.safetensors``, or ``model.safetensors.index.json`` with several shard
files, each opened only when one of its tensors is read); an fxmeg checkpoint (its
``latest`` iteration, or one iteration directory), whose ``model/<fqn>`` entries are the
names. A DCP read loads whole stored chunks and keeps the boxes asked for: a checkpoint
saved at the same tensor-parallel layout reads about this rank's shard.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fxmeg.errors import WeightsError, closest
from fxmeg.weights.sharding import Box, Pieces, dcp_load, view

# fxmeg.weights.checkpoint's layout; not imported from there: it imports the runtime, which
# imports this module
LATEST, META, DCP_METADATA, MODEL_PREFIX = "latest", "meta.json", ".metadata", "model/"
SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
)

# safetensors dtype names -> torch dtypes (the float8 ones exist only in newer torch)
_SAFETENSORS_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in [
        ("F64", "float64"),
        ("F32", "float32"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("I64", "int64"),
        ("I32", "int32"),
        ("I16", "int16"),
        ("I8", "int8"),
        ("U64", "uint64"),
        ("U32", "uint32"),
        ("U16", "uint16"),
        ("U8", "uint8"),
        ("BOOL", "bool"),
        ("C64", "complex64"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E8M0", "float8_e8m0fnu"),
    ]
    if hasattr(torch, attr)
}

Request = tuple[str, torch.Tensor, list[tuple[Box, Box]]]  # (name, out, [(global box, local box)])


class Weights:
    """A source of full tensors by name that reads only the boxes asked for."""

    def __init__(self, where: str) -> None:
        self.where = where
        """The source, for messages: a path, or "<state_dict>"."""
        self.reads: Counter[str] = Counter()
        """name -> how many fill requests read its data."""

    def names(self) -> set[str]:
        """Every tensor name in the source."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The full shape and stored dtype of ``name``, from metadata (no data read)."""
        raise NotImplementedError

    def file(self, name: str) -> str:
        """The file that holds ``name`` (for messages)."""
        return self.where

    def fill(self, requests: Sequence[Request]) -> None:
        """For each (name, out, pairs) and every (global box, local box) pair:
        ``view(out, local).copy_(full[global])``. Reads only those boxes; counts one read
        per request. Raises WeightsError for an unknown name or a box outside the tensor."""
        for name, out, pairs in requests:
            _check_request(self, name, out, pairs)
            for glob, local in pairs:
                if math.prod(glob[1]) > 0:
                    view(out, local).copy_(self._read(name, glob))
            self.reads[name] += 1

    def _read(self, name: str, box: Box) -> torch.Tensor:
        """The box of ``name`` (any dtype; fill converts)."""
        raise NotImplementedError

    def _unknown(self, name: str) -> WeightsError:
        return WeightsError(f"no tensor {name!r} in {self.where}{closest(name, self.names())}")


class StateDictWeights(Weights):
    """Tensors held in a mapping: a user's state_dict, or a memory-mapped torch.save file."""

    def __init__(self, state: Mapping[str, torch.Tensor], *, where: str = "<state_dict>") -> None:
        super().__init__(where)
        self.state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def names(self) -> set[str]:
        return set(self.state)

    def shape(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name not in self.state:
            raise self._unknown(name)
        t = self.state[name]
        return tuple(t.shape), t.dtype

    def _read(self, name: str, box: Box) -> torch.Tensor:
        return view(self.state[name].detach(), box)


class SafetensorsWeights(Weights):
    """Tensors in one or more safetensors files. A file's header is read (by ``shape``)
    only when one of its tensors is asked about; the file is opened for data only when
    one of its tensors is read (``opened_files``)."""

    def __init__(self, files: Mapping[str, str], *, where: str) -> None:
        super().__init__(where)
        self.files = dict(files)
        """name -> the path of the file holding it."""
        self.headers: dict[str, dict] = {}
        """path -> its parsed header, for the files whose header was read."""
        self.opened_files: list[str] = []
        """The files opened for data, in order."""
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def file(self, name: str) -> str:
        return self.files.get(name, self.where)

    def shape(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name not in self.files:
            raise self._unknown(name)
        path = self.files[name]
        if path not in self.headers:
            self.headers[path] = _safetensors_header(path)
        entry = self.headers[path].get(name)
        if entry is None:
            raise WeightsError(
                f"{path} has no tensor {name!r}, though the index of {self.where} names it"
            )
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise WeightsError(
                f"{name!r} in {path} has dtype {entry['dtype']}, which this torch cannot hold"
            )
        return tuple(entry["shape"]), _SAFETENSORS_DTYPES[entry["dtype"]]

    def _read(self, name: str, box: Box) -> torch.Tensor:
        try:
            from safetensors import safe_open  # optional: only safetensors sources need it
        except ImportError as exc:
            raise WeightsError(f"reading {self.where} needs: pip install safetensors") from exc
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
            self.opened_files.append(path)
        return self._handles[path].get_slice(name)[tuple(slice(o, o + s) for o, s in zip(*box))]


class DcpWeights(Weights):
    """The ``model/<fqn>`` entries of a torch.distributed.checkpoint directory (an fxmeg
    checkpoint iteration), read with one ``dcp.load`` per fill."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        try:
            self.metadata = FileSystemReader(path).read_metadata()
        except Exception as exc:
            raise WeightsError(
                f"{os.path.join(path, DCP_METADATA)} is missing or unreadable: {exc}"
            ) from exc
        self.entries = {
            key[len(MODEL_PREFIX) :]: md
            for key, md in self.metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)
        }

    def names(self) -> set[str]:
        return set(self.entries)

    def shape(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name not in self.entries:
            raise self._unknown(name)
        md = self.entries[name]
        return tuple(md.size), md.properties.dtype

    def file(self, name: str) -> str:
        for index, info in (self.metadata.storage_data or {}).items():
            if index.fqn == MODEL_PREFIX + name:
                return os.path.join(self.where, info.relative_path)
        return self.where

    def fill(self, requests: Sequence[Request]) -> None:
        for name, out, pairs in requests:
            _check_request(self, name, out, pairs)
        for state in _dcp_rounds(self, requests):
            dcp_load(state, self.where)  # each rank reads its own slices: no collective
        for name, _, _ in requests:
            self.reads[name] += 1


def _dcp_rounds(weights: DcpWeights, requests: Sequence[Request]) -> list[dict[str, Pieces]]:
    """The requests as DCP state dicts ``model/<name> -> Pieces``, one per dcp.load: a
    Pieces finds its parts by global offset, so a box asked for twice (into two outputs)
    goes to a later round. Usually one round."""
    rounds: list[dict[str, list]] = []
    for name, out, pairs in requests:
        for glob, local in pairs:
            i = 0
            offsets = tuple(glob[0])
            while i < len(rounds) and any(off == offsets for off, _ in rounds[i].get(name, [])):
                i += 1
            if i == len(rounds):
                rounds.append({})
            rounds[i].setdefault(name, []).append((offsets, view(out, local)))
    return [
        {MODEL_PREFIX + name: Pieces(weights.shape(name)[0], parts) for name, parts in r.items()}
        for r in rounds
    ]


def _check_request(
    weights: Weights, name: str, out: torch.Tensor, pairs: list[tuple[Box, Box]]
) -> None:
    """Raise WeightsError unless ``name`` exists and every global box lies inside it and
    matches its local box's sizes inside ``out``."""
    shape, _ = weights.shape(name)
    for glob, local in pairs:
        inside = len(glob[0]) == len(shape) and all(
            o >= 0 and o + s <= n for o, s, n in zip(*glob, shape)
        )
        fits = tuple(glob[1]) == tuple(local[1]) and all(
            o >= 0 and o + s <= n for o, s, n in zip(*local, out.shape)
        )
        if not (inside and fits):
            raise WeightsError(
                f"cannot read box {glob} of {name!r} (shape {shape}, in {weights.file(name)}) "
                f"into box {local} of a tensor of shape {tuple(out.shape)}; check the weights "
                f"with fxmeg.weights.sources.check first"
            )


# ---------------------------------------------------------------- opening


def open_weights(source: object) -> Weights:
    """The Weights of ``source``: a Weights (returned as is); an in-memory state_dict; a
    torch.save state_dict file (.pt/.pth/.bin); a .safetensors file; a directory with
    model.safetensors.index.json, model.safetensors or pytorch_model.bin; an fxmeg
    checkpoint directory (its ``latest`` iteration) or one iteration directory. Reads
    metadata only. Raises WeightsError for anything else."""
    if isinstance(source, Weights):
        return source
    if isinstance(source, Mapping):
        return StateDictWeights(source)
    if not isinstance(source, (str, os.PathLike)):
        raise WeightsError(f"weights must be a state_dict or a path, not {type(source).__name__}")
    path = os.fspath(source)
    if os.path.isdir(path):
        return _open_directory(path)
    if os.path.isfile(path):
        return _open_safetensors(path) if path.endswith(".safetensors") else _open_torch(path)
    raise WeightsError(
        f"weights {path!r} do not exist; pass a state_dict, a weights file or a checkpoint "
        f"directory"
    )


def _open_directory(path: str) -> Weights:
    def has(name: str) -> bool:
        return os.path.exists(os.path.join(path, name))

    if has(LATEST):
        with open(os.path.join(path, LATEST)) as f:
            return DcpWeights(os.path.join(path, f.read().strip()))
    if has(META) and has(DCP_METADATA):
        return DcpWeights(path)
    if has(SAFETENSORS_INDEX):
        return _open_safetensors_index(os.path.join(path, SAFETENSORS_INDEX))
    if has(SAFETENSORS):
        return _open_safetensors(os.path.join(path, SAFETENSORS))
    if has(TORCH_BIN):
        return _open_torch(os.path.join(path, TORCH_BIN))
    raise WeightsError(
        f"{path} holds no weights fxmeg can read: expected an fxmeg checkpoint ({LATEST}, "
        f"or {META} and {DCP_METADATA}), {SAFETENSORS_INDEX}, {SAFETENSORS} or {TORCH_BIN}"
    )


def _open_torch(path: str) -> StateDictWeights:
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise WeightsError(
            f"cannot read {path} as a torch.save state_dict ({exc}); save it with "
            f"torch.save(model.state_dict(), path) or pass a .safetensors file"
        ) from exc
    if not isinstance(state, Mapping) or not any(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        keys = list(state)[:5] if isinstance(state, Mapping) else []
        raise WeightsError(
            f"{path} holds a {type(state).__name__} with no tensors at the top level "
            f"(keys {keys}); save the state_dict itself: torch.save(model.state_dict(), path)"
        )
    return StateDictWeights(state, where=path)


def _open_safetensors(path: str) -> SafetensorsWeights:
    header = _safetensors_header(path)
    weights = SafetensorsWeights({name: path for name in header}, where=path)
    weights.headers[path] = header
    return weights


def _open_safetensors_index(index: str) -> SafetensorsWeights:
    """A Hugging Face sharded checkpoint: the index's weight_map names each tensor's file."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        raise WeightsError(f"{index} is not a safetensors index with a weight_map: {exc}") from exc
    folder = os.path.dirname(index)
    files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
    missing = sorted({p for p in files.values() if not os.path.isfile(p)})
    if missing:
        raise WeightsError(f"{index} names shard files that are missing: {', '.join(missing[:3])}")
    return SafetensorsWeights(files, where=folder)


def _safetensors_header(path: str) -> dict:
    """name -> {"dtype", "shape", "data_offsets"} from the header of a safetensors file
    (8 bytes of little-endian length, then that much JSON); its data is not read."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > os.path.getsize(path) - 8:
                raise ValueError(f"header length {length} exceeds the file")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise WeightsError(f"{path} is not a readable safetensors file: {exc}") from exc
    header.pop("__metadata__", None)
    return header


# ---------------------------------------------------------------- check


def check(
    weights: Weights, wanted: Mapping[str, tuple[Sequence[str], Sequence[int]]]
) -> dict[str, str]:
    """Requires: wanted maps each canonical name to (every alias it may have in a
    state_dict, in preference order; its full shape). Ensures: canonical name -> the
    first alias the source holds, with the wanted shape. Metadata only, no collective.
    Raises WeightsError naming a missing parameter (or, when little matches, saying the
    weights seem to be another model's) or a shape mismatch with both shapes and the file."""
    names = weights.names()
    found: dict[str, str] = {}
    for canonical, (aliases, _) in wanted.items():
        hit = next((a for a in aliases if a in names), None)
        if hit is not None:
            found[canonical] = hit
    missing = [c for c in wanted if c not in found]
    if missing:
        raise WeightsError(_missing_message(weights, wanted, missing, names - set(found.values())))
    bad = [c for c in wanted if tuple(weights.shape(found[c])[0]) != tuple(wanted[c][1])]
    if bad:
        raise WeightsError(_shape_message(weights, wanted, found, bad))
    return found


def _missing_message(
    weights: Weights, wanted: Mapping, missing: list[str], unused: set[str]
) -> str:
    names = weights.names()
    if len(missing) > len(wanted) / 2 and len(unused) > len(names) / 2:
        return (
            f"the weights in {weights.where} seem to belong to another model: {len(missing)} of "
            f"{len(wanted)} parameters are missing and {len(unused)} of {len(names)} tensors "
            f"there are unused; the model wants e.g. {_few(missing)}, the weights hold e.g. "
            f"{_few(sorted(unused))}; pass the weights of this model (names as in "
            f"model.state_dict())"
        )
    shown = "; ".join(_named(c, wanted[c][0]) + closest(c, unused) for c in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    return (
        f"{len(missing)} of {len(wanted)} parameters are not in {weights.where}: {shown}{more}; "
        f"the names in the weights must match model.state_dict(), or a Hugging Face "
        f"checkpoint's as transformers renames them while loading (a checkpoint of another "
        f"format must be loaded with from_pretrained and saved again)"
    )


def _shape_message(weights: Weights, wanted: Mapping, found: dict[str, str], bad: list[str]) -> str:
    def one(c: str) -> str:
        held = weights.shape(found[c])[0]
        source = "" if found[c] == c else f" (as {found[c]!r})"
        file = weights.file(found[c])
        return f"{c!r} has shape {tuple(wanted[c][1])} in the model but {held} in {file}{source}"

    more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
    return (
        f"{len(bad)} of {len(wanted)} parameters do not fit the weights: "
        + "; ".join(one(c) for c in bad[:3])
        + more
        + "; load weights saved from a model of the same configuration (sizes, heads, vocabulary)"
    )


def _named(canonical: str, aliases: Sequence[str]) -> str:
    others = [a for a in aliases if a != canonical]
    return repr(canonical) + (f" (or {', '.join(map(repr, others))})" if others else "")


def _few(names: Sequence[str], n: int = 3) -> str:
    return ", ".join(map(repr, names[:n])) + (", ..." if len(names) > n else "")
