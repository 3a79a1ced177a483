"""The vocabulary of pipeline schedules: actions, steps and units, and the peers and the
printing of lowered steps (``fxmeg.runtime.pipeline.schedules`` builds schedules, and
``fxmeg.runtime.pipeline.lowering`` adds their communication; both speak this vocabulary).

``2F0`` is the forward of chunk 2 on micro-batch 0, ``2B0`` its whole backward, ``2I0`` /
``2W0`` its input- and weight-gradient halves (zero bubble); ``0SF1+0RB0`` a step of two
point-to-point posts; ``0D1`` a DEALLOC; ``0GS3`` a GRAD_SYNC.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    F = "F"
    B = "B"
    I = "I"  # the paper's name: input gradient
    W = "W"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    DEALLOC = "D"
    GRAD_SYNC = "GS"


COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
BACKWARD = (Kind.B, Kind.I)
"""The kinds that compute a chunk's input gradient (read RECV_B, feed SEND_B)."""
WEIGHT = (Kind.B, Kind.W)
"""The kinds that compute (accumulate) a chunk's weight gradient."""
_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|GS|F|B|I|W|D)(\d+)$")


@dataclass(frozen=True)
class Action:
    chunk: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind.value}{self.mb}"

    @staticmethod
    def parse(text: str) -> Action:
        m = _ACTION.match(text)
        if not m:
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F0' or '0SF1')")
        return Action(int(m[1]), Kind(m[2]), int(m[3]))


Step = tuple[Action, ...]


def fmt(step: Step) -> str:
    return "+".join(map(str, step))


Unit = tuple[Action, ...]
Schedule = dict[int, list[Unit]]
Lowering = Callable[[Schedule], dict[int, list[Step]]]
"""A schedule's lowering for one Program (RankContext.lower)."""


def input_of(a: Action) -> Action | None:
    """The receive whose tensor compute action ``a`` reads, if it reads one."""
    kind = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B, Kind.I: Kind.RECV_B}.get(a.kind)
    return None if kind is None else Action(a.chunk, kind, a.mb)


def peer_chunk(a: Action) -> int:
    """The chunk at the other end of a point-to-point action."""
    return a.chunk + (1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else -1)


def is_send(a: Action) -> bool:
    return a.kind in (Kind.SEND_F, Kind.SEND_B)


def table(lowered: dict[int, list[Step]]) -> str:
    """Rank x step grid, one row per rank."""
    rows = {r: [fmt(s) for s in steps] for r, steps in sorted(lowered.items())}
    width = max((len(c) for cells in rows.values() for c in cells), default=1)
    return "\n".join(
        f"rank {r}: " + " ".join(c.ljust(width) for c in cells).rstrip()
        for r, cells in rows.items()
    )
