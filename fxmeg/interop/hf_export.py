"""Weights out to the ecosystem: a whole state_dict written as Hugging Face writes a model
(``save_pretrained``): safetensors files, sharded with ``model.safetensors.index.json``
above a size, and the model's ``config.json`` when it is a transformers model.

What a checkpoint needs for that is recorded when it is saved (``hugging_face_info``, in
its ``meta.json``): the model's config and its tied names, and from the trainer the data's
vocabulary. ``fxmeg.weights.checkpoint.export`` reads the tensors back, sets the config for
inference (``for_generation``) and calls ``write``.
"""

from __future__ import annotations

import json
import os
import re

import torch

from fxmeg.errors import CheckpointError
from fxmeg.interop.hugging_face import is_hugging_face

FORMATS = ("pt", "hf", "safetensors")
"""``fxmeg export --format``: a torch.save file; a Hugging Face directory (safetensors and
config.json); the safetensors files alone (any model)."""
DEFAULT_SHARD_SIZE = "50GB"
"""transformers 5's default ``max_shard_size``."""
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION = "generation_config.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def hugging_face_info(model: torch.nn.Module) -> dict | None:
    """What an export in Hugging Face's format needs of ``model`` besides its tensors:
    ``config`` (its config as ``config.json`` holds it, ``architectures`` set to the
    model's class as ``save_pretrained`` sets it) and ``tied`` (the names transformers
    re-ties on load, e.g. ``lm_head.weight``: left out of the files). None for a model
    that is not a transformers PreTrainedModel. Reads the config only, so it works on a
    model built on meta or already parallelized."""
    if not is_hugging_face(model):
        return None
    config = json.loads(model.config.to_json_string(use_diff=False))
    config["architectures"] = [type(model).__name__]
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return {"config": config, "tied": sorted(tied)}


def for_generation(config: dict, data: dict | None) -> tuple[dict, dict, list[str]]:
    """``config.json`` and ``generation_config.json`` of an export of the model trained with
    ``config`` (``hugging_face_info``'s) on ``data`` (the trainer's vocabulary: vocab_size,
    eod; None when not recorded), and one line for the user per setting changed or kept.

    Ensures: ``use_cache`` true in both (the trainer builds the model without the
    key/value cache, which training never reads and generate() needs); ``eos_token_id``
    the data's end-of-document id where recorded, also as generation's ``pad_token_id``
    when the config has none (the config's stays: it is the embedding's padding row,
    which training would freeze); ``vocab_size`` as trained, the rows past the
    tokenizer's ids (padding) in generation's ``suppress_tokens`` and said in the
    config's ``fxmeg`` entry, so from_pretrained loads the trained tensors as they are."""
    config, notes = dict(config), []
    if "use_cache" in config:
        config["use_cache"] = True
    notes.append("use_cache true: generate() keeps the key/value cache (training ran without it)")
    eod = (data or {}).get("eod")
    eos = config.get("eos_token_id")
    if eod is not None:
        notes.append(
            f"eos_token_id {eod}: the data's end of document"
            + (f" (the model config said {eos})" if eos != eod else "")
        )
        eos = config["eos_token_id"] = eod
    else:
        notes.append(
            f"eos_token_id {eos} kept from the model config: the checkpoint records no data "
            f"end-of-document id (saved without the trainer); set it in config.json"
        )
    generation = {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": config.get("pad_token_id")
        if config.get("pad_token_id") is not None
        else eos,
        "use_cache": True,
    }
    rows, ids = config.get("vocab_size"), (data or {}).get("vocab_size")
    if rows is not None and ids is not None and rows > ids:
        generation["suppress_tokens"] = list(range(ids, rows))
        config["fxmeg_vocabulary"] = {  # says why config.json's vocab_size is above the tokenizer's
            "trained_vocab_size": rows,
            "tokenizer_vocab_size": ids,
            "padding": f"ids {ids}..{rows - 1} pad the vocabulary for training; generate() "
            "suppresses them (generation_config.json)",
        }
        notes.append(
            f"vocabulary {rows} rows as trained (tokenizer {ids}, padded for training as "
            "Megatron's --make-vocab-size-divisible-by); generate() suppresses ids "
            f"{ids}..{rows - 1}"
        )
    return config, {k: v for k, v in generation.items() if v is not None}, notes


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string as transformers takes it ("5GB", "200MB",
    "10KiB"). A malformed one is a CheckpointError naming it."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", str(size).upper())
    if match is None or float(match[1]) <= 0:
        raise CheckpointError(
            f"max_shard_size={size!r} is not a size; pass bytes (an int) or a string "
            f"such as '5GB', '200MB' or '10KiB'"
        )
    return int(float(match[1]) * _UNITS[match[2]])


def check_target(directory: str, max_shard_size: int | str) -> None:
    """Raise CheckpointError unless ``directory`` can hold an export (it is not an
    existing file) and ``max_shard_size`` is a size."""
    parse_size(max_shard_size)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(
            f"export to {directory}: it is a file, and this format writes a directory "
            f"(model.safetensors, config.json); pass a directory path"
        )


def hugging_face_names(state: dict[str, torch.Tensor], aliases: dict[str, list[str]],
                       tied: list[str]) -> dict[str, torch.Tensor]:
    """``state`` with one name per tensor: of each group of ``aliases`` (tied names) the
    first that transformers does not re-tie (not in ``tied``), as ``save_pretrained``
    keeps it; safetensors holds no aliases."""
    drop = set()
    for names in aliases.values():
        if len(names) > 1:
            keep = next((n for n in names if n not in tied), names[0])
            drop |= {n for n in names if n != keep}
    return {k: v for k, v in state.items() if k not in drop}


NAMES = ("saved", "model")
"""``fxmeg export --names``: transformers' saved names (what ``save_pretrained`` writes: a
mixture of experts' banks one tensor per expert and projection), or the model's own
state_dict names (the fused banks, which from_pretrained also loads)."""


def as_saved(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """``state`` (a transformers model's tensors under its state_dict names, tied names
    left out) under the names and splits ``save_pretrained`` writes for the model of
    ``config`` (``hugging_face_info``'s), in its order: transformers' conversion mapping
    reversed (``fxmeg.weights.converted.saved_layout``).

    Empties ``state`` as it goes, holding at most one bank twice at any time: a bank's
    parts are views of the bank itself (split per expert) or of one contiguous copy per
    concatenated part (then the bank is dropped), the storage transformers' own ``Chunk``
    and ``SplitModulelist`` give them, so ``shards`` keeps each such storage in one file as
    save_pretrained does. A tensor written whole is the same tensor. Raises
    CheckpointError naming the tensor for a conversion fxmeg does not undo."""
    from fxmeg.errors import WeightsError
    from fxmeg.weights.converted import saved_layout

    try:
        layout = saved_layout({k: tuple(v.shape) for k, v in state.items()}, _meta_model(config))
    except WeightsError as exc:
        raise CheckpointError(f"export in transformers' saved names: {exc}") from exc
    out = {}
    for name, parts in layout:
        tensor = state.pop(name)
        blocks: dict[tuple, torch.Tensor] = {}  # per concatenated part: its experts' storage
        for part in parts:
            span = (part.dim, part.start, part.size)
            if span not in blocks:
                whole = tensor if part.dim is None else tensor.narrow(*span)
                blocks[span] = whole.contiguous()
            out[part.name] = blocks[span] if part.expert is None else blocks[span][part.expert]
        del tensor, blocks  # a split bank's last references: freed before the next one
    return out


def model_class(config: dict) -> tuple[str, type | None]:
    """(the name of ``config``'s model class, its first ``architectures`` entry; that class
    of the installed transformers, or None where it has none)."""
    import transformers

    name = config["architectures"][0]
    return name, getattr(transformers, name, None)


def _meta_model(config: dict) -> torch.nn.Module:
    """The transformers model of ``config`` (its ``architectures`` class) on the meta
    device: no memory, for its conversion mapping."""
    import transformers

    name, cls = model_class(config)
    if cls is None:
        raise CheckpointError(
            f"export in transformers' saved names: the checkpoint's model class {name!r} is not "
            f"in transformers {transformers.__version__}; export with names='model' "
            f"(fxmeg export --names model), or with the transformers that trained it"
        )
    with torch.device("meta"):
        return cls._from_config(cls.config_class.from_dict(config))


def shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The names of each file, in order, as huggingface_hub's splitter makes them: tensors
    sharing a storage (the experts of a bank split by ``as_saved``) in the file of the
    first, counted once at the storage's size; a storage larger than ``max_bytes`` alone;
    otherwise a new file when the current one would exceed ``max_bytes``."""
    files: list[list[str]] = []
    current: list[str] = []
    size = 0
    first: dict = {}  # storage -> its first tensor's name
    later: dict[str, list[str]] = {}  # that name -> the others on its storage
    for name, t in state.items():
        n = t.untyped_storage().nbytes()
        storage = (t.untyped_storage().data_ptr(), n) if n else id(t)  # empty: no storage to share
        if storage in first:
            later[first[storage]].append(name)
            continue
        first[storage], later[name] = name, []
        if n > max_bytes:
            files.append([name])
            continue
        if current and size + n > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    files += [current] if current else []
    return [[m for n in names for m in [n, *later[n]]] for names in files]


def write(
    state: dict[str, torch.Tensor],
    directory: str,
    *,
    config: dict | None = None,
    generation: dict | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
) -> list[str]:
    """Write ``state`` (one name per tensor) into ``directory`` as ``save_pretrained``
    does; the files written.

    Requires: ``directory`` is not an existing file; ``state``'s tensors that share a
    storage do not overlap (``as_saved``'s).
    Ensures: ``model.safetensors`` (metadata format "pt"), or, above ``max_shard_size``,
    ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json`` (weight_map,
    total_size, total_parameters); ``config.json`` from ``config`` when given, its
    ``dtype`` that of the floating tensors; ``generation_config.json`` from ``generation``
    when given; every file the mode ``open`` gives (0666 less the umask); stale weight
    files of an earlier export in ``directory`` removed (as ``save_pretrained`` does)."""
    from safetensors.torch import save_file

    check_target(directory, max_shard_size)
    os.makedirs(directory, exist_ok=True)
    groups = shards(state, parse_size(max_shard_size))
    for old in os.listdir(directory):
        if old in (SINGLE, INDEX) or _SHARD.fullmatch(old):
            os.remove(os.path.join(directory, old))
    names = [SINGLE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                for i in range(len(groups))]
    for file, group in zip(names, groups):
        save_file(
            {k: state[k].contiguous() for k in group},
            os.path.join(directory, file),
            metadata={"format": "pt"},
        )
        _as_opened(os.path.join(directory, file))
    written = list(names)
    if len(groups) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(t.numel() for t in state.values()),
                "total_size": sum(t.numel() * t.element_size() for t in state.values()),
            },
            "weight_map": {k: f for f, group in zip(names, groups) for k in group},
        }
        _write_json(os.path.join(directory, INDEX), index)
        written.append(INDEX)
    if config is not None:
        floating = {t.dtype for t in state.values() if t.is_floating_point()}
        dtype = (
            str(floating.pop()).removeprefix("torch.")
            if len(floating) == 1
            else config.get("dtype")
        )
        _write_json(os.path.join(directory, "config.json"), config | {"dtype": dtype})
        written.append("config.json")
    if generation is not None:
        _write_json(os.path.join(directory, GENERATION), generation)
        written.append(GENERATION)
    return written


def _as_opened(path: str) -> None:
    """Give ``path`` the mode ``open`` would (0666 less the umask): safetensors writes
    through a temporary file (mkstemp's 0600), which would hide the model from other users."""
    umask = os.umask(0)  # the only way to read it; set back at once (export runs no other thread)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
