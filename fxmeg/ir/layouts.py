"""Layouts: where the pieces of a value or a parameter live over the ranks of one parallel
axis. One family of frozen records, checked when made, shared by the passes (which
decide layouts) and the runtime (which materialises, gathers and reduces by them).

Tensor parallelism (tp), for a value in the graph or a parameter:
  * ``None``       replicated: every tp rank holds all of it (a value's default);
  * ``Shard``      split along ``dim`` into tp equal pieces, block by block (``parts``);
  * ``Replicate``  a parameter whole on every tp rank; ``reduce_grad`` when its gradient
                   differs per rank (it touches a split value) and is all-reduced over tp;
  * ``PARTIAL``    each rank holds a partial sum (a row-parallel output before its
                   all-reduce; under cp, a sum over this rank's tokens);
  * ``LOCAL``      this rank's own part of a replicated value (``fxmeg::tp_slice``), or a
                   rank's local statistic before it is all-reduced.
Context parallelism (cp): a value split along the sequence is a ``Seq``; ``CPLayout``
says how the runtime cuts each batch input.
Expert parallelism (ep): a bank of routed experts (a parameter whose dim 0 counts the
experts) is an ``ExpertShard``: ep rank r holds experts [r * E / ep, (r + 1) * E / ep).

Only this module indexes, unpacks or compares the fields of a layout positionally;
everyone else asks it (``is_split``, ``reduces_grad``, ``Shard.local_shape`` ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fxmeg.errors import LayoutError

if TYPE_CHECKING:
    import torch

def _check_dim(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LayoutError(
            f"{owner}.{name} must be a non-negative int (a dim of the value), got {value!r}"
        )


@dataclass(frozen=True)
class Shard:
    """Split along ``dim`` into tp equal pieces, block by block: a fused QKV output has
    three blocks, and rank r holds the r-th tp-th of each, blocks end to end."""

    dim: int
    """Split dimension (non-negative, in the value's own dimensions)."""
    parts: tuple[int, ...]
    """Global sizes of the blocks along ``dim``; each is split evenly over tp ranks."""
    seq: bool = False
    """The residual stream's sequence shard (sequence parallelism)."""
    vocab: bool = False
    """Logits over this rank's vocabulary shard."""
    origin: str = field(default="", compare=False)
    """Module FQN of the linear or embedding that split it (for error messages)."""

    def __post_init__(self) -> None:
        _check_dim("Shard", "dim", self.dim)
        parts = tuple(self.parts) if isinstance(self.parts, (list, tuple)) else self.parts
        if not isinstance(parts, tuple) or not parts or not all(
                isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in parts):
            raise LayoutError(
                f"Shard.parts must be a non-empty tuple of positive block sizes, got {self.parts!r}"
            )
        object.__setattr__(self, "parts", parts)

    def moved(self, dim: int, parts: tuple[int, ...] | None = None) -> Shard:
        """The same split, now along ``dim`` (a view moved it), with new blocks if given."""
        return replace(self, dim=dim, parts=self.parts if parts is None else parts)

    def local_shape(self, shape: Sequence[int], tp: int) -> tuple[int, ...]:
        """The shape one tp rank holds of a tensor of global ``shape``."""
        out = list(shape)
        out[self.dim] //= tp
        return tuple(out)

    def block_ranges(self, tp: int, rank: int) -> list[tuple[int, int]]:
        """[start, end) of rank's piece of every block, in global coordinates."""
        out, start = [], 0
        for p in self.parts:
            step = p // tp
            out.append((start + rank * step, start + (rank + 1) * step))
            start += p
        return out


@dataclass(frozen=True)
class Replicate:
    """A parameter whole on every tp rank."""

    reduce_grad: bool = False
    """Its gradient differs per tp rank (it reaches a split value with no collective in
    between: a norm's weight under sequence parallelism) and is all-reduced over tp."""

    def __post_init__(self) -> None:
        if not isinstance(self.reduce_grad, bool):
            raise LayoutError(f"Replicate.reduce_grad must be a bool, got {self.reduce_grad!r}")


ParamLayout = Shard | Replicate
"""A parameter's tensor-parallel layout (``Program.tp_specs``)."""


@dataclass(frozen=True)
class Partial:
    """Each rank holds a partial sum of the value; only a reduction makes it whole."""

    def __repr__(self) -> str:
        return "PARTIAL"


@dataclass(frozen=True)
class Local:
    """This rank's own part of a replicated value, or its local statistic."""

    def __repr__(self) -> str:
        return "LOCAL"


PARTIAL = Partial()
LOCAL = Local()


@dataclass(frozen=True)
class Seq:
    """Where a value holds the sequence under context parallelism: ``dim``, alone or,
    ``merged``, as the inner part of a dim flattened with the batch dims before it
    ((b, s) -> (b * s)); ``full``: a dim holding every position in global order (the keys
    of eager attention's scores, from all-gathered keys), or None."""

    dim: int
    merged: bool = False
    full: int | None = None

    def __post_init__(self) -> None:
        _check_dim("Seq", "dim", self.dim)
        if self.full is not None:
            _check_dim("Seq", "full", self.full)

    def shifted(self, by: int) -> Seq:
        """The same dims ``by`` places later (broadcasting adds leading dims)."""
        return Seq(self.dim + by, self.merged, None if self.full is None else self.full + by)


Placement = Shard | Seq | Partial | Local | None
"""Where one value of the graph lives over one axis's ranks: a propagation rule's answer
(fxmeg/passes/propagation.py). None is replicated."""
Places = Placement | list[Placement]
"""A node's placement: a list, one per output, for a node of several (``getitem`` picks)."""


@dataclass(frozen=True)
class CPLayout:
    """How the runtime cuts a micro-batch over cp ranks."""

    seq: int
    """Global sequence length s."""
    cp: int
    dims: tuple[int | None, ...]
    """Per input (example order): the dim holding the sequence, or None (not split)."""
    shifts: tuple[float | None, ...] = ()
    """Per input: shift it left by one position along the sequence, filling the end with
    this value, before the cut (labels the model shifts itself); None: as it is."""

    def __post_init__(self) -> None:
        if self.seq % (2 * self.cp):
            raise LayoutError(
                f"CPLayout: sequence {self.seq} is not 2 * cp = {2 * self.cp} equal chunks"
            )
        for d in self.dims:
            if d is not None:
                _check_dim("CPLayout", "dims[i]", d)


@dataclass(frozen=True)
class ExpertShard:
    """A parameter of a routed-experts bank, split along dim 0 (the experts) over ep ranks
    in equal runs of whole experts. Its gradient is reduced over the expert-data-parallel
    ranks only (those holding the same experts)."""

    experts: int
    """E: the experts of the layer (dim 0 of the full parameter)."""
    origin: str = field(default="", compare=False)
    """Module FQN of the experts (for messages)."""

    def __post_init__(self) -> None:
        if not isinstance(self.experts, int) or isinstance(self.experts, bool) or self.experts < 1:
            raise LayoutError(f"ExpertShard.experts must be a positive int, got {self.experts!r}")

    def local_shape(self, shape: Sequence[int], ep: int) -> tuple[int, ...]:
        """The shape one ep rank holds of a parameter of global ``shape``."""
        return (shape[0] // ep, *shape[1:])

    def experts_of(self, ep: int, rank: int) -> tuple[int, int]:
        """[first, end) of the experts ep rank ``rank`` holds."""
        step = self.experts // ep
        return rank * step, (rank + 1) * step


@dataclass(frozen=True)
class BucketSlot:
    """Where a trainable parameter's gradient is reduced: bucket ``index`` of the gradient
    buffer of ``dtype`` that chunk ``chunk`` (the parameter's home) holds; with ``experts``,
    of that chunk's buffer of expert banks (reduced over the expert-data-parallel ranks),
    whose bucket indices count from 0 again."""

    chunk: int
    dtype: torch.dtype
    index: int
    experts: bool = False

    def __post_init__(self) -> None:
        _check_dim("BucketSlot", "chunk", self.chunk)
        _check_dim("BucketSlot", "index", self.index)

    @property
    def gather_key(self) -> tuple:
        """What a ``wait_param_gather`` or ``zero_gather`` marker names: (home chunk, bucket
        index), or (home chunk, bucket index, 'experts') in the experts' buffer (the two
        buffers number their buckets alike: one key for both would gather, or free, the
        wrong one)."""
        return (self.chunk, self.index, "experts") if self.experts else (self.chunk, self.index)


def is_split(layout: object) -> bool:
    """Whether a tp layout (a parameter's or a value's) splits the tensor over tp ranks."""
    return isinstance(layout, Shard)


def reduces_grad(layout: object) -> bool:
    """Whether a parameter's gradient is all-reduced over tp (a replicated parameter whose
    gradient differs per rank)."""
    return isinstance(layout, Replicate) and layout.reduce_grad
