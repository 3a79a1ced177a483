"""Variable sequence lengths: one Program per input shape, all sharing this rank's tensors
(``EngineConfig.variable_seq_lengths``; docs/architecture.md §2.2).

A Program is transformed for the example's static shapes: arange ends, reshapes, the
loss's token count, the shapes of the tensors crossing a pipeline cut. When batches are
padded per global batch to their longest sequence, the shape changes from step to step.
fxmeg then captures the model again for each new shape, on the meta device (a shapes-only
twin of the user's model made at ``parallelize``: no value is copied), runs the passes
with the example's pipeline cut pinned, and binds the new chunk graphs to the tensors
this rank already trains (``runtime.context.bind``). Each shape is compiled once, on every
rank alike (the passes are deterministic and rank-free: no collective), and reported on
the ``fxmeg.frontend.variable_shapes`` logger and in ``Shapes.compiled``.

Pipeline ranks must run the same shape in a step, and a middle stage reads no data: at
the start of each step the stages (and the tp and cp peers of each) agree on it with a
small all-reduce over each of those groups (Megatron's ``variable_seq_lengths`` exchanges every
message's shape instead; here one exchange per step fixes the shapes of all of them).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from fxmeg.errors import BatchError
from fxmeg.frontend.capture import LossFn
from fxmeg.ir.program import Program
from fxmeg.runtime.batches import UserBatch, positional
from fxmeg.runtime.context import Bound, RankContext, bind

log = logging.getLogger("fxmeg.frontend.variable_shapes")

MANY_SHAPES = 16
"""From this many compiled shapes on (then at every power of two), a warning suggests padding
to a few lengths."""

Key = tuple[tuple[int, ...], ...]
"""Every input's shape without its first (batch) dimension."""


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same
    shapes and dtypes (ties kept; nothing is allocated or copied): what new shapes are
    captured on, and what ``fxmeg plan`` transforms."""
    memo: dict[int, torch.Tensor] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo:
            continue
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            nn.Parameter(empty, requires_grad=t.requires_grad)
            if isinstance(t, nn.Parameter)
            else empty
        )
    return copy.deepcopy(model, memo)


@dataclasses.dataclass
class Shapes:
    """The Programs compiled so far, by input shape; the first is the example's."""

    twin: nn.Module
    loss_fn: LossFn | None
    first: Program
    known: dict[Key, Bound]
    compiled: list[tuple[Key, float]] = dataclasses.field(default_factory=list)
    """(shape, seconds) of each shape compiled after the example's, in order."""

    @classmethod
    def start(
        cls, twin: nn.Module, loss_fn: LossFn | None, program: Program, ctx: RankContext
    ) -> Shapes:
        return cls(
            twin,
            loss_fn,
            program,
            {key_of(program): Bound(program, ctx.chunks, ctx.executor, ctx.aux)},
        )

    def select(self, batch: UserBatch | list | None, ctx: RankContext) -> Program:
        """Switch ``ctx`` to the Program of ``batch``'s shape (a global batch, a list of
        this rank's micro-batches, or None on a rank that reads no data), compiling it
        if it is new; return it. Collective over the pipeline, tp and cp groups."""
        try:
            key, failed = self._key(batch), None
        except BatchError as e:  # every stage must learn it: the others would wait for this one
            key, failed = None, e
        key = self._agree(key, ctx, failed)
        bound = self.known.get(key)
        if bound is None:
            bound = self.known[key] = self._compile(key, ctx)
        ctx.use(bound)
        return bound.program

    def use_example(self, ctx: RankContext) -> None:
        """Switch ``ctx`` back to the example's shape."""
        ctx.use(self.known[key_of(self.first)])

    def _key(self, batch) -> Key | None:
        if batch is None:
            return None
        tensors = positional(
            self.first, batch[0] if isinstance(batch, list) else batch, what="batch"
        )
        inputs = self.first.inputs
        if (
            not isinstance(tensors, tuple)
            or len(tensors) != len(inputs)
            or any(
                not isinstance(t, torch.Tensor) or t.dim() != len(i.shape)
                for t, i in zip(tensors, inputs)
            )
        ):
            got = [
                tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors
            ]
            raise BatchError(
                f"a batch must hold {len(inputs)} tensors like the example's "
                f"({', '.join(f'{i.name!r}: {len(i.shape)} dims' for i in inputs)}); got {got}"
            )
        key = tuple(tuple(t.shape[1:]) for t in tensors)
        for mb in batch if isinstance(batch, list) else ():
            other = tuple(
                tuple(t.shape[1:]) for t in positional(self.first, mb, what="micro-batch")
            )
            if other != key:
                raise BatchError(
                    "the micro-batches of one step must have one shape (the sequence length may "
                    f"change per global batch only); got {_shape_text(key)} and "
                    f"{_shape_text(other)}"
                )
        return key

    def _agree(self, key: Key | None, ctx: RankContext, failed: BatchError | None = None) -> Key:
        """The step's shape, the same on every pipeline stage: stages that read data must
        have the same one; the others adopt it. A stage whose batch was refused
        (``failed``) raises its error, and every other stage raises too."""
        widths = [len(i.shape) - 1 for i in self.first.inputs]
        # the ranks that must run one shape: a pipeline's stages, and the tp and cp peers
        # that compute each stage together (with an iterator, each rank brings its own)
        groups = [g for g in (ctx.groups.pp, ctx.groups.tp, ctx.groups.cp) if g is not None]
        if not groups:  # alone: this rank reads data (batches.microbatches refuses None)
            if failed is not None:
                raise failed
            return key if key is not None else key_of(self.first)
        flat = [d for shape in key for d in shape] if key is not None else None
        n = sum(widths)
        # MAX over [key, -key, failed]: the largest and (negated) the smallest key of the
        # ranks with data, and whether any stage refused its batch
        mine = flat + [-d for d in flat] if flat is not None else [-1] * n + [-(2**62)] * n
        t = torch.tensor([*mine, int(failed is not None)], dtype=torch.int64, device=ctx.device)
        # after the last, every rank of the (pp x tp x cp) block holds its extremes
        for group in groups:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        if failed is not None:
            raise failed
        if t[-1] > 0:
            raise BatchError(
                "another pipeline stage refused its batch of this step (its error says why); "
                "this stage stops with it"
            )
        high, low = t[:n].tolist(), [-d for d in t[n:2 * n].tolist()]
        if high != low:
            raise BatchError(
                "ranks that compute one step together (pipeline stages, tp and cp peers) received "
                f"batches of different shapes ({_shape_text(_unflat(low, widths))} and "
                f"{_shape_text(_unflat(high, widths))}): every stage that reads data must get the "
                "same global batch"
            )
        return _unflat(high, widths)

    def _compile(self, key: Key, ctx: RankContext) -> Bound:
        from fxmeg.frontend.pass_driver import (
            transform,  # the passes: only here, when a new shape arrives
        )

        first = self.first
        check_positions(first, key)
        start = time.perf_counter()
        mbs = ctx.config.micro_batch_size
        example = tuple(
            torch.empty((mbs, *shape), dtype=i.dtype, device="meta")
            for i, shape in zip(first.inputs, key)
        )
        if first.keywords:
            example = dict(zip((i.name for i in first.inputs), example))
        par = first.config.parallel
        units, starts = first.partition.units, first.partition.starts
        pinned = dataclasses.replace(par, split_points=tuple(units[s] for s in starts[1:]) or None)
        config = dataclasses.replace(first.config, parallel=pinned)
        try:
            program = transform(
                self.twin, example, config, loss_fn=self.loss_fn, device=first.device
            )
        except BatchError:
            raise
        except Exception as e:
            hint = ""
            if "DeviceMismatch" in str(e) and "meta" in str(e):
                hint = (
                    "A new shape is captured on shapes alone (the meta device), where a tensor the "
                    "forward makes from Python values (torch.tensor(a_list)) cannot meet the "
                    "activations: register such a table as a buffer (slice it to the length in "
                    "forward), or pad every batch to the example's length. "
                )
            raise BatchError(
                f"the model could not be captured for inputs of shape {_shape_text(key)} (the "
                f"example's: {_shape_text(key_of(first))}): {hint}{type(e).__name__}: {e}"
            ) from e
        bound = bind(program, first, ctx)
        seconds = time.perf_counter() - start
        self.compiled.append((key, seconds))
        count = len(self.known) + 1
        log.info("compiled the Program for input shape %s in %.2f s (%d shapes so far)",
                 _shape_text(key), seconds, count)
        if count >= MANY_SHAPES and count & (count - 1) == 0:  # 16, 32, 64, ...
            log.warning(
                "%d input shapes compiled (%.1f s in all): pad batches to a few lengths (a "
                "multiple of 64, a tokenizer's pad_to_multiple_of) to compile less",
                count,
                sum(t for _, t in self.compiled),
            )
        return bound


def check_positions(program: Program, key: Key) -> None:
    """Refuse a shape whose sequence is longer than a table the model reads one row per
    position from (its position embedding, its rotary tables): naming both numbers."""
    for table in program.position_tables:
        length = key[table.index][table.dim - 1]
        if length > table.rows:
            name = program.inputs[table.index].name
            raise BatchError(
                f"input {name!r} has sequence length {length} (dimension {table.dim}), but the "
                f"model's {table.what} has {table.rows} rows: the model takes sequences of at most "
                f"{table.rows}; truncate the batch or build the model with longer position tables"
            )


def _unflat(flat: list[int], widths: list[int]) -> Key:
    out, i = [], 0
    for w in widths:
        out.append(tuple(flat[i : i + w]))
        i += w
    return tuple(out)


def key_of(program: Program) -> Key:
    return tuple(tuple(i.shape[1:]) for i in program.inputs)


def _shape_text(key: Key) -> str:
    return ", ".join(f"(b, {', '.join(map(str, s))})" if s else "(b,)" for s in key)


def collect(batch: UserBatch | Iterator[UserBatch] | None, m: int) -> UserBatch | list | None:
    """A global batch or None as it is; the next ``m`` micro-batches of an iterator as a
    list (their shape must be known before the step starts)."""
    if batch is None or isinstance(batch, (tuple, Mapping)):
        return batch
    return [next(batch) for _ in range(m)]
