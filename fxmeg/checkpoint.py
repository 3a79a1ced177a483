"""Checkpoints: the full model state gathered in the user's names, and the trainer's
save / load of every rank's state.

A checkpoint is one directory per saved iteration, ``DIR/iter_0000012/``, with one file
per rank (``rank_00003.pt``: its parameter shards, optimizer and scaler state, lr
schedule, RNG states) and ``meta.json`` (iteration, consumed samples, parallel layout,
config). Each file is written to a temporary name and renamed; ``DIR/latest`` names the
newest complete checkpoint and is replaced atomically only after every rank finished
writing, so a crash during a save leaves the previous one loadable. Loading needs the
same parallel layout as the save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from fxmeg.errors import FxmegError

if TYPE_CHECKING:
    from fxmeg.api import Engine

LATEST = "latest"


class CheckpointError(FxmegError):
    """A checkpoint that is missing, incomplete or from an incompatible run."""


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
    """The full tensor of a parameter split over tp ranks (a copy otherwise)."""
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


# ---------------------------------------------------------------- save / load


def layout(engine: Engine) -> dict:
    par = engine.config.parallel
    return {"tp": par.tp, "pp": par.pp, "vpp": par.vpp, "dp": par.dp,
            "distributed_optimizer": engine.config.distributed_optimizer,
            "precision": engine.config.precision}


def save(engine: Engine, directory: str, iteration: int, state: dict, *, keep: int | None = None) -> str:
    """Save every rank's state for ``iteration``; ``state`` holds what the trainer
    resumes from (consumed samples, ...). Collective. Returns the iteration directory."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(directory, f"iter_{iteration:07d}")
    os.makedirs(path, exist_ok=True)
    payload = {"engine": engine.state_dict(), "rng": _rng_state(), "trainer": state}
    _atomic_save(payload, os.path.join(path, f"rank_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        meta = {"iteration": iteration, "layout": layout(engine), "world_size": _world(), **state}
        _atomic_write(os.path.join(path, "meta.json"), json.dumps(meta, indent=1, default=str))
        _atomic_write(os.path.join(directory, LATEST), os.path.basename(path))
        if keep:
            _retain(directory, keep)
    _barrier()
    return path


def load(engine: Engine, directory: str) -> dict | None:
    """Restore every rank's state from the latest complete checkpoint in ``directory``;
    the trainer state it was saved with, or None when there is none. Collective."""
    marker = os.path.join(directory, LATEST)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        path = os.path.join(directory, f.read().strip())
    meta = _read_meta(path)
    if meta["layout"] != layout(engine):
        raise CheckpointError(
            f"checkpoint {path} was saved under {meta['layout']}, this run is "
            f"{layout(engine)}; load it under the same layout"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    file = os.path.join(path, f"rank_{rank:05d}.pt")
    try:
        payload = torch.load(file, map_location=engine.device, weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    engine.load_state_dict(payload["engine"])
    _set_rng_state(payload["rng"])
    return payload["trainer"] | {"iteration": meta["iteration"]}


def _read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has no readable meta.json: {exc}") from exc


def _retain(directory: str, keep: int) -> None:
    saved = sorted(d for d in os.listdir(directory) if d.startswith("iter_"))
    for old in saved[:-keep]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def _atomic_save(obj, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def _atomic_write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
