"""Where this rank's pieces of a tensor sit in the full (logical) tensor, and the object
torch.distributed.checkpoint reads and writes them through.

A parameter split over tp ranks by the tensor-parallel pass (``layouts.Shard(dim, parts)``)
holds, along ``dim``, the rank-th tp-th of every block; the distributed optimizer keeps
a contiguous flat range of that local shard. Both are unions of boxes (offsets, sizes)
of the full tensor. Checkpoints store every tensor as its full logical tensor, each rank
contributing its boxes, so a checkpoint saved under one layout loads under any other.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from fxmeg.ir.layouts import ExpertShard, ParamLayout, Shard, is_split

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_to_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """Boxes covering elements [lo, hi) of a row-major tensor of ``shape``; each box is
    itself a contiguous flat range, in order."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last or lo % inner or hi % inner:
        boxes = []
        row_lo = first if lo % inner == 0 else first + 1
        if lo % inner:  # the partial first row
            boxes += _prefix(
                first, flat_to_boxes(shape[1:], lo % inner, min(inner, hi - first * inner))
            )
            if first == last:
                return boxes
        row_hi = last + 1 if hi % inner == 0 else last
        if row_lo < row_hi:
            boxes.append(((row_lo,) + (0,) * (len(shape) - 1), (row_hi - row_lo,) + shape[1:]))
        if hi % inner and last >= row_lo:  # the partial last row
            boxes += _prefix(last, flat_to_boxes(shape[1:], 0, hi - last * inner))
        return boxes
    return [((first,) + (0,) * (len(shape) - 1), (last - first + 1,) + shape[1:])]


def _prefix(row: int, boxes: list[Box]) -> list[Box]:
    return [((row,) + off, (1,) + size) for off, size in boxes]


def local_to_global(
    box: Box, spec: ParamLayout | None, tp: int, rank: int
) -> list[tuple[Box, Box]]:
    """(global box, local box) pairs for a box of this rank's local tensor: along a split
    dim, local index i falls in block j and sits at block start + rank * (part / tp) + i
    - (local start of block j); a box crossing blocks is cut at their edges."""
    if not is_split(spec) or tp == 1:
        return [(box, box)]
    dim, parts = spec.dim, spec.parts
    offsets, sizes = box
    out, local_start, global_start = [], 0, 0
    for p in parts:
        step = p // tp
        a, b = max(offsets[dim], local_start), min(offsets[dim] + sizes[dim], local_start + step)
        if a < b:
            g = global_start + rank * step + (a - local_start)
            local = (
                offsets[:dim] + (a,) + offsets[dim + 1 :],
                sizes[:dim] + (b - a,) + sizes[dim + 1 :],
            )
            glob = (offsets[:dim] + (g,) + offsets[dim + 1 :], local[1])
            out.append((glob, local))
        local_start, global_start = local_start + step, global_start + p
    return out


def flat_index(shape: Sequence[int], offsets: Sequence[int]) -> int:
    """Row-major flat index of ``offsets`` in a tensor of ``shape``."""
    index = 0
    for size, off in zip(shape, offsets):
        index = index * size + off
    return index


def local_range(full: torch.Tensor, spec: ParamLayout | None, tp: int, rank: int, lo: int, hi: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Elements [lo, hi) of tp rank ``rank``'s flattened shard of ``full``, read from the
    full tensor into a new tensor of ``dtype`` and ``hi - lo`` elements (nothing of the
    shard outside the range is made)."""
    shape = list(spec.local_shape(full.shape, tp) if is_split(spec) else full.shape)
    out = torch.empty(hi - lo, dtype=dtype, device=full.device)
    for box in flat_to_boxes(shape, lo, hi):
        start = flat_index(shape, box[0]) - lo
        dst = out[start : start + math.prod(box[1])].view(box[1])
        for g, local in local_to_global(box, spec, tp, rank):
            rel = tuple(a - b for a, b in zip(local[0], box[0]))
            view(dst, (rel, local[1])).copy_(view(full.detach(), g))
    return out


def tp_shard(full: torch.Tensor, spec: ParamLayout | None, tp: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s shard of ``full`` under ``spec`` (a new tensor):
    along the split dim, the rank-th tp-th of every block, blocks end to end."""
    if not is_split(spec) or tp == 1:
        return full.detach().clone()
    pieces = [full.detach().narrow(spec.dim, a, b - a) for a, b in spec.block_ranges(tp, rank)]
    return torch.cat(pieces, spec.dim)


def ep_shard(full: torch.Tensor, spec: ExpertShard | None, ep: int, rank: int) -> torch.Tensor:
    """Expert-parallel rank ``rank``'s experts of the bank ``full`` (``full`` itself when
    ``spec`` is None or ep = 1)."""
    if spec is None or ep == 1:
        return full
    first, end = spec.experts_of(ep, rank)
    return full.detach().narrow(0, first, end - first).clone()


def tp_assemble(shards: Sequence[torch.Tensor], spec: Shard) -> torch.Tensor:
    """The full tensor from every tp rank's shard under ``spec`` (``tp_shard``'s inverse):
    rank r holds the r-th tp-th of every block along the split dim, blocks end to end."""
    dim, parts = spec.dim, spec.parts
    tp = len(shards)
    blocks, offset = [], 0
    for p in parts:
        blocks.extend(s.narrow(dim, offset, p // tp) for s in shards)
        offset += p // tp
    return torch.cat(blocks, dim)


def view(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The box of ``t`` as a view."""
    for d, (o, s) in enumerate(zip(*box)):
        t = t.narrow(d, o, s)
    return t


class Pieces:
    """A full tensor of ``size`` of which this rank holds ``parts`` [(global offsets,
    view)]: what torch.distributed.checkpoint writes from and reads into (its
    _Checkpointable protocol: write items, chunk list, shard lookup)."""

    def __init__(
        self, size: Sequence[int], parts: list[tuple[tuple[int, ...], torch.Tensor]]
    ) -> None:
        self._size = torch.Size(size)
        self.parts = [(tuple(o), t) for o, t in parts if t.numel() > 0]

    def size(self) -> torch.Size:
        """The full tensor's size (DCP compares it with the checkpoint's)."""
        return self._size

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self._size,
                ),
            )
            for off, t in self.parts
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()) for off, t in self.parts
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self.parts:
            if torch.Size(off) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no piece at offset {tuple(index.offset)}")

    def snapshot(self) -> Pieces:
        """A copy that training can no longer change (for a save in the background)."""
        return Pieces(self._size, [(o, t.detach().to("cpu", copy=True)) for o, t in self.parts])


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, finding the pieces of a ``Pieces`` entry; dict values
    (trainer position, RNG states) are stored whole."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict.get(index.fqn)
        return (
            obj.__get_tensor_shard__(index)
            if isinstance(obj, Pieces)
            else super().lookup_object(index)
        )


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading into the pieces of a ``Pieces`` entry."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up first materialises meta tensors and replaces every value
        # of a type it does not know (a Pieces) with None; nothing here is on meta.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return (
            obj.__get_tensor_shard__(index)
            if isinstance(obj, Pieces)
            else super().lookup_tensor(index)
        )


# DCP warns on every single-process call ("torch.distributed is disabled, unavailable or
# uninitialized, assuming the intent is to ...") even when no_dist=True asks for one
_SINGLE_PROCESS = r"torch\.distributed is disabled, unavailable or uninitialized"


def dcp_save(state: dict, writer, *, group=None) -> None:
    """``dcp.save`` of ``state`` (``Pieces`` and objects) through ``writer``, collective over
    ``group``, or in this process alone when ``group`` is None (DCP's warning that it
    assumed so left out: fxmeg asked for it)."""
    with _single_process(group is None):
        dcp.save(
            state,
            storage_writer=writer,
            planner=SavePlanner(),
            process_group=group,
            no_dist=group is None,
        )


def dcp_load(state: dict, path: str, *, group=None) -> None:
    """``dcp.load`` of checkpoint ``path`` into ``state``, as ``dcp_save`` writes."""
    with _single_process(group is None):
        dcp.load(
            state,
            storage_reader=FileSystemReader(path),
            planner=LoadPlanner(),
            process_group=group,
            no_dist=group is None,
        )


@contextlib.contextmanager
def _single_process(alone: bool) -> Iterator[None]:
    """The one DCP warning ignored while ``alone`` (the filter matches its message alone).
    catch_warnings swaps the process-wide filter list: in an async save's thread, a filter
    another thread changes meanwhile is undone at the exit (the training loop sets none)."""
    if not alone:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
        yield
