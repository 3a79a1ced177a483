"""Checkpoints on torch.distributed.checkpoint, readable under any parallel layout.

Every tensor is saved as its full logical tensor, named in the user model's terms:
``model/<fqn>`` for parameters and buffers, ``optim/<state>/<fqn>`` for each optimizer
state (``exp_avg``, ``exp_avg_sq``, ..., and ``master`` for fp32 masters in half
precision). Each rank contributes the boxes it holds (``fxmeg.weights.sharding``): its
tensor-parallel shard, its distributed-optimizer shard; data-parallel replicas write the
same boxes once. Loading reads whatever overlaps this rank's boxes in the new layout, so
a checkpoint saved at (tp=2, pp=2, dp=2) loads at (tp=1, pp=4, dp=2) or on one process.
Small state (lr schedule, loss scaler, trainer position, optimizer step counts, each
rank's RNG) is stored as objects.

Layout on disk: ``DIR/iter_0000012/`` holds the DCP files and ``meta.json`` (model
parameter names and shapes, layout, iteration); ``DIR/latest`` names the newest complete
one and is replaced atomically only after every rank finished writing, so a crash during
a save leaves the previous checkpoint in place. Loading checks that the files are whole
and falls back to the previous complete checkpoint, with a warning, when they are not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import threading
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from fxmeg.errors import CheckpointError
from fxmeg.interop.hf_export import (
    DEFAULT_SHARD_SIZE,
    FORMATS,
    NAMES,
    as_saved,
    check_target,
    for_generation,
    hugging_face_names,
    write,
)
from fxmeg.ir.program import Program
from fxmeg.runtime.context import RankContext
from fxmeg.runtime.groups import WeakGroup
from fxmeg.runtime.state import layout, model_entries, model_signature, optimizer_entries, scalars
from fxmeg.weights.sharding import Pieces, dcp_load, dcp_save

LATEST = "latest"
META = "meta.json"


# ---------------------------------------------------------------- rank state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rng() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])



# ---------------------------------------------------------------- save


class Checkpointer:
    """Saves (optionally in the background) and loads the checkpoints of one Program's
    runtime on this rank."""

    group = WeakGroup()  # never holds the group alive (fxmeg/runtime/groups.py)

    writer_factory = FileSystemWriter
    """Storage writer class; tests substitute a slow one."""

    def __init__(
        self,
        program: Program,
        context: RankContext,
        *,
        keep: int | None = None,
        async_save: bool = False,
        hugging_face: dict | None = None,
        data: dict | None = None,
    ) -> None:
        self.program, self.context, self.keep, self.async_save = program, context, keep, async_save
        self.hugging_face = hugging_face
        """``fxmeg.interop.hf_export.hugging_face_info`` of a transformers model, kept in meta.json
        so that ``export(..., format="hf")`` can write its config.json."""
        self.data = data
        """The trainer's data vocabulary (``vocab_size``: the tokenizer's ids, before
        padding; ``eod``: the end-of-document id or None), kept in meta.json so that
        ``export(..., format="hf")`` writes the data's eos and says what padding it trained."""
        multi = dist.is_initialized() and dist.get_world_size() > 1
        # a group of its own: a background save's collectives never meet training's
        self.group = dist.new_group(backend="gloo") if multi else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.on_saved = None
        """Called as on_saved(path) on rank 0 once a checkpoint is complete."""

    def save(self, directory: str, iteration: int, trainer_state: dict) -> str:
        """Write this iteration's checkpoint (in the background with async_save: the
        previous one finishes first). Collective."""
        self.wait()
        program, ctx = self.program, self.context
        ctx.ddp.wait_for_params()
        with ctx.unsharded():  # zero=3: whole parameters, written or copied inside
            return self._save(program, ctx, directory, iteration, trainer_state)

    def _save(self, program, ctx, directory: str, iteration: int, trainer_state: dict) -> str:
        state: dict[str, Any] = {**model_entries(program, ctx), **optimizer_entries(program, ctx)}
        state["optim/scalars"] = self._scalars(ctx)
        state["scaler"] = ctx.scaler.state_dict() if ctx.scaler else None
        state["scheduler"] = ctx.scheduler.state_dict() if ctx.scheduler else None
        state["trainer"] = trainer_state | {"global_batch_size": ctx.config.global_batch_size}
        state[f"rng/{_rank()}"] = _rng()
        meta = {"iteration": iteration, "layout": layout(ctx), "world_size": _world(),
                "model": model_signature(program), "aliases": program.aliases,
                "trainer": {k: v for k, v in trainer_state.items() if k != "config"},
                "hugging_face": self.hugging_face, "data": self.data}
        path = os.path.join(directory, f"iter_{iteration:07d}")
        if self.async_save:
            state = {k: v.snapshot() if isinstance(v, Pieces) else v for k, v in state.items()}
            self._thread = threading.Thread(
                target=self._write, args=(state, path, directory, meta), daemon=True
            )
            self._thread.start()
        else:
            self._write(state, path, directory, meta)
            self._raise()
        return path

    def _scalars(self, ctx) -> dict[str, float]:
        """Scalar optimizer states merged over every rank: a rank may hold no parameter of
        some inner optimizer (layer-wise sharding), the checkpoint needs them all."""
        mine = scalars(ctx)
        if self.group is None:
            return mine
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, mine, group=self.group)
        return {k: v for s in reversed(every) for k, v in s.items()}  # the lowest rank's value wins

    def wait(self) -> None:
        """Block until the background save (if any) has finished; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"saving the checkpoint failed: {error}") from error

    def _write(self, state: dict, path: str, directory: str, meta: dict) -> None:
        try:
            os.makedirs(path, exist_ok=True)
            dcp_save(state, self.writer_factory(path), group=self.group)
            _barrier(self.group)  # every rank's files are in place
            if _rank() == 0:
                _atomic_write(os.path.join(path, META), json.dumps(meta, indent=1, default=str))
                _atomic_write(os.path.join(directory, LATEST), os.path.basename(path))
                if self.keep:
                    _retain(directory, self.keep)
                if self.on_saved is not None:
                    self.on_saved(path)
            _barrier(self.group)
        except BaseException as exc:  # surfaced by wait() in the training thread
            self._error = exc

    # ------------------------------------------------------------ load

    def load(self, directory: str) -> dict | None:
        """Restore from the newest complete checkpoint in ``directory`` (any layout);
        the trainer state it was saved with plus its iteration, or None when there is
        none. Collective."""
        path = find_complete(directory)
        if path is None:
            return None
        program, ctx = self.program, self.context
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        _check_model(meta, program, path)
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
        entries = {k for k in saved if k.startswith("optim/") and k.count("/") == 2}
        keys = {k.split("/")[1] for k in entries}
        if ctx.config.precision != "fp32" and "master" not in keys:
            raise CheckpointError(
                f"{path} has no fp32 masters (saved in fp32); load it with precision='fp32'"
            )
        objects = ["optim/scalars", "scaler", "scheduler", "trainer", f"rng/{_rank()}"]
        with ctx.unsharded(write=True):  # zero=3: loaded into whole parameters, kept in the shards
            state: dict[str, Any] = {
                **model_entries(program, ctx),
                **optimizer_entries(program, ctx, entries),
            }
            state |= {k: None for k in objects if k in saved}
            dcp_load(state, path, group=self.group)
        # parameters follow loaded masters (or full-matrix masters the parameters)
        ctx.optimizer.reload()
        for piece in ctx.optimizer.pieces:
            inner = ctx.optimizer.inner.state[piece.master]
            for key, value in (state.get("optim/scalars") or {}).items():
                inner[key] = torch.tensor(value, dtype=torch.float32)
        if ctx.scaler is not None and state.get("scaler"):
            ctx.scaler.load_state_dict(state["scaler"])
        if ctx.scheduler is not None and state.get("scheduler"):
            ctx.scheduler.load_state_dict(state["scheduler"])
        if f"rng/{_rank()}" in state:  # the same rank of another layout: its stream anyway
            _set_rng(state[f"rng/{_rank()}"])
        trainer = state["trainer"]
        if trainer["global_batch_size"] != ctx.config.global_batch_size:
            ctx.set_global_batch_size(trainer["global_batch_size"])
        return trainer | {"iteration": meta["iteration"]}


def _check_model(meta: dict, program: Program, path: str) -> None:
    mine = model_signature(program)
    if meta["model"] != mine:
        diff = sorted(
            k for k in set(meta["model"]) | set(mine) if meta["model"].get(k) != mine.get(k)
        )
        shown = ", ".join(
            f"{k}: checkpoint {meta['model'].get(k)} vs model {mine.get(k)}" for k in diff[:3]
        )
        raise CheckpointError(
            f"checkpoint {path} is from an incompatible model ({len(diff)} parameters differ: "
            f"{shown}); load it into the model it was saved from"
        )


def check_complete(path: str) -> None:
    """Raise CheckpointError naming the first missing, unreadable or truncated file."""
    meta = os.path.join(path, META)
    try:
        with open(meta) as f:
            json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{meta} is missing or unreadable: the save did not finish ({exc})"
        ) from exc
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"{os.path.join(path, '.metadata')} is missing or unreadable: {exc}"
        ) from exc
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.exists(file) else -1
        if have < size:
            what = "is missing" if have < 0 else f"is truncated ({have} of {size} bytes)"
            raise CheckpointError(f"checkpoint file {file} {what}")


def saved_trainer_state(directory: str) -> dict | None:
    """The trainer state (as ``meta.json`` records it, without the config) of the checkpoint
    ``Checkpointer.load`` would restore from ``directory``; None when it holds none. Reads
    one small file (no model), so the trainer can decide before it builds one."""
    with warnings.catch_warnings():  # load() warns about skipped checkpoints, once
        warnings.simplefilter("ignore")
        path = find_complete(directory)
    if path is None:
        return None
    with open(os.path.join(path, META)) as f:
        return json.load(f).get("trainer", {})


def find_complete(directory: str) -> str | None:
    """The checkpoint ``latest`` names, or, when it is incomplete, the newest complete
    one before it (with a warning); None when the directory holds none."""
    if not os.path.isdir(directory):
        return None
    candidates = sorted((d for d in os.listdir(directory) if d.startswith("iter_")), reverse=True)
    marker = os.path.join(directory, LATEST)
    if os.path.exists(marker):
        with open(marker) as f:
            latest = f.read().strip()
        candidates = [latest] + [c for c in candidates if c < latest]
    problems = []
    for name in candidates:
        path = os.path.join(directory, name)
        try:
            check_complete(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            warnings.warn(
                f"skipping incomplete checkpoints, loading {path}: " + "; ".join(problems),
                stacklevel=2,
            )
        return path
    if problems:
        raise CheckpointError(f"no complete checkpoint in {directory}: " + "; ".join(problems))
    return None


@dataclasses.dataclass(frozen=True)
class Exported:
    """What ``export`` wrote."""

    checkpoint: str
    """The checkpoint iteration read (``DIR/iter_N``)."""
    names: list[str]
    """The tensor names written."""
    notes: list[str]
    """For the user: what an "hf" export set for inference
    (``fxmeg.interop.hf_export.for_generation``)."""


def read_model(path: str) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """The model of checkpoint ``path`` (a checkpoint or its directory) on one device:
    (the iteration read, its meta.json, every tensor under each of its names: tied
    names share one tensor, as in the model's state_dict)."""
    path, meta = _iteration(path)
    return path, meta, _model_tensors(path, meta)


def _iteration(path: str) -> tuple[str, dict]:
    """The complete checkpoint iteration ``path`` names (itself, or its directory's
    latest) and its meta.json."""
    if os.path.exists(os.path.join(path, LATEST)) or not os.path.exists(os.path.join(path, META)):
        path = find_complete(path) or path
    check_complete(path)
    with open(os.path.join(path, META)) as f:
        return path, json.load(f)


def _model_tensors(path: str, meta: dict) -> dict[str, torch.Tensor]:
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    full = {}
    for canonical in meta["aliases"]:
        key = f"model/{canonical}"
        if key in saved:
            md = saved[key]
            full[canonical] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp_load({f"model/{n}": Pieces(t.shape, [((0,) * t.dim(), t)]) for n, t in full.items()}, path)
    return {alias: full[canonical] for canonical, names in meta["aliases"].items()
            if canonical in full for alias in names}


def export(
    path: str, out: str, *, format: str = "pt", max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    names: str = "saved",
) -> Exported:
    """Write the model of checkpoint ``path`` (a checkpoint or its directory) for a single
    device, under the user model's names.

    ``format`` "pt": a plain state_dict (tied names included) in the torch.save file
    ``out``. "hf": the Hugging Face directory ``out`` that ``from_pretrained`` loads
    (``fxmeg.interop.hf_export.write``: safetensors, sharded above ``max_shard_size``, config.json
    and generation_config.json set for inference by ``fxmeg.interop.hf_export.for_generation``;
    tied names once); only for a checkpoint of a transformers model. "safetensors": the
    same weight files alone, for any model.

    ``names`` (hf and safetensors, a transformers model's checkpoint): "saved", the names
    and tensors ``save_pretrained`` writes (``fxmeg.interop.hf_export.as_saved``: a mixture
    of experts' banks one tensor per expert and projection, under transformers' conversion
    mapping reversed); "model", the model's own state_dict names (its fused banks)."""
    if format not in FORMATS:
        raise CheckpointError(
            f"export format={format!r}: choose one of {', '.join(map(repr, FORMATS))}"
        )
    if names not in NAMES:
        raise CheckpointError(
            f"export names={names!r}: choose one of {', '.join(map(repr, NAMES))}"
        )
    if format != "pt":
        check_target(out, max_shard_size)  # before reading anything
    path, meta = _iteration(path)
    info = meta.get("hugging_face")
    if format == "hf" and info is None:
        raise CheckpointError(
            f"export {path} with format 'hf': the checkpoint records no Hugging Face config (its "
            "model is not a transformers model, or an older fxmeg saved it) to write as "
            "config.json; use format 'safetensors' for the weights alone, or 'pt'"
        )
    state = _model_tensors(path, meta)
    if format == "pt":
        torch.save(state, out)
        return Exported(path, sorted(state), [])
    state = {k: state[k] for k in meta["model"] if k in state}  # the model's state_dict order
    state = hugging_face_names(state, meta["aliases"], info["tied"] if info else [])
    if info is not None and names == "saved":
        state = as_saved(state, info["config"])
    config = generation = None
    notes: list[str] = []
    if format == "hf":
        config, generation, notes = for_generation(info["config"], meta.get("data"))
    write(state, out, config=config, generation=generation, max_shard_size=max_shard_size)
    return Exported(path, sorted(state), notes)


# ---------------------------------------------------------------- files


def _retain(directory: str, keep: int) -> None:
    saved = sorted(d for d in os.listdir(directory) if d.startswith("iter_"))
    for old in saved[:-keep]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def _atomic_write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
