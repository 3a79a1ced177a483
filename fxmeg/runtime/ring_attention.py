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

Attention inside a block: on a CPU, a block with no mask or the causal triangle runs the
CPU's fused kernel (``FUSED``: it returns the log-sum-exp); any other block, and every block on
another device, is fp32 math (scores, then probabilities) in pieces of ``PIECE_BYTES``: exact
everywhere, not the fused kernel a GPU would use (docs/long-context.md, blind spots).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from fxmeg.ir import ops
from fxmeg.runtime import lanes

FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
"""The CPU's fused attention, which returns its log-sum-exp: a block with no mask or the
causal triangle runs it (``_fused``); any other block, and every block on another device,
runs fp32 math in pieces."""
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
    pg = lanes.group(group)
    dim %= x.dim()
    heads, rows = x.shape[dim - 1], x.shape[dim]
    perm, members = _order(rows * size, size, dist.get_rank(pg), inner)
    parts = x.unflatten(dim - 1, (inner, heads // inner)).movedim(dim - 1, 0).contiguous()
    got = _exchange(parts, members, size, pg)  # (inner, ..., heads/inner, rows, ...)
    merged = got.movedim(0, dim).flatten(dim, dim + 1)  # member-major rows
    return merged.index_select(dim, perm.to(x.device)).contiguous()


@_kernel("cp_from_heads")
def _cp_from_heads(x: Tensor, dim: int, size: int, inner: int, group: str) -> Tensor:
    pg = lanes.group(group)
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
        self.pg = lanes.group(group)
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
    """One block of the attention: this rank's queries (global positions ``rows``) against
    the keys of positions ``cols``; the rows and columns some pair sees (``ri``, ``ci``:
    None for all), and what hides the others. Under the causal mask alone that is read from
    the positions (no rows x cols table is made); a boolean mask is combined into one."""

    def __init__(self, rows: Tensor, cols: Tensor, mask: Tensor | None, causal: bool) -> None:
        self.device, self.bias, self.ri, self.ci = rows.device, None, None, None
        self.positions = (rows, cols) if causal else None
        self.seen = None  # a boolean mask's pairs (with the causal ones), picked as needed
        if mask is not None:
            m = mask.index_select(-2, rows) if mask.shape[-2] != 1 else mask
            m = m.index_select(-1, cols) if mask.shape[-1] != 1 else m
            if m.dtype == torch.bool:
                self.seen = (rows.unsqueeze(1) >= cols.unsqueeze(0)) & m if causal else m
            else:
                self.bias = _wide(m)
        if self.seen is not None:
            flat = self.seen.reshape(-1, *self.seen.shape[-2:]).any(0)
            if flat.shape[-2] == len(rows):
                self.ri = flat.any(-1).nonzero().squeeze(-1)
            if flat.shape[-1] == len(cols):
                self.ci = flat.any(-2).nonzero().squeeze(-1)
        elif causal:  # a query sees a key iff its position is not before the key's
            self.ri = (rows >= cols.min()).nonzero().squeeze(-1)
            self.ci = (cols <= rows.max()).nonzero().squeeze(-1)
        self.shape = self._shape()

    def _shape(self) -> str | None:
        """'full' when every picked query sees every picked key, 'causal' when the picked
        pairs are exactly the lower triangle (a rank's own block), else None (a mask the
        block applies itself)."""
        if self.bias is not None or self.empty:
            return None
        if self.seen is not None:
            picked = self._pick(self.seen)
            r, c = picked.shape[-2:]
            tri = torch.ones(r, c, dtype=torch.bool, device=self.device).tril()
            return ("full" if bool(picked.all()) else
                    "causal" if r == c and bool((picked == tri).all()) else None)
        if self.positions is None:
            return "full"
        rows, cols = self.picked_positions()
        if bool(rows.min() >= cols.max()):
            return "full"
        return "causal" if torch.equal(rows, cols) else None

    def picked_positions(self) -> tuple[Tensor, Tensor]:
        rows, cols = self.positions
        return (rows if self.ri is None else rows[self.ri],
                cols if self.ci is None else cols[self.ci])

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

    def _pick(self, x: Tensor) -> Tensor:
        """``x``'s picked rows and columns (a dim of 1 broadcasts: kept)."""
        if self.ri is not None and x.shape[-2] != 1:
            x = x.index_select(-2, self.ri)
        if self.ci is not None and x.shape[-1] != 1:
            x = x.index_select(-1, self.ci)
        return x

    def rows(self, x: Tensor) -> Tensor:
        """``x``'s rows (..., queries, features) this block computes."""
        return x if self.ri is None else x.index_select(-2, self.ri)

    def cols(self, x: Tensor) -> Tensor:
        """``x``'s keys (..., keys, features) this block reads."""
        return x if self.ci is None else x.index_select(-2, self.ci)

    def scores(self, q: Tensor, k: Tensor, scale: float) -> Tensor:
        """Masked scores of q's picked rows against k's picked keys (q's and k's dtype)."""
        s = (q @ k.transpose(-2, -1)) * scale
        if self.bias is not None:
            s = s + self._pick(self.bias)
        if self.seen is not None:
            s = s.masked_fill(~self._pick(self.seen), float("-inf"))
        elif self.positions is not None:
            rows, cols = self.picked_positions()
            s = s.masked_fill(rows.unsqueeze(1) < cols.unsqueeze(0), float("-inf"))
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
    """Key/value heads repeated to the query heads (grouped-query attention), widened."""
    return _wide(_repeat(x, rep))


def _grouped(x: Tensor, rep: int) -> Tensor:
    """A gradient per query head summed to its key/value head."""
    return x.unflatten(-3, (x.shape[-3] // rep, rep)).sum(dim=-3) if rep > 1 else x


def _repeat(x: Tensor, rep: int) -> Tensor:
    """Key/value heads repeated to the query heads, in their own dtype (the fused kernel's)."""
    return x.repeat_interleave(rep, dim=-3) if rep > 1 else x


def _fused(q: Tensor, v: Tensor, block: _Block) -> bool:
    """Whether the CPU's fused attention kernel runs ``block``: on a CPU, values as wide as
    queries, and no mask but none or the causal triangle."""
    return q.device.type == "cpu" and v.shape[-1] == q.shape[-1] and block.shape is not None


def _merge(block: _Block, out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Fold a block's output and log-sum-exp (its picked rows) into the running ones."""
    old_lse = block.rows(lse)
    new_lse = torch.logaddexp(old_lse, part_lse)
    block.set_rows(out, block.rows(out) * torch.exp(old_lse - _finite(new_lse))
                   + part * torch.exp(part_lse - _finite(new_lse)))
    block.set_rows(lse, new_lse)


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
    lse = qf.new_full((*q.shape[:-1], 1), float("-inf"))  # (..., queries, 1), picked as out
    kv = (k, v)
    for step in range(ring.steps):
        if step + 1 < ring.steps:
            got, works = ring.pass_on(_pack(*kv), KV_TAG)
        block = _Block(ring.rows, ring.positions(ring.source(step), q.device), mask, causal)
        if _fused(q, v, block):
            o, part_lse = FUSED(block.rows(q), block.cols(_repeat(kv[0], rep)),
                                block.cols(_repeat(kv[1], rep)), 0.0, block.shape == "causal",
                                scale=scale)
            _merge(block, out, lse, _wide(o), part_lse.unsqueeze(-1))
        elif not block.empty:
            kf, vf = block.cols(_heads(kv[0], rep)), block.cols(_heads(kv[1], rep))
            row = q.shape[:-2].numel() * kf.shape[-2] * qf.element_size()
            for piece in block.pieces(q.shape[-2], row):
                s = piece.scores(piece.rows(qf), kf, scale)
                part_lse = torch.logsumexp(s, dim=-1, keepdim=True)
                part = torch.exp(s - _finite(part_lse)) @ vf
                del s
                _merge(piece, out, lse, part, part_lse)
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
    whole_lse, lse = lse, _finite(lse).unsqueeze(-1)
    dq = qf.new_zeros(q.shape)  # contiguous, as the fake says
    kv, moving = (k, v), None
    for step in range(ring.steps):
        if step + 1 < ring.steps:
            got, works = ring.pass_on(_pack(*kv), KV_TAG)
        dk, dv = (qf.new_zeros(t.shape) for t in kv)
        block = _Block(ring.rows, ring.positions(ring.source(step), q.device), mask, causal)
        if _fused(q, v, block):  # the block's share of the gradients, from the whole lse
            parts = FUSED_BACKWARD(
                block.rows(grad).contiguous(), block.rows(q), block.cols(_repeat(kv[0], rep)),
                block.cols(_repeat(kv[1], rep)), block.rows(out).contiguous(),
                block.rows(whole_lse.unsqueeze(-1)).squeeze(-1).contiguous(), 0.0,
                block.shape == "causal", scale=scale)
            block.add_rows(dq, _wide(parts[0]))
            block.add_cols(dk, _grouped(_wide(parts[1]), rep))
            block.add_cols(dv, _grouped(_wide(parts[2]), rep))
        elif not block.empty:
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
