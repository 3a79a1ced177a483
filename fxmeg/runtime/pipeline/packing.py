"""One message per pipeline cut: the tensors crossing a cut in one direction for one
micro-batch travel as one byte buffer.

A cut often carries several tensors (hidden state, attention mask, rotary tables); each
message costs a fixed latency on every backend, so they are copied into one contiguous
``uint8`` buffer, and the receiver reads views into the buffer it received. Shapes and
dtypes are static (the chunk's ``Boundary`` list), so both ends compute the same
``Layout`` without exchanging it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fxmeg.ir.program import Boundary

ALIGN = 16
"""Every piece starts at a multiple of this many bytes: a multiple of every element size
(complex128 included), and of the vector width kernels read the views with."""


@dataclass(frozen=True)
class Piece:
    offset: int
    """Byte offset in the buffer (a multiple of ALIGN)."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """Where each tensor of one message lies in its byte buffer."""

    pieces: tuple[Piece, ...]
    nbytes: int
    """Buffer size: the end of the last piece, rounded up to ALIGN."""

    @staticmethod
    def of(boundaries: Sequence[Boundary]) -> Layout:
        pieces, end = [], 0
        for b in boundaries:
            pieces.append(Piece(end, tuple(b.shape), b.dtype))
            end = _round_up(end + pieces[-1].nbytes)
        return Layout(tuple(pieces), end)

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new buffer holding ``tensors`` (on their device); padding bytes are undefined."""
        assert len(tensors) == len(self.pieces), (len(tensors), self.pieces)
        buf = torch.empty((self.nbytes,), dtype=torch.uint8, device=tensors[0].device)
        for view, t in zip(self.unpack(buf), tensors):
            assert t.shape == view.shape and t.dtype == view.dtype, (t.shape, t.dtype, view.dtype)
            view.copy_(t.detach())
        return buf

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buf`` (sharing its storage), one per piece, in order."""
        assert buf.dtype == torch.uint8 and buf.numel() == self.nbytes, (buf.dtype, self.nbytes)
        return [
            buf[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.pieces
        ]


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
