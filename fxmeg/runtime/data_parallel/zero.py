"""ZeRO-2 and ZeRO-3 gradient buffers (docs/zero.md): what a data-parallel rank keeps
between steps is its own shard of every bucket, of the fp32 gradients (zero >= 2) and of
the parameters (zero=3), 1 / (dp x cp) of the chunk's, padding aside.

How gradients are staged and reduced, how zero=3 gathers and frees parameters in forward
and backward, and ``backward_prefetch='post'``: docs/architecture.md §8.5.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fxmeg.ir.program import BufferLayout
from fxmeg.ir.recomputation import Recomputation
from fxmeg.runtime.data_parallel.ddp import Events, GradBuffer, buffer_of
from fxmeg.runtime.groups import Works, gather_into, reduce_scatter_
from fxmeg.torch_private import storage_key

IN_FLIGHT = 1
"""Bucket reductions a buffer lets run at once before it waits for the oldest: each one
waits until the next bucket is ready (one bucket's backward of overlap), and at most two
staged buckets are whole at once (bench/memory.py, the 310M GPT at dp=4: two in flight
peaked 0.1 GB higher)."""


@dataclass(frozen=True)
class ShardFill:
    """Parameters whose values a zero=3 buffer makes itself, bucket by bucket, for a model
    built on meta or read from weights: ``make({name: (lo, hi)})`` returns the values
    (this rank's tensor-parallel shard, any dtype) of those parameters, of which elements
    [lo, hi) are in this rank's shard. A parameter no element of which is in the shard is
    never made, so a rank makes about 1/dp of its stage, and one bucket is whole at a time."""

    names: frozenset[str]
    make: Callable[[dict[str, tuple[int, int]]], dict[str, torch.Tensor]]


class ZeroBuffer(GradBuffer):
    """One chunk's gradient buffer at ``stage`` 2 or 3 (see the module docstring). Same
    interface as GradBuffer; the buffer elements [start, end) of a bucket keep their
    numbering, of which this rank holds [lo, hi) = its equal part."""

    def __init__(self, layout: BufferLayout, params: dict[str, nn.Parameter], *, label: str,
                 group: dist.ProcessGroup | None, overlap: bool, events: Events, stage: int,
                 deferred: frozenset[str] = frozenset(), tracer=None, fill: ShardFill | None = None,
                 lean: bool = False) -> None:
        assert stage in (2, 3), stage
        assert fill is None or stage == 3, "parameters are made as shards at zero=3 only"
        self.layout, self.label, self.group, self.stage = layout, label, group, stage
        self.overlap, self.shard, self.events, self.tracer = overlap, True, events, tracer
        self.lean = lean
        """backward_prefetch='post': a reduction is waited for before the next bucket is staged."""
        self.n = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        self.params = {s.name: params[s.name] for s in layout.slots}
        device = next(iter(self.params.values())).device
        self._bucket_of = {s.name: s.bucket for s in layout.slots}
        self._name_of = {id(p): n for n, p in self.params.items()}
        self._part = {b.index: (b.start + rank * (b.end - b.start) // self.n, b.start // self.n,
                                (b.end - b.start) // self.n) for b in layout.buckets}
        """Bucket -> (lo: its first element this rank holds, where that part starts in the
        shard tensors, the part's size)."""
        self._deferred = {b.index for b in layout.buckets if deferred & set(b.params)}
        self._staging: dict[int, torch.Tensor] = {}
        self._read: tuple[Works, str, torch.Tensor] | None = None  # reduce_read's, in flight
        self._in_flight: dict[int, dist.Work | None] = {}
        self.pending = {}  # GradBuffer's overlap_param_gather waits (zero=2)
        if stage == 2:
            self.param_data = self._move_params_into_buffer()
        else:
            self.param_data = None
            self._whole, self.param_shard = self._shard_params(device, fill)
            self._live: set[int] = set()
            self._gathering: dict[int, dist.Work | None] = {}
        # after the parameters moved: at zero=3 their whole memory is freed by now
        self.grad_shard = torch.zeros(layout.numel // self.n, dtype=torch.float32, device=device)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params.values()
        ]
        self.reset()

    # ------------------------------------------------------------ gradients

    def reset(self) -> None:
        """Start a step: no gradient yet."""
        assert not self._staging and not self._in_flight and self._read is None, (
            f"{self.label}: a reduction outlived its step")
        self.grad_shard.zero_()
        self.syncing = True  # every micro-batch is reduced
        self._round()

    def _round(self) -> None:
        self._left = {b.index: len(b.params) for b in self.layout.buckets}
        self._issued: set[int] = set()
        self._next = 0

    def start_sync(self) -> None:
        """Nothing to start: zero >= 2 reduces every micro-batch."""

    def accumulate(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        self._settle_read()
        name = self._name_of[id(p)]
        i = self._bucket_of[name]
        if i in self._in_flight:  # a second gradient of a parameter read by two chunks
            self._settle(i)
        if i not in self._staging:
            self._stage(i)
        p.main_grad.add_(grad)
        if i in self._deferred:
            return
        self.events.log.append(("ready", name))
        self._left[i] -= 1
        if self.stage == 3 and self._left[i] == 0:
            self.release(i)  # every use of the bucket in this backward is past
        if self.overlap:
            while (self._next < len(self.layout.buckets)
                   and (self._next in self._deferred or self._left[self._next] <= 0)):
                if self._next not in self._deferred and self._next not in self._issued:
                    self._issue(self._next)
                self._next += 1

    def reduce_read(self, name: str, grad: torch.Tensor) -> None:
        """The gradient of parameter ``name`` through one read that backward reaches long
        before the parameter's first read (``ops.early_linear``: a tied embedding's head),
        a tensor of its own: summed over the group now, in place, one reduce per rank's
        part of the bucket it overlaps, and this rank's part added into the shard when the
        next gradient arrives or the backward ends. A weight that pipeline ranks share is
        summed over them first: staged as usual."""
        i = self._bucket_of[name]
        if i in self._deferred:
            if i not in self._staging:
                self._stage(i)
            self.params[name].main_grad.add_(grad)
            return
        self._settle_read()
        flat = grad.to(self.layout.dtype).reshape(-1)  # a half-precision gradient is summed in fp32
        slot, bucket, works = self.layout.slot(name), self.layout.buckets[i], []
        size = (bucket.end - bucket.start) // self.n
        for r in range(self.n if self.group is not None else 0):
            lo = bucket.start + r * size  # rank r's part of the bucket: [lo, lo + size)
            a, b = max(lo, slot.offset), min(lo + size, slot.offset + slot.numel)
            if a < b:
                works.append(
                    dist.reduce(
                        flat[a - slot.offset : b - slot.offset],
                        group_dst=r,
                        group=self.group,
                        async_op=True,
                    )
                )
        self.events.log.append(("reduce_read", f"{self.label}/{i}:{name}"))
        self._read = (Works(works), name, flat)

    def _settle_read(self) -> None:
        """Add this rank's part of the summed gradient of ``reduce_read`` into the shard."""
        if self._read is None:
            return
        (works, name, flat), self._read = self._read, None
        works.wait()
        a, b = self._mine(name)
        if a < b:
            _, at, n = self._at(a, b)
            offset = self.layout.slot(name).offset
            self.grad_shard[at : at + n].add_(flat[a - offset : b - offset])

    @contextlib.contextmanager
    def whole(self, name: str):
        """Parameter ``name`` whole inside (zero=3: its bucket gathered, and freed after;
        a saved tensor that still needs it gathers it again)."""
        if self.stage == 2:
            yield
            return
        i = self._bucket_of[name]
        self.ensure(i)
        try:
            yield
        finally:
            self.release(i)

    def _stage(self, i: int) -> None:
        if self.lean:  # one bucket's gradients whole at a time
            for j in list(self._in_flight):
                self._settle(j)
        bucket = self.layout.buckets[i]
        self.events.log.append(("staged", f"{self.label}/{i}"))
        data = torch.zeros(
            bucket.end - bucket.start, dtype=self.layout.dtype, device=self.grad_shard.device
        )
        self._staging[i] = data
        for name in bucket.params:
            s = self.layout.slot(name)
            self.params[name].main_grad = data[s.offset - bucket.start :][: s.numel].view(
                self.params[name].shape
            )

    def _issue(self, i: int) -> None:
        if i not in self._staging:
            self._stage(i)  # every rank reduces every bucket, with or without a gradient here
        self.events.log.append(("issue", f"{self.label}/{i}"))
        self.events.issued += 1
        if self.tracer is not None and self.tracer.on:
            now = time.perf_counter_ns()
            self.tracer.add(f"reduce-scatter {self.label}/{i}", "dp_issue", now, now)
        self._issued.add(i)
        self._in_flight[i] = reduce_scatter_(self._staging[i], self.group)
        while len(self._in_flight) > IN_FLIGHT:
            self._settle(next(iter(self._in_flight)))

    def _settle(self, i: int) -> None:
        """Wait for bucket ``i``'s reduction, add this rank's part into the shard, free it."""
        work = self._in_flight.pop(i)
        if work is not None:
            work.wait()
        lo, at, size = self._part[i]
        start = self.layout.buckets[i].start
        self.grad_shard[at : at + size].add_(self._staging.pop(i)[lo - start :][:size])
        self.events.log.append(("settled", f"{self.label}/{i}"))
        for name in self.layout.buckets[i].params:
            self.params[name].main_grad = None

    def end_backward(self) -> None:
        """The chunk's backward action is done: reduce every bucket not yet reduced in it
        (in index order, the same on every rank), wait, free; free the parameters."""
        for i in range(len(self.layout.buckets)):
            if i not in self._deferred and i not in self._issued:
                self._issue(i)
        self._settle_all()
        self._round()
        if self.stage == 3:
            self.wait_for_params()

    def _settle_all(self) -> None:
        start = time.perf_counter_ns()
        self._settle_read()
        for i in list(self._in_flight):
            self._settle(i)
        if self.tracer is not None:
            self.tracer.add(
                f"wait reductions {self.label}", "dp_wait", start, time.perf_counter_ns()
            )

    def finish(self) -> None:
        """Reduce what is still staged (a gradient that came after the chunk's last backward)."""
        for i in sorted(self._staging):
            if i not in self._deferred and i not in self._in_flight:
                self._issue(i)
        self._settle_all()

    def finish_deferred(self) -> None:
        for i in sorted(self._deferred):
            self._issue(i)
        self._settle_all()
        self._round()

    # ------------------------------------------------------------ readers

    def _at(self, a: int, b: int) -> tuple[int, int, int]:
        """(bucket, where [a, b) starts in the shard tensors, its length); [a, b) must lie
        in this rank's part of one bucket."""
        i = next(bucket.index for bucket in self.layout.buckets if bucket.start <= a < bucket.end)
        lo, at, size = self._part[i]
        assert lo <= a <= b <= lo + size, (
            f"{self.label}: [{a}, {b}) is not this rank's part of bucket {i}"
        )
        return i, at + a - lo, b - a

    def grad_piece(self, a: int, b: int) -> torch.Tensor:
        _, at, n = self._at(a, b)
        return self.grad_shard[at : at + n]

    def param_piece(self, a: int, b: int) -> torch.Tensor:
        if self.stage == 2:
            return self.param_data[a:b]
        _, at, n = self._at(a, b)
        return self.param_shard[at : at + n]

    def reduced(self) -> torch.Tensor:
        return self.grad_shard

    def local_grads(self) -> torch.Tensor:
        out = torch.zeros(
            self.layout.numel, dtype=self.grad_shard.dtype, device=self.grad_shard.device
        )
        for lo, at, size in self._part.values():
            out[lo : lo + size] = self.grad_shard[at : at + size]
        return out

    def grad_of(self, name: str) -> torch.Tensor:
        i = self._bucket_of[name]
        if i in self._staging:  # a deferred bucket: whole until finish_deferred
            return self.params[name].main_grad
        a, b = self._mine(name)
        return self.grad_piece(a, b) if a < b else self.grad_shard[:0]

    def _mine(self, name: str) -> tuple[int, int]:
        """The buffer elements [a, b) of parameter ``name`` in this rank's part of its
        bucket (none when a >= b)."""
        s, (lo, _, size) = self.layout.slot(name), self._part[self._bucket_of[name]]
        return max(lo, s.offset), min(lo + size, s.offset + s.numel)

    def scale_(self, factor: float) -> None:
        self.grad_shard.mul_(factor)

    # ------------------------------------------------------------ parameters (zero=3)

    def _shard_params(self, device: torch.device,
                      fill: ShardFill | None) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Each bucket's flat parameter tensor (the parameters become views of it; freed
        once its shard is copied, so one bucket is whole at a time) and this rank's shard
        of all of them. Values come from the parameters, or from ``fill`` for its names."""
        dtypes = {p.dtype for p in self.params.values()}
        assert len(dtypes) == 1, (
            f"{self.label}: parameters of several dtypes {dtypes} in one buffer"
        )
        dtype = dtypes.pop()
        # empty: its pages become resident as the buckets are copied in, while the
        # parameters' own memory is freed bucket by bucket (every element is written)
        whole, shard = {}, torch.empty(self.layout.numel // self.n, dtype=dtype, device=device)
        for bucket in self.layout.buckets:
            flat = whole[bucket.index] = torch.zeros(
                bucket.end - bucket.start, dtype=dtype, device=device
            )
            lo, at, size = self._part[bucket.index]
            made = fill.make(self._covered(bucket, fill.names)) if fill is not None else {}
            for name in bucket.params:
                s, p = self.layout.slot(name), self.params[name]
                view = flat[s.offset - bucket.start :][: s.numel].view(p.shape)
                if name in made:
                    view.copy_(made.pop(name))
                elif fill is None or name not in fill.names:
                    view.copy_(p.detach())
                p.data = view
            shard[at : at + size] = flat[lo - bucket.start :][:size]
            flat.untyped_storage().resize_(0)
        return whole, shard

    def _covered(self, bucket, names: frozenset[str]) -> dict[str, tuple[int, int]]:
        """Of ``names`` in ``bucket``, those with elements in this rank's part -> the range
        [a, b) of their own elements in it."""
        out = {}
        for name in bucket.params:
            a, b = self._mine(name)
            if name in names and a < b:
                offset = self.layout.slot(name).offset
                out[name] = (a - offset, b - offset)
        return out

    def storages(self) -> dict[int, int]:
        """Storage key (torch_private.storage_key) of each bucket's parameters -> bucket."""
        return {storage_key(t): i for i, t in self._whole.items()}

    def gather(self, i: int) -> None:
        """Start making bucket ``i`` whole (nothing if it is, or is on its way)."""
        if i in self._live:
            return
        flat = self._whole[i]
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        lo, at, size = self._part[i]
        self.events.log.append(("gather", f"{self.label}/{i}"))
        self._gathering[i] = gather_into(flat, self.param_shard[at : at + size], self.group)
        self._live.add(i)

    def prefetch(self, i: int) -> None:
        """Start gathering bucket ``i`` if there is one."""
        if i < len(self.layout.buckets):
            self.gather(i)

    def ensure(self, i: int) -> None:
        """Bucket ``i`` whole now."""
        self.gather(i)
        work = self._gathering.pop(i, None)
        if work is not None:
            work.wait()

    def release(self, i: int) -> None:
        """Free bucket ``i``'s whole parameters (its shard stays)."""
        if i not in self._live:
            return
        self.ensure(i)  # a gather in flight writes into the memory
        self._whole[i].untyped_storage().resize_(0)
        self._live.discard(i)
        self.events.log.append(("released", f"{self.label}/{i}"))

    def gather_params(self, *, overlap: bool) -> None:
        if self.stage == 2:
            return super().gather_params(overlap=overlap)
        # zero=3: the updated shards are gathered when forward reads them

    def wait_for_params(self) -> None:
        if self.stage == 2:
            return super().wait_for_params()
        for i in list(self._live):
            self.release(i)

    def store(self) -> None:
        """Copy this rank's part of every whole bucket into the shard (after something
        wrote the whole parameters: a checkpoint load)."""
        for i in self._live:
            lo, at, size = self._part[i]
            self.param_shard[at : at + size] = self._whole[i][lo - self.layout.buckets[i].start :][
                :size
            ]


class ZeroParams:
    """zero=3 over every buffer of this rank (a chunk's dense buffer, over dp x cp, and its
    expert banks' buffer, over the expert-data-parallel ranks: each gathers and frees its
    own buckets over its own group): what the bound graph nodes, autograd's saved tensors
    and the recompute regions call, and whole parameters on demand."""

    def __init__(self, buffers: dict[int, list[GradBuffer]], *, recomputation: Recomputation,
                 post: bool = False) -> None:
        self.recomputation = recomputation
        """The rank's recompute regions: they make their parameters whole before they run."""
        self._chunks = buffers
        self.buffers: list[ZeroBuffer] = [b for bufs in buffers.values() for b in bufs]
        self.post = post
        """backward_prefetch='post': backward gathers the next bucket once it freed one."""
        self._storage = {
            key: (buf, i) for buf in self.buffers for key, i in buf.storages().items()
        }
        self.pending: dict[tuple[ZeroBuffer, int], int] = {}
        """(buffer, bucket) -> tensors autograd saved in its memory and still holds."""
        self.backward = False
        """Inside a chunk's backward (``running(backward=True)``)."""

    def gather(self, param: torch.Tensor, *, bucket: tuple, prefetch: tuple | None) -> None:
        """A bound ``ops.zero_gather`` (keys: ``BucketSlot.gather_key``)."""
        buffer_of(self._chunks, bucket).ensure(bucket[1])
        if prefetch is not None:
            buffer_of(self._chunks, prefetch).gather(prefetch[1])

    def release(self, param: torch.Tensor, *, bucket: tuple) -> None:
        """A bound ``ops.zero_release``."""
        buffer_of(self._chunks, bucket).release(bucket[1])

    def _pack(self, t: torch.Tensor):
        found = self._storage.get(storage_key(t))
        if found is None:
            return t
        self.pending[found] = self.pending.get(found, 0) + 1
        return _Saved(t, *found, self)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        buf, i = saved.buffer, saved.bucket
        # a bucket none of whose saved tensors autograd still holds is past its last use
        # in this backward (its gradients may come later: a tied embedding's, at the end)
        for other in self.buffers:
            for j in list(other._live):
                if (other is not buf or j not in (i, i + 1)) and not self.pending.get((other, j)):
                    self.freed(other, j)
        buf.ensure(i)
        # backward reaches buckets in index order
        if not self.post and self.pending.get((buf, i + 1)):
            buf.prefetch(i + 1)
        return saved.tensor

    def freed(self, buf: ZeroBuffer, i: int) -> None:
        """Free bucket ``i`` of ``buf`` in backward (no saved tensor needs it any more); with
        ``post``, start gathering the next one if backward still needs it."""
        buf.release(i)
        if self.post and self.pending.get((buf, i + 1)):
            buf.prefetch(i + 1)

    def _prepare(self, args) -> None:
        for t in args:
            if isinstance(t, torch.Tensor):
                found = self._storage.get(storage_key(t))
                if found is not None:
                    found[0].ensure(found[1])

    @contextlib.contextmanager
    def running(self, backward: bool = False):
        """Around a chunk's forward and backward: a saved tensor in a bucket's memory is
        kept as a reference (its memory may be freed), made whole again when backward
        unpacks it; a recompute region's parameters are made whole before it runs. In a
        backward, a bucket is freed once autograd let go of the last tensor it saved from
        it (``_Saved.__del__``)."""
        self.backward = backward
        log = self.buffers[0].events.log if backward and self.buffers else []
        log.append(("backward", "begin"))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                    self.recomputation.preparing(self._prepare):
                yield
        finally:
            self.backward = False
            log.append(("backward", "end"))

    @contextlib.contextmanager
    def whole(self, *, write: bool = False):
        """Every parameter whole inside (collective over the data-parallel ranks); with
        ``write``, what was written into them is kept in the shards on exit."""
        for buf in self.buffers:
            for i in buf._whole:
                buf.ensure(i)
        try:
            yield
        finally:
            for buf in self.buffers:
                if write:
                    buf.store()
                buf.wait_for_params()


class _Saved:
    """A tensor autograd saved that lives in a zero=3 bucket's memory."""

    __slots__ = ("tensor", "buffer", "bucket", "owner")

    def __init__(
        self, tensor: torch.Tensor, buffer: ZeroBuffer, bucket: int, owner: ZeroParams
    ) -> None:
        self.tensor, self.buffer, self.bucket, self.owner = tensor, buffer, bucket, owner

    def __del__(self) -> None:  # autograd let go of it: the node that read it has run
        owner, key = self.owner, (self.buffer, self.bucket)
        owner.pending[key] -= 1
        if owner.backward and not owner.pending[key]:  # no node left in this backward reads it
            owner.freed(self.buffer, self.bucket)
