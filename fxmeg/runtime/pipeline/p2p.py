"""Point-to-point messages between pipeline stages: what the executor's SEND/RECV actions
put on the wire, posted together per schedule step and awaited where a compute reads them
(or at the end of the run), with a timeout that names the silent peer.

The tensors crossing a cut (one direction, one micro-batch) go as one packed message
(runtime/pipeline/packing.py) unless ``pack`` is off; the message layout is the same at both ends
of the cut, derived from the chunk's ChunkSpec.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fxmeg.errors import CommTimeoutError
from fxmeg.ir.program import Boundary, ChunkSpec
from fxmeg.runtime.groups import WeakGroup
from fxmeg.runtime.pipeline.packing import Layout
from fxmeg.runtime.pipeline.schedules import Action, Kind, Step, is_send, peer_chunk, round_robin
from fxmeg.runtime.timelines import Tracer

Key = tuple[int, int]  # (chunk, micro-batch)


@dataclass
class Mailboxes:
    """The tensors a run's compute and messages hand each other, by (chunk, micro-batch)."""

    inbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    grad_inbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    outbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    grad_outbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    posted: dict[Action, tuple] = field(default_factory=dict)
    """Point-to-point action -> (its works, its tensors), until awaited."""


class PointToPoint:
    """This rank's pipeline messages (the executor's SEND_F / RECV_F / SEND_B / RECV_B)."""

    group = WeakGroup()  # never holds the group alive (fxmeg/runtime/groups.py)

    def __init__(
        self,
        specs: dict[int, ChunkSpec],
        *,
        pp: int,
        peer: Callable[[int], int],
        group: dist.ProcessGroup | None,
        device: torch.device,
        placement: Sequence[int] | None = None,
        timeout_s: float = 600.0,
        pack: bool = True,
    ) -> None:
        self.specs, self.peer, self.group, self.device = specs, peer, group, device
        talks_to = max(specs, default=0) + 2  # every chunk this rank holds or talks to
        self.placement = tuple(placement) if placement is not None else round_robin(pp, talks_to)
        """Each chunk's pipeline rank (``fxmeg.config.placement``; default round robin)."""
        self.stage = self.placement[min(specs)] if specs else 0
        self.timeout = timedelta(seconds=timeout_s)
        self.pack = pack
        """Send the tensors crossing a cut (one direction, one micro-batch) as one packed
        message (runtime/pipeline/packing.py); False: one message per tensor (tests, benchmarks)."""
        self._layouts: dict[tuple[int, Kind], Layout] = {}
        self._peers: dict[tuple[int, Kind], int] = {}
        self._coalesce: bool | None = None
        """Post a group of several point-to-point ops as one coalesced batch (NCCL must:
        a send and a receive posted apart can wait on each other); gloo takes each op as it
        comes. Known at the first post."""

    def post(self, step: Step, mail: Mailboxes) -> None:
        """Post every point-to-point op of the group at once; each is awaited where its
        tensor is needed (``wait``)."""
        ops, owners = [], []
        for a in step:
            tensors, peer, send = self._buffers(a, mail)
            ops.extend((send, t, peer) for t in tensors)
            owners.append((a, len(tensors), tensors))
        if not ops:
            return
        if self._coalesce is None:
            self._coalesce = dist.get_backend(self._wire_group()) != "gloo"
        if len(ops) == 1 or not self._coalesce:  # a fifth of the host time of a batch of one
            works = [self._post_one(*op) for op in ops]
        else:  # NCCL: one coalesced group, one handle standing for all of it
            group = self._wire_group()
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend if send else dist.irecv, t, group=group, group_peer=peer)
                for send, t, peer in ops
            ])
            if len(works) != len(ops):
                works = works[:1] * len(ops)
        i = 0
        for a, n, tensors in owners:
            mail.posted[a] = (works[i : i + n], tensors)
            i += n

    def wait(self, a: Action | None, mail: Mailboxes, tracer: Tracer) -> None:
        """Wait, at most the timeout, for posted action ``a`` (no-op when not posted): a
        peer that stops answering fails the step by name."""
        entry = mail.posted.pop(a, None) if a is not None else None
        if entry is None:
            return
        works, _ = entry
        start = time.perf_counter_ns()
        for work in works:
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as exc:
                stage = self.placement[peer_chunk(a)]
                what = "sending to" if is_send(a) else "receiving from"
                raise CommTimeoutError(
                    f"pipeline stage {self.stage} waited {self.timeout.total_seconds():g} s {what} "
                    f"rank {self.peer(stage)} (pipeline stage {stage}) for {a}; that rank stopped "
                    "answering (crashed, hung, or far slower). Raise comm_timeout_s if it is just "
                    f"slow. ({exc})"
                ) from exc
        if tracer.on:
            tracer.add(f"wait {a}", "p2p", start, time.perf_counter_ns())

    def _post_one(self, send: bool, tensor: torch.Tensor, peer: int) -> dist.Work:
        """One send or receive, straight on the process group: ``dist.isend`` / ``irecv``
        check and resolve their arguments on every call; here that was done at bind time
        (``_peer_of``)."""
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        group = self._wire_group()
        return group.send([tensor], peer, 0) if send else group.recv([tensor], peer, 0)

    def _wire_group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def _buffers(self, a: Action, mail: Mailboxes) -> tuple[list[torch.Tensor], int, bool]:
        """What action ``a`` puts on the wire, its peer (rank in the pipeline group), and
        whether it sends. A receive leaves the tensors the compute reads in the inbox:
        views into the buffer it posts when the cut is packed."""
        key, layout, peer = (a.chunk, a.mb), self._layout(a), self._peer_of(a)
        if a.kind is Kind.SEND_F:
            return self._wire(layout, mail.outbox.pop(key)), peer, True
        if a.kind is Kind.SEND_B:
            return self._wire(layout, mail.grad_outbox.pop(key)), peer, True
        if self._packs(layout):
            wire = [self._empty((layout.nbytes,), torch.uint8)]
            tensors = layout.unpack(wire[0])
        else:
            wire = tensors = [self._empty(p.shape, p.dtype) for p in layout.pieces]
        (mail.inbox if a.kind is Kind.RECV_F else mail.grad_inbox)[key] = tensors
        return wire, peer, False

    def _peer_of(self, a: Action) -> int:
        """The rank, in the pipeline group, at the other end of point-to-point action
        ``a`` (resolved once per chunk and kind)."""
        key = (a.chunk, a.kind)
        if key not in self._peers:
            rank = self.peer(self.placement[peer_chunk(a)])
            self._peers[key] = rank if self.group is None else dist.get_group_rank(self.group, rank)
        return self._peers[key]

    def _wire(self, layout: Layout, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers that carry ``tensors``: one packed copy, or the tensors themselves.
        The packed copy lives until the send is awaited; the executor's DEALLOC still frees
        the originals."""
        return [layout.pack(tensors)] if self._packs(layout) else [t.contiguous() for t in tensors]

    def _packs(self, layout: Layout) -> bool:
        # one tensor goes as it is: packing it would only add a copy
        return self.pack and len(layout.pieces) > 1

    def _layout(self, a: Action) -> Layout:
        """The message layout of a point-to-point action, the same at both ends of the cut."""
        key = (a.chunk, a.kind)
        if key not in self._layouts:
            self._layouts[key] = Layout.of(_crossing(self.specs[a.chunk], a.kind))
        return self._layouts[key]

    def _empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)


def _crossing(spec: ChunkSpec, kind: Kind) -> tuple[Boundary, ...]:
    """The tensors a point-to-point action of ``spec``'s chunk carries, in order."""
    if kind in (Kind.SEND_F, Kind.RECV_B):
        return tuple(b for b in spec.send if kind is Kind.SEND_F or b.grad)
    return tuple(b for b in spec.recv if kind is Kind.RECV_F or b.grad)
