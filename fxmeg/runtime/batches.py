"""Splitting a global batch into this rank's micro-batches, and checking batches before
any communication: a wrong shape or an out-of-range token id would otherwise fail deep
in one stage's forward while the other ranks wait."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from fxmeg.config import cast_inputs
from fxmeg.errors import BatchError
from fxmeg.ir.ops import cp_positions
from fxmeg.ir.program import CPLayout, Program
from fxmeg.runtime.context import RankContext

Batch = tuple[torch.Tensor, ...]
"""A batch as the runtime reads it: the inputs in the example's order."""
UserBatch = tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]
"""A batch as the user passes it: a tuple like a tuple example, a dict like a dict one."""


def needs_data(program: Program, ctx: RankContext) -> bool:
    """Whether this rank's chunks read inputs; middle pipeline stages may pass None."""
    return any(program.specs[c].data_inputs for c in ctx.chunks)


def microbatches(program: Program, ctx: RankContext, batch: UserBatch | Iterator[UserBatch] | None,
                 m: int) -> list[Batch]:
    """This data-parallel rank's ``m`` micro-batches of a global batch (rows
    interleaved over dp ranks: micro-batch i of dp rank r is rows (i * dp + r) * mbs ..),
    or the next ``m`` from an iterator of this rank's micro-batches (whole sequences);
    with cp > 1 cut to this context-parallel rank's positions (``context_slice``); on
    the device, in the training dtype."""
    mbs, dp = ctx.config.micro_batch_size, ctx.config.parallel.dp
    if batch is None:
        if needs_data(program, ctx):
            raise BatchError("this rank's pipeline chunks read inputs: pass the batch, not None")
        return [()] * m
    if isinstance(batch, (tuple, Mapping)):
        batch = positional(program, batch, what="global batch")
        check(program, batch, rows=m * mbs * dp, what="global batch")
        r = ctx.groups.dp_rank
        rows = [slice((i * dp + r) * mbs, (i * dp + r + 1) * mbs) for i in range(m)]
        out = [tuple(t[s] for t in batch) for s in rows]
    else:
        out = [positional(program, next(batch), what="micro-batch") for _ in range(m)]
        for mb in out:
            check(program, mb, rows=mbs, what="micro-batch")
    if program.cp_layout is not None:
        out = [context_slice(program.cp_layout, mb, ctx.groups.cp_rank) for mb in out]
    dtype = ctx.config.dtype
    return [
        cast_inputs(tuple(t.to(ctx.device, non_blocking=True) for t in mb), dtype) for mb in out
    ]


def context_slice(layout: CPLayout, mb: Batch, cp_rank: int) -> Batch:
    """This context-parallel rank's positions of every sequence of a micro-batch: the
    inputs the context-parallel pass split, cut along their sequence dim to chunks
    ``cp_rank`` and ``2 * cp - 1 - cp_rank`` of ``2 * cp`` (``ops.cp_positions``), after
    the shift the model applies to an input itself (``CPLayout.shifts``); the others
    whole. Every cp rank of a data-parallel rank reads the same rows."""
    positions = cp_positions(layout.seq, layout.cp, cp_rank)
    out = []
    for i, (t, dim) in enumerate(zip(mb, layout.dims)):
        fill = layout.shifts[i] if layout.shifts else None
        if fill is not None:  # the model's own label shift, on the whole sequence
            t = torch.cat(
                [t.narrow(dim, 1, t.shape[dim] - 1), t.narrow(dim, 0, 1).clone().fill_(fill)],
                dim=dim,
            )
        if dim is not None:
            t = t.index_select(dim, torch.tensor(positions, device=t.device))
        out.append(t)
    return tuple(out)


def positional(program: Program, batch: UserBatch, *, what: str) -> Batch:
    """``batch`` as the runtime reads it: a dict's tensors in the order of the example's
    keys (the model receives them by keyword), a tuple as it is. A dict for a tuple
    example, a tuple for a dict example, or a missing or unknown key is refused."""
    names = [i.name for i in program.inputs]
    if not program.keywords:
        if isinstance(batch, Mapping):
            raise BatchError(
                f"a {what} is a dict (keys {_keys(batch)}), but the example inputs were a tuple "
                f"({', '.join(names)}): pass a tuple, or pass a dict as the example to parallelize "
                "so that the model takes its tensors by keyword"
            )
        return batch
    if not isinstance(batch, Mapping):
        raise BatchError(
            f"a {what} must be a dict with the example's keys ({_keys(names)}), passed to the "
            f"model by keyword; got {type(batch).__name__}"
        )
    missing = [n for n in names if n not in batch]
    extra = [k for k in batch if k not in names]
    if missing or extra:
        wrong = [f"missing {_keys(missing)}"] * bool(missing) + [f"unknown {_keys(extra)}"] * bool(
            extra
        )
        raise BatchError(
            f"a {what} has keys {_keys(batch)} ({'; '.join(wrong)}); the example micro-batch has "
            f"{_keys(names)}: every batch must have the same keys (pad to the same fields, or "
            "pass a new example to parallelize)"
        )
    return tuple(batch[n] for n in names)


def _keys(names) -> str:
    return ", ".join(map(repr, names))


def check(program: Program, batch: Batch, *, rows: int, what: str) -> None:
    """Shapes and dtypes like the example micro-batch (``rows`` rows), and the values of
    inputs that index a loss's classes or an embedding's rows inside their range."""
    inputs = program.inputs
    if not isinstance(batch, tuple) or len(batch) != len(inputs):
        raise BatchError(
            f"a {what} must be a tuple of {len(inputs)} tensors "
            f"({', '.join(i.name for i in inputs)}), like the example inputs"
        )
    for t, ex in zip(batch, inputs):
        want = (rows, *ex.shape[1:])
        same_kind = t.dtype == ex.dtype or (t.is_floating_point() and ex.dtype.is_floating_point)
        if tuple(t.shape) != want or not same_kind:
            raise BatchError(
                f"{what} input {ex.name!r} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                f"expected {want} and {ex.dtype} (the example micro-batch's shape with "
                f"{rows} rows = micro_batch_size x dp x micro-batches"
                + (
                    "; for sequences whose length changes from batch to batch, pass "
                    "variable_seq_lengths=True)"
                    if tuple(t.shape[1:]) != want[1:] and t.dim() == len(want)
                    else ")"
                )
            )
    for c in program.value_checks:
        t = batch[c.index]
        bad = (t >= c.high) | ((t < 0) & (t != c.ignore) if c.ignore is not None else (t < 0))
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            allowed = f"0..{c.high - 1}" + (f" or {c.ignore}" if c.ignore is not None else "")
            raise BatchError(
                f"{what} input {inputs[c.index].name!r} holds {int(t[where])} at "
                f"{where}: {c.what} must be in {allowed}; check the tokenizer's vocabulary "
                f"against the model's ({c.high})"
            )
