"""How view-like ops move a tensor-parallel split (``fxmeg.ir.layouts.Shard``) between
dimensions, for the tensor-parallel pass and the context-parallel pass's reshapes.

A value is either replicated (``None``: every rank holds all of it) or a ``Shard``: split
along ``dim`` into tp equal parts, block by block (``parts``: the global sizes of the
blocks laid end to end along ``dim``; a fused QKV output has three blocks, and rank r
holds the r-th tp-th of each).
"""

from __future__ import annotations

from torch import fx

from fxmeg.ir.layouts import Shard
from fxmeg.passes.graph_utils import val


def dim_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair the dims of shape ``a`` with those of shape ``b`` (same numel) whose products
    match: ([0], [0]), ([1, 2], [1]) for (2, 4, 8) -> (2, 32)."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa, i = pa * a[i], i + 1
                gi.append(i - 1)
            else:
                pb, j = pb * b[j], j + 1
                gj.append(j - 1)
        groups.append((gi, gj))
    if i < len(a) or j < len(b):  # trailing size-1 dims
        groups.append((list(range(i, len(a))), list(range(j, len(b)))))
    return groups


class Indivisible(str):
    """A reshape failure because tp does not divide the new split dim (e.g. the heads)."""

    size: int
    sizes: tuple[int, ...]
    """The sizes the split dim is reshaped into, e.g. (heads, head_dim)."""


def reshape_shard(s: Shard, a: tuple[int, ...], b: tuple[int, ...], tp: int) -> Shard | str:
    """Where a reshape from global shape ``a`` to ``b`` moves shard ``s``, or why it cannot
    (an ``Indivisible`` when only divisibility is in the way).

    The split dim must be the outermost (non-1) dim of its group; the shard moves to the
    outermost (non-1) dim of the matching output group, which must be divisible by tp.
    Splitting the last (feature) dim into several, as (heads, head_dim), puts the shard on
    the first of them, a single head included (1 KV head: tp must divide 1). Blocks
    survive only when the split dim is left alone, or when the reshape cuts the dim into
    (blocks, ..., split dim, ...) again (``_unmerged``). Merged with replicated dims
    outside it into one dim, as heads into the batch of a ``bmm`` ((b, heads, t, d) ->
    (b * heads, t, d)), the split dim becomes blocks: one per entry of the outer dims,
    each split as the dim was (``_merged``). Not a sequence-parallel split: its
    all-gather and reduce-scatter act on one dim and would reorder the tokens of blocks.
    """
    for gi, gj in dim_groups(a, b):
        if s.dim not in gi:
            continue
        outer_in = [d for d in gi if a[d] != 1]
        outer_out = [d for d in gj if b[d] != 1]
        if outer_in and outer_in[0] != s.dim and len(outer_out) == 1 and not s.seq:
            return _merged(s, a, gi, outer_out[0])  # (a sequence split stays refused: see below)
        if not outer_in or outer_in[0] != s.dim or not outer_out:
            return _regrouped(s, a, b, gi, gj, tp) or (
                f"it merges dim {s.dim} (size {a[s.dim]}, split over tp ranks) into a larger dim "
                "with dims outside it"
            )
        o = outer_out[0]
        if len(s.parts) > 1 and len(outer_out) > 1:
            inner = 1
            for d in outer_in[1:]:
                inner *= a[d]
            return _unmerged(s, b, outer_out, tp, inner)
        if s.dim == len(a) - 1 and len(gj) > 1 and gj[-1] == len(b) - 1:
            o = gj[0]  # features -> (heads, head_dim): the split is over heads, even one
        elif len(outer_in) == 1 and len(outer_out) == 1:
            return s.moved(o)  # the split dim keeps its size: blocks survive
        if len(s.parts) > 1:
            return (
                _regrouped(s, a, b, gi, gj, tp)
                or f"it reshapes a dim made of {len(s.parts)} fused blocks {s.parts}"
            )
        if b[o] % tp:
            why = Indivisible(
                f"it splits the dim into a dim of size {b[o]}, which tp={tp} does not divide"
            )
            why.size, why.sizes = b[o], tuple(b[d] for d in gj if b[d] != 1 or d == o)
            return why
        return s.moved(o, (b[o],))
    raise AssertionError("dim not found in groups")


def _merged(s: Shard, a: tuple[int, ...], gi: list[int], o: int) -> Shard:
    """The split dim merged with the dims of its group into output dim ``o``: each
    entry of the dims outside it (before) holds one copy of its blocks, each scaled by
    the dims inside it (after), and every block stays split over tp ranks as it was."""
    outer = inner = 1
    for d in gi:
        if d < s.dim:
            outer *= a[d]
        elif d > s.dim:
            inner *= a[d]
    return s.moved(o, tuple(p * inner for p in s.parts) * outer)


def _unmerged(
    s: Shard, b: tuple[int, ...], outs: list[int], tp: int, inner: int = 1
) -> Shard | str:
    """A dim of equal blocks (with the ``inner`` elements of the dims after it in its
    group) cut into several dims: the split goes to the dim ``o`` where the dims before it
    count the blocks and ``o`` with the dims after it spans one block ((b * heads, t, d) ->
    (b, heads, t, d); a fused q, k, v viewed as (3, heads, head_dim); JetMoE's attention
    output (k * heads, head_dim) viewed as (k, heads * head_dim)); rank r's part of every
    block, a contiguous run of its elements, is then the r-th tp-th of ``o``."""
    count, size = len(s.parts), s.parts[0]
    before = 1
    for i, o in enumerate(outs):
        after = 1
        for d in outs[i + 1:]:
            after *= b[d]
        if before == count and b[o] * after == size * inner and set(s.parts) == {size}:
            if b[o] % tp:
                why = Indivisible(
                    f"it splits each of its {count} blocks into a dim of size {b[o]}, "
                    f"which tp={tp} does not divide"
                )
                why.size, why.sizes = b[o], tuple(b[d] for d in outs)
                return why
            return s.moved(o, (b[o],))
        before *= b[o]
    return f"it reshapes a dim made of {len(s.parts)} fused blocks {s.parts} across their bounds"


def _regrouped(s: Shard, a: tuple[int, ...], b: tuple[int, ...], gi: list[int], gj: list[int],
               tp: int) -> Shard | None:
    """The split when a reshape both cuts and merges around it, as a gated norm per head
    does: (b, s, heads * d) -> (b * s * heads, d) and back. Which rank holds an element
    depends only on its index along the split dim, which repeats with the period of the
    blocks (``base``, the shortest prefix of ``parts`` they repeat). An output dim ``o``
    whose own size times the dims inside it (``after``) spans whole periods holds the
    split, when ``after`` is a multiple of the dims inside the split dim (``inner``) that
    leaves each rank's part whole (a cut inside heads), or divides it; None if no dim does.
    Not a sequence-parallel split (its collectives act on one dim)."""
    if s.seq:
        return None
    base = next(s.parts[:k] for k in range(1, len(s.parts) + 1)
                if len(s.parts) % k == 0 and s.parts[:k] * (len(s.parts) // k) == s.parts)
    period, inner = sum(base), 1
    for d in gi:
        inner *= a[d] if d > s.dim else 1
    for i, o in enumerate(gj):
        after = 1
        for d in gj[i + 1:]:
            after *= b[d]
        if b[o] == 1 or (b[o] * after) % (period * inner):
            continue
        copies = b[o] * after // (period * inner)
        if after % inner == 0 and all(
            p % tp == 0 and (p // tp) % (after // inner) == 0 for p in base
        ):
            return s.moved(o, tuple(p // (after // inner) for p in base) * copies)
        if inner % after == 0:
            return s.moved(o, tuple(p * (inner // after) for p in base) * copies)
    return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def matmul_letters(ra: int, rb: int) -> tuple[list[str], str]:
    """torch.matmul of operands of ranks ``ra`` and ``rb`` as einsum letters: batch dims
    broadcast from the right, ``k`` contracted."""
    nb = max(ra - 2, rb - 2, 0)
    batch = "abcdefgh"[:nb]
    a = "k" if ra == 1 else batch[nb - (ra - 2):] + "mk"
    b = "k" if rb == 1 else batch[nb - (rb - 2):] + "kn"
    return [a, b], batch + ("m" if ra > 1 else "") + ("n" if rb > 1 else "")


def einsum_letters(node: fx.Node) -> tuple[list[str], str]:
    """An einsum's operand and output letters, '...' spelled out (in capitals)."""
    eq, operands = node.args[0].replace(" ", ""), node.args[1]
    ins, _, out = eq.partition("->")
    ins = ins.split(",")
    if not _:
        out = "".join(
            sorted(c for c in set("".join(ins)) if "".join(ins).count(c) == 1 and c != ".")
        )
    ell = max(val(a).dim() - len(t.replace("...", "")) for a, t in zip(operands, ins))
    caps = "ABCDEFGH"[:ell]

    def spell(t, rank):
        k = rank - len(t.replace("...", ""))
        return t.replace("...", caps[ell - k:] if k else "")

    return [spell(t, val(a).dim()) for a, t in zip(operands, ins)], spell(out, val(node).dim())
