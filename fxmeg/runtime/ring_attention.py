"""Kernels of context parallelism's exchanged attentions (Megatron-Core's ``cp_comm_type``
``p2p``, ``a2a`` and ``a2a+p2p``; docs/long-context.md):

- ``cp_to_heads`` / ``cp_from_heads`` (DeepSpeed-Ulysses): within each run of ``inner``
  consecutive cp ranks, an all-to-all trades this rank's sequence part of every head for
  every run member's sequence part of 1/inner of the heads; rows come out in global
  position order (``ops.cp_held``). Each is the other's backward.
- ``cp_ring_attention``: the ring. Every step posts the next block of keys and values
  (one message) before this block's attention and waits for it after; blocks where no
  query sees a key are skipped, and only the rows and columns some pair sees are computed
  (the causal load balance: every rank does the same work). Blocks merge by log-sum-exp
  in fp32. Its backward sends the keys and values around again, and with them the running
  dK and dV (fp32), which come home after the last step.

Attention inside a block is fp32 math (scores, then probabilities): exact on every
device, not the fused kernel a GPU would use (docs/long-context.md, blind spots).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from fxmeg.ir import ops
from fxmeg.torch_private import resolve_process_group

PIECE_BYTES = 64 * 2**20
"""The most bytes of one block's scores computed at once (its rows in pieces)."""
KV_TAG, GRAD_TAG = 17, 18
"""Point-to-point tags of the ring's keys/values and of its running gradients (gloo
matches messages by tag; NCCL by order, which is the same on every rank)."""


def _kernel(name: str):
    return torch.library.register_kernel(f"fxmeg::{name}", None)


# ---------------------------------------------------------------- sequence <-> heads


def _order(seq: int, size: int, rank: int, inner: int) -> tuple[Tensor, list[int]]:
    """(the permutation that sorts the run's rows, run-member-major, into position order;
    the cp ranks of the run)."""
    first = rank - rank % inner
    members = list(range(first, first + inner))
    rows = [p for r in members for p in ops.cp_positions(seq, size, r)]
    return torch.tensor(sorted(range(len(rows)), key=rows.__getitem__)), members


def _exchange(parts: Tensor, members: list[int], size: int, group: dist.ProcessGroup) -> Tensor:
    """All-to-all of ``parts`` (inner, ...): part j to run member j, part j back from it;
    the cp ranks outside the run send and receive nothing."""
    out = torch.empty_like(parts)
    n = parts[0].numel()
    splits = [n if r in members else 0 for r in range(size)]
    dist.all_to_all_single(out.view(-1), parts.view(-1), splits, splits, group=group)
    return out


@_kernel("cp_to_heads")
def _cp_to_heads(x: Tensor, dim: int, size: int, inner: int, group: str) -> Tensor:
    pg = resolve_process_group(group)
    dim %= x.dim()
    heads, rows = x.shape[dim - 1], x.shape[dim]
    perm, members = _order(rows * size, size, dist.get_rank(pg), inner)
    parts = x.unflatten(dim - 1, (inner, heads // inner)).movedim(dim - 1, 0).contiguous()
    got = _exchange(parts, members, size, pg)  # (inner, ..., heads/inner, rows, ...)
    merged = got.movedim(0, dim).flatten(dim, dim + 1)  # member-major rows
    return merged.index_select(dim, perm.to(x.device)).contiguous()


@_kernel("cp_from_heads")
def _cp_from_heads(x: Tensor, dim: int, size: int, inner: int, group: str) -> Tensor:
    pg = resolve_process_group(group)
    dim %= x.dim()
    rows = x.shape[dim] // inner
    perm, members = _order(rows * size, size, dist.get_rank(pg), inner)
    merged = x.index_select(dim, torch.argsort(perm).to(x.device))  # member-major rows
    parts = merged.unflatten(dim, (inner, rows)).movedim(dim, 0).contiguous()
    got = _exchange(parts, members, size, pg)  # (inner, ..., heads/inner, rows, ...)
    return got.movedim(0, dim - 1).flatten(dim - 1, dim).contiguous()


# ---------------------------------------------------------------- the ring


class _Ring:
    """This rank's place on a ring of cp ranks that hold the same heads: step t brings
    the keys and values of cp rank ``rank - t * inner``."""

    def __init__(self, q: Tensor, size: int, inner: int, group: str) -> None:
        self.pg = resolve_process_group(group)
        self.size, self.inner = size, inner
        self.rank = dist.get_rank(self.pg)
        self.steps = size // inner
        self.seq = q.shape[-2] * self.steps
        self.next = dist.get_global_rank(self.pg, (self.rank + inner) % size)
        self.prev = dist.get_global_rank(self.pg, (self.rank - inner) % size)
        self.rows = self.positions(self.rank, q.device)

    def positions(self, rank: int, device: torch.device) -> Tensor:
        return torch.tensor(ops.cp_held(self.seq, self.size, rank, self.inner), device=device)

    def source(self, step: int) -> int:
        return (self.rank - step * self.inner) % self.size

    def pass_on(self, flat: Tensor, tag: int) -> tuple[Tensor, list]:
        """Send ``flat`` to the next rank and receive the previous rank's (posted, not
        waited for)."""
        got = torch.empty_like(flat)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, flat, self.next, self.pg, tag),
            dist.P2POp(dist.irecv, got, self.prev, self.pg, tag),
        ])
        return got, works


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _pack(*ts: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(flat: Tensor, like: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in like]), like))


class _Block:
    """One block of the attention: this rank's queries against the keys of positions
    ``cols``; the pairs no mask hides, and the rows and columns that have any."""

    def __init__(self, rows: Tensor, cols: Tensor, mask: Tensor | None, causal: bool) -> None:
        seen = rows.unsqueeze(1) >= cols.unsqueeze(0) if causal else None
        self.bias = None
        if mask is not None:
            m = mask.index_select(-2, rows) if mask.shape[-2] != 1 else mask
            m = m.index_select(-1, cols) if mask.shape[-1] != 1 else m
            if m.dtype == torch.bool:
                seen = m if seen is None else seen & m
            else:
                self.bias = _wide(m)
        self.seen, self.ri, self.ci, self.device = seen, None, None, rows.device
        if seen is not None:
            flat = seen.reshape(-1, *seen.shape[-2:]).any(0)
            if flat.shape[-2] == len(rows):
                self.ri = flat.any(-1).nonzero().squeeze(-1)
            if flat.shape[-1] == len(cols):
                self.ci = flat.any(-2).nonzero().squeeze(-1)

    def pieces(self, queries: int, row_bytes: int) -> Iterator[_Block]:
        """This block cut into runs of its picked rows whose scores take at most
        ``PIECE_BYTES`` (``row_bytes``: one query row's scores over the block's keys, every
        batch and head), so the working set does not grow with the block."""
        rows = self.ri if self.ri is not None else torch.arange(queries, device=self.device)
        step = max(1, PIECE_BYTES // max(row_bytes, 1))
        if len(rows) <= step:
            yield self
            return
        for start in range(0, len(rows), step):
            piece = copy.copy(self)
            piece.ri = rows[start:start + step]
            yield piece

    @property
    def empty(self) -> bool:
        return any(i is not None and i.numel() == 0 for i in (self.ri, self.ci))

    def _pick(self, x: Tensor, rows: bool, cols: bool) -> Tensor:
        if rows and self.ri is not None and x.shape[-2] != 1:
            x = x.index_select(-2, self.ri)
        if cols and self.ci is not None and x.shape[-1] != 1:
            x = x.index_select(-1, self.ci)
        return x

    def rows(self, x: Tensor) -> Tensor:
        """``x``'s rows (..., queries, features) this block computes."""
        return x if self.ri is None else x.index_select(-2, self.ri)

    def cols(self, x: Tensor) -> Tensor:
        """``x``'s keys (..., keys, features) this block reads."""
        return x if self.ci is None else x.index_select(-2, self.ci)

    def scores(self, q: Tensor, k: Tensor, scale: float) -> Tensor:
        """Masked fp32 scores of q's picked rows against k's picked keys."""
        s = (q @ k.transpose(-2, -1)) * scale
        if self.bias is not None:
            s = s + self._pick(self.bias, True, True)
        if self.seen is not None:
            s = s.masked_fill(~self._pick(self.seen, True, True), float("-inf"))
        return s

    def add_rows(self, acc: Tensor, part: Tensor) -> None:
        """Add ``part`` (the picked queries) into ``acc`` (..., queries, features)."""
        acc.add_(part) if self.ri is None else acc.index_add_(-2, self.ri, part)

    def add_cols(self, acc: Tensor, part: Tensor) -> None:
        """Add ``part`` (the picked keys) into ``acc`` (..., keys, features)."""
        acc.add_(part) if self.ci is None else acc.index_add_(-2, self.ci, part)

    def set_rows(self, acc: Tensor, part: Tensor) -> None:
        """Write ``part`` (the picked queries) into ``acc`` (..., queries, features)."""
        acc.copy_(part) if self.ri is None else acc.index_copy_(-2, self.ri, part)


def _wide(x: Tensor) -> Tensor:
    """``x`` in the block's dtype: fp32, or float64 for float64 inputs."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _heads(x: Tensor, rep: int) -> Tensor:
    """Key/value heads repeated to the query heads (grouped-query attention)."""
    return _wide(x).repeat_interleave(rep, dim=-3) if rep > 1 else _wide(x)


def _grouped(x: Tensor, rep: int) -> Tensor:
    """A gradient per query head summed to its key/value head."""
    return x.unflatten(-3, (x.shape[-3] // rep, rep)).sum(dim=-3) if rep > 1 else x


def _finite(lse: Tensor) -> Tensor:
    """A query that sees no key: log-sum-exp 0, so its probabilities stay 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


@_kernel("cp_ring_attention")
def _cp_ring_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                       scale: float | None, enable_gqa: bool, size: int, inner: int,
                       group: str) -> tuple[Tensor, Tensor]:
    ring = _Ring(q, size, inner, group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    rep = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    qf = _wide(q)
    out = qf.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = qf.new_full((*q.shape[:-1], 1), float("-inf"))  # a column: rows pick alike
    kv = (k, v)
    for step in range(ring.steps):
        if step + 1 < ring.steps:
            got, works = ring.pass_on(_pack(*kv), KV_TAG)
        block = _Block(ring.rows, ring.positions(ring.source(step), q.device), mask, causal)
        if not block.empty:
            kf, vf = block.cols(_heads(kv[0], rep)), block.cols(_heads(kv[1], rep))
            row = q.shape[:-2].numel() * kf.shape[-2] * qf.element_size()
            for piece in block.pieces(q.shape[-2], row):
                s = piece.scores(piece.rows(qf), kf, scale)
                part_lse = torch.logsumexp(s, dim=-1, keepdim=True)
                part = torch.exp(s - _finite(part_lse)) @ vf
                del s
                old_lse = piece.rows(lse)
                new_lse = torch.logaddexp(old_lse, part_lse)
                piece.set_rows(out, piece.rows(out) * torch.exp(old_lse - _finite(new_lse))
                               + part * torch.exp(part_lse - _finite(new_lse)))
                piece.set_rows(lse, new_lse)
        if step + 1 < ring.steps:
            _wait(works)
            kv = _unpack(got, kv)
    return out.to(q.dtype), lse.squeeze(-1)


@_kernel("cp_ring_attention_backward")
def _cp_ring_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    mask: Tensor | None, causal: bool, scale: float | None, enable_gqa: bool, size: int,
    inner: int, group: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention's backward per block (dS = P * (dP - rowsum(dO * O))), with P from
    the saved log-sum-exp; dK and dV travel the ring with their keys and values."""
    ring = _Ring(q, size, inner, group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    rep = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    qf, g = _wide(q), _wide(grad)
    delta = (g * _wide(out)).sum(dim=-1, keepdim=True)
    lse = _finite(lse).unsqueeze(-1)
    dq = qf.new_zeros(q.shape)  # contiguous, as the fake says
    kv, moving = (k, v), None
    for step in range(ring.steps):
        if step + 1 < ring.steps:
            got, works = ring.pass_on(_pack(*kv), KV_TAG)
        dk, dv = (qf.new_zeros(t.shape) for t in kv)
        block = _Block(ring.rows, ring.positions(ring.source(step), q.device), mask, causal)
        if not block.empty:
            kf, vf = block.cols(_heads(kv[0], rep)), block.cols(_heads(kv[1], rep))
            row = q.shape[:-2].numel() * kf.shape[-2] * qf.element_size()
            for piece in block.pieces(q.shape[-2], row):
                qs, gs = piece.rows(qf), piece.rows(g)
                p = torch.exp(piece.scores(qs, kf, scale) - piece.rows(lse))
                ds = p * (gs @ vf.transpose(-2, -1) - piece.rows(delta)) * scale
                piece.add_rows(dq, ds @ kf)
                piece.add_cols(dk, _grouped(ds.transpose(-2, -1) @ qs, rep))
                piece.add_cols(dv, _grouped(p.transpose(-2, -1) @ gs, rep))
                del p, ds
        if moving is not None:  # the running dK, dV of this step's block, from the previous rank
            _wait(moving[1])
            held = _unpack(moving[0], (dk, dv))
            dk, dv = dk + held[0], dv + held[1]
        if ring.steps > 1:
            moving = ring.pass_on(_pack(dk, dv), GRAD_TAG)
        if step + 1 < ring.steps:
            _wait(works)
            kv = _unpack(got, kv)
    if moving is not None:  # after the last step the running sums come home
        _wait(moving[1])
        dk, dv = _unpack(moving[0], (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
