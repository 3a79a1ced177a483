"""Checkpoints on torch.distributed.checkpoint, readable under any parallel layout.

Every tensor is saved as its full logical tensor, named in the user model's terms:
``model/<fqn>`` for parameters and buffers, ``optim/<state>/<fqn>`` for each optimizer
state (``exp_avg``, ``exp_avg_sq``, ..., and ``master`` for fp32 masters in half
precision). Each rank contributes the boxes it holds (``fxmeg.sharding``): its
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

import json
import math
import os
import random
import shutil
import threading
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from fxmeg.errors import FxmegError
from fxmeg.sharding import LoadPlanner, Pieces, SavePlanner, flat_to_boxes, local_to_global, view

if TYPE_CHECKING:
    from fxmeg.api import Engine

LATEST = "latest"
META = "meta.json"


class CheckpointError(FxmegError):
    """A checkpoint that is missing, incomplete or from an incompatible model."""


# ---------------------------------------------------------------- full state


def gather_full_state(engine: Engine) -> dict[str, torch.Tensor]:
    """The user model's state_dict with the engine's current values on every rank:
    tensor-parallel shards are all-gathered, each pipeline stage's parameters broadcast
    from their first holder. Collective."""
    engine.ddp.wait_for_params()
    canonical = {n: c for c, names in engine.aliases.items() for n in names}
    groups = engine.groups
    out: dict[str, torch.Tensor] = {}
    for key, tensor in engine.model.state_dict(keep_vars=True).items():
        name = canonical.get(key, key)
        holders = engine.holders.get(name)
        if holders is None:  # not read by the graph: the model's own value
            out[key] = tensor.detach().clone()
            continue
        owner = min(holders)
        shape, dtype = engine.full_shapes[key]
        if owner == groups.pp_rank:
            value = _gather_tp(engine, name, engine.named_parameters[name].detach())
        else:
            value = torch.empty(shape, dtype=dtype, device=engine.device)
        if groups.pp is not None:
            dist.broadcast(value, groups.pp_peer(owner), group=groups.pp)
        out[key] = value
    return out


def _gather_tp(engine: Engine, name: str, local: torch.Tensor) -> torch.Tensor:
    spec = engine.tp_specs.get(name)
    if spec is None or spec[0] != "shard" or engine.groups.tp is None:
        return local.clone()
    _, dim, parts = spec
    tp = engine.config.parallel.tp
    pieces = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(pieces, local.contiguous(), group=engine.groups.tp)
    blocks, offset = [], 0
    for p in parts:  # rank r holds the r-th tp-th of every block, blocks end to end
        blocks.extend(piece.narrow(dim, offset, p // tp) for piece in pieces)
        offset += p // tp
    return torch.cat(blocks, dim)


# ---------------------------------------------------------------- this rank's state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _tp_rank(engine: Engine) -> int:
    return engine.groups.topo.coords(engine.groups.rank)[0]


def _full_shape(engine: Engine, name: str) -> torch.Size:
    return engine.full_shapes[name][0]


def model_entries(engine: Engine) -> dict[str, Pieces]:
    """``model/<fqn>`` for every parameter this rank's chunks train (its boxes), and,
    whole, for what no chunk trains: persistent buffers, unused parameters."""
    tp, rank = engine.config.parallel.tp, _tp_rank(engine)
    out = {}
    for name, p in engine.named_parameters.items():
        local = ((0,) * p.dim(), tuple(p.shape))
        spec = engine.tp_specs.get(name)
        parts = [(g[0], view(p.detach(), l)) for g, l in local_to_global(local, spec, tp, rank)]
        out[f"model/{name}"] = Pieces(_full_shape(engine, name), parts)
    model_state = engine.model.state_dict(keep_vars=True)
    for name in engine.aliases:
        if name not in engine.holders and name in model_state:
            t = model_state[name].detach()
            out[f"model/{name}"] = Pieces(t.shape, [((0,) * t.dim(), t)])
    return out


def optimizer_entries(engine: Engine, keys: set[str] | None = None) -> dict[str, Pieces]:
    """``optim/<state>/<fqn>`` for the elements this rank's optimizer updates. ``keys``
    (on load: the states the checkpoint has) are created as zeros where missing."""
    opt = engine.optimizer
    tp, rank = engine.config.parallel.tp, _tp_rank(engine)
    out: dict[str, Pieces] = {}
    for piece in opt.pieces:
        state = opt.inner.state.setdefault(piece.master, {})
        for key in keys or ():
            if key != "master" and key not in state:
                state[key] = torch.zeros_like(piece.master)
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == piece.master.numel() and v.dim() > 0}
        if piece.target is not None:
            tensors["master"] = piece.master
        if keys is not None:
            tensors = {k: v for k, v in tensors.items() if k in keys}
        shape = tuple(piece.param.shape)
        spec = engine.tp_specs.get(piece.name)
        for key, t in tensors.items():
            flat = t.detach().reshape(-1)
            entry = out.setdefault(f"optim/{key}/{piece.name}", Pieces(_full_shape(engine, piece.name), []))
            for box in flat_to_boxes(shape, piece.lo, piece.hi):
                start = _flat_index(shape, box[0]) - piece.lo
                box_view = flat[start : start + math.prod(box[1])].view(box[1])
                for g, l in local_to_global(box, spec, tp, rank):
                    rel = tuple(a - b for a, b in zip(l[0], box[0]))
                    entry.parts.append((g[0], view(box_view, (rel, l[1]))))
    return out


def _scalars(engine: Engine) -> dict[str, float]:
    """Scalar optimizer states (Adam's step), the same for every parameter."""
    for state in engine.optimizer.inner.state.values():
        return {k: float(v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
    return {}


def _rng() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _flat_index(shape, offsets) -> int:
    index = 0
    for size, off in zip(shape, offsets):
        index = index * size + off
    return index


def layout(engine: Engine) -> dict:
    par = engine.config.parallel
    return {"tp": par.tp, "pp": par.pp, "vpp": par.vpp, "dp": par.dp,
            "distributed_optimizer": engine.config.distributed_optimizer,
            "precision": engine.config.precision}


def _model_signature(engine: Engine) -> dict[str, list[int]]:
    return {k: list(shape) for k, (shape, _) in engine.full_shapes.items()}


# ---------------------------------------------------------------- save


class Checkpointer:
    """Saves (optionally in the background) and loads an engine's checkpoints."""

    writer_factory = FileSystemWriter
    """Storage writer class; tests substitute a slow one."""

    def __init__(self, engine: Engine, *, keep: int | None = None, async_save: bool = False) -> None:
        self.engine, self.keep, self.async_save = engine, keep, async_save
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
        engine = self.engine
        engine.ddp.wait_for_params()
        state: dict[str, Any] = {**model_entries(engine), **optimizer_entries(engine)}
        state["optim/scalars"] = _scalars(engine)
        state["scaler"] = engine.scaler.state_dict() if engine.scaler else None
        state["scheduler"] = engine.scheduler.state_dict() if engine.scheduler else None
        state["trainer"] = trainer_state | {"global_batch_size": engine.config.global_batch_size}
        state[f"rng/{_rank()}"] = _rng()
        meta = {"iteration": iteration, "layout": layout(engine), "world_size": _world(),
                "model": _model_signature(engine), "aliases": engine.aliases,
                "trainer": {k: v for k, v in trainer_state.items() if k != "config"}}
        path = os.path.join(directory, f"iter_{iteration:07d}")
        if self.async_save:
            state = {k: v.snapshot() if isinstance(v, Pieces) else v for k, v in state.items()}
            self._thread = threading.Thread(target=self._write, args=(state, path, directory, meta), daemon=True)
            self._thread.start()
        else:
            self._write(state, path, directory, meta)
            self._raise()
        return path

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
            dcp.save(state, storage_writer=self.writer_factory(path), planner=SavePlanner(),
                     process_group=self.group, no_dist=self.group is None)
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
        engine = self.engine
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        _check_model(meta, engine, path)
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
        keys = {k.split("/")[1] for k in saved if k.startswith("optim/") and k.count("/") == 2}
        state: dict[str, Any] = {**model_entries(engine), **optimizer_entries(engine, keys)}
        if engine.config.precision != "fp32" and "master" not in keys:
            raise CheckpointError(f"{path} has no fp32 masters (saved in fp32); load it with precision='fp32'")
        objects = ["optim/scalars", "scaler", "scheduler", "trainer", f"rng/{_rank()}"]
        state |= {k: None for k in objects if k in saved}
        dcp.load(state, storage_reader=FileSystemReader(path), planner=LoadPlanner(),
                 process_group=self.group, no_dist=self.group is None)
        for piece in engine.optimizer.pieces:
            if piece.target is not None:  # half precision: the parameters follow the masters
                piece.target.copy_(piece.master)
            inner = engine.optimizer.inner.state[piece.master]
            for key, value in (state.get("optim/scalars") or {}).items():
                inner[key] = torch.tensor(value, dtype=torch.float32)
        if engine.scaler is not None and state.get("scaler"):
            engine.scaler.load_state_dict(state["scaler"])
        if engine.scheduler is not None and state.get("scheduler"):
            engine.scheduler.load_state_dict(state["scheduler"])
        if f"rng/{_rank()}" in state:  # the same rank of another layout: its stream anyway
            _set_rng(state[f"rng/{_rank()}"])
        trainer = state["trainer"]
        if trainer["global_batch_size"] != engine.config.global_batch_size:
            engine.set_global_batch_size(trainer["global_batch_size"])
        return trainer | {"iteration": meta["iteration"]}


def _check_model(meta: dict, engine: Engine, path: str) -> None:
    mine = _model_signature(engine)
    if meta["model"] != mine:
        diff = sorted(k for k in set(meta["model"]) | set(mine) if meta["model"].get(k) != mine.get(k))
        shown = ", ".join(f"{k}: checkpoint {meta['model'].get(k)} vs model {mine.get(k)}" for k in diff[:3])
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
        raise CheckpointError(f"{meta} is missing or unreadable: the save did not finish ({exc})") from exc
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{os.path.join(path, '.metadata')} is missing or unreadable: {exc}") from exc
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.exists(file) else -1
        if have < size:
            what = "is missing" if have < 0 else f"is truncated ({have} of {size} bytes)"
            raise CheckpointError(f"checkpoint file {file} {what}")


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
            warnings.warn(f"skipping incomplete checkpoints, loading {path}: " + "; ".join(problems), stacklevel=2)
        return path
    if problems:
        raise CheckpointError(f"no complete checkpoint in {directory}: " + "; ".join(problems))
    return None


def export(path: str, out: str) -> list[str]:
    """Write a plain single-device state_dict (the user model's names, tied ones
    included) from checkpoint ``path`` (a checkpoint or its directory) to ``out``."""
    if os.path.exists(os.path.join(path, LATEST)) or not os.path.exists(os.path.join(path, META)):
        path = find_complete(path) or path
    check_complete(path)
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    full = {}
    for canonical, names in meta["aliases"].items():
        key = f"model/{canonical}"
        if key in saved:
            md = saved[key]
            full[canonical] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load({f"model/{n}": Pieces(t.shape, [((0,) * t.dim(), t)]) for n, t in full.items()},
             storage_reader=FileSystemReader(path), planner=LoadPlanner(), no_dist=True)
    state = {alias: full[canonical] for canonical, names in meta["aliases"].items()
             if canonical in full for alias in names}
    torch.save(state, out)
    return sorted(state)


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
