"""The executor: one interpreter that runs this rank's lowered schedule.

Every step is handled by one small method per action kind. Live state (received
activations, saved forward outputs, gradients to send) is keyed by (chunk, micro-batch)
and lives only for one ``run``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import fx

from fxmeg.errors import ScheduleError
from fxmeg.program import ChunkSpec
from fxmeg.runtime.schedules import COMPUTE, Action, Kind, Step, fmt, input_of, is_send, peer_chunk
from fxmeg.trace import CATEGORY, Tracer

_run_backward = torch.autograd.Variable._execution_engine.run_backward

Key = tuple[int, int]  # (chunk, micro-batch)


@dataclass
class Counters:
    """What the executor held and freed in the last run (read by tests and benchmarks)."""

    peak_in_flight: int = 0
    """Most micro-batches forwarded but not yet backwarded at once, over all chunks."""
    sent_for_dealloc: int = 0
    """Sent activations marked for deallocation."""
    deallocated: int = 0
    """Of those, the ones whose storage was freed."""


@dataclass
class _State:
    inbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    grad_inbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    outbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    grad_outbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    saved: dict[Key, tuple] = field(default_factory=dict)
    stats: torch.Tensor | None = None
    posted: dict[Action, tuple] = field(default_factory=dict)
    """Point-to-point action -> (work, its tensors, peer rank), until awaited."""


class CommTimeoutError(ScheduleError):
    """A pipeline peer did not answer within comm_timeout_s."""


class Executor:
    """Runs this rank's lowered schedules over the chunks this rank holds."""

    def __init__(
        self,
        chunks: dict[int, fx.GraphModule],
        *,
        specs: dict[int, ChunkSpec],
        rank: int,
        pp: int,
        peer: Callable[[int], int],
        group: dist.ProcessGroup | None,
        device: torch.device,
        placement: Sequence[int] | None = None,
        timeout_s: float = 600.0,
        compile: bool = False,
        on_grad_sync: Callable[[int], None] | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.chunks = chunks
        self._run = {c: torch.compile(gm, dynamic=False) if compile else gm for c, gm in chunks.items()}
        self.specs = specs
        self.rank, self.pp = rank, pp
        rounds = range(max(chunks, default=0) + 2)  # every chunk this rank holds or talks to
        self.placement = tuple(placement) if placement is not None else tuple(c % pp for c in rounds)
        """Each chunk's pipeline rank (``fxmeg.config.placement``; default round robin)."""
        self.rank_stage = self.placement[min(chunks)] if chunks else 0
        self.peer, self.group, self.device = peer, group, device
        self.timeout = timedelta(seconds=timeout_s)
        self.counters = Counters()
        self.tracer = tracer if tracer is not None else Tracer()
        self.on_grad_sync = on_grad_sync
        """Called with the chunk index at GRAD_SYNC (DDP: start reducing buckets)."""
        self._handlers = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.DEALLOC: self._deallocate,
            Kind.GRAD_SYNC: self._grad_sync,
        }

    def run(
        self,
        steps: list[Step],
        microbatches: Sequence[tuple[torch.Tensor, ...]],
        *,
        train: bool,
        loss_scale: float = 1.0,
    ) -> torch.Tensor:
        """Run lowered ``steps``; return float64 ``[sum of loss_sum, sum of num_tokens]``
        over the micro-batches this rank's last chunk saw (zeros elsewhere)."""
        self.steps = steps
        self._mbs, self._train, self._scale = microbatches, train, loss_scale
        self._state = _State(stats=torch.zeros(2, dtype=torch.float64, device=self.device))
        self.counters = Counters()
        tracer = self.tracer
        with torch.set_grad_enabled(train):
            for index, step in enumerate(self.steps):
                a = step[0]
                try:
                    if a.kind in COMPUTE:
                        self._await(input_of(a))
                    start = time.perf_counter_ns() if tracer.on else 0
                    handler = self._handlers.get(a.kind)
                    if handler is None:
                        self._post(step)
                    else:
                        handler(a)
                    if a.kind in COMPUTE:
                        self._hand_off(a)
                except Exception as exc:
                    raise ScheduleError(self._failure(index, exc)) from exc
                if tracer.on:
                    tracer.add(fmt(step), CATEGORY.get(a.kind.value, "p2p"), start, time.perf_counter_ns())
            try:
                for a in list(self._state.posted):  # sends nobody freed (gradients, eval)
                    self._await(a)
            except Exception as exc:
                raise ScheduleError(self._failure(len(self.steps) - 1, exc)) from exc
        state, self._state = self._state, None
        assert not state.saved and not state.inbox, "schedule left work unfinished"
        return state.stats

    # ------------------------------------------------------------ compute

    def _forward(self, a: Action) -> None:
        spec, key = self.specs[a.chunk], (a.chunk, a.mb)
        data = [self._mbs[a.mb][i] for i in spec.data_inputs]
        received = self._state.inbox.pop(key, [])
        if self._train:
            for t, b in zip(received, spec.recv):
                t.requires_grad_(b.grad)
        outs = self._run[a.chunk](*data, *received)
        sends = list(outs[: len(spec.send)])
        loss = None
        if spec.is_last:
            loss, num_tokens = outs[-2:]
            self._state.stats += torch.stack([loss.detach().double(), num_tokens.double()])
        if spec.send:
            self._state.outbox[key] = sends
        if self._train:
            self._state.saved[key] = (received, sends, loss)
            self.counters.peak_in_flight = max(self.counters.peak_in_flight, len(self._state.saved))

    def _backward(self, a: Action) -> None:
        spec, key = self.specs[a.chunk], (a.chunk, a.mb)
        received, sends, loss = self._state.saved.pop(key)
        if spec.is_last:
            roots, grads = [loss], [torch.full_like(loss, self._scale)]
        else:
            roots = [t for t, b in zip(sends, spec.send) if b.grad]
            grads = self._state.grad_inbox.pop(key)
        _run_backward(tuple(roots), tuple(grads), keep_graph=False, create_graph=False,
                      inputs=(), allow_unreachable=True, accumulate_grad=True)
        if a.chunk > 0 and any(b.grad for b in spec.recv):
            self._state.grad_outbox[key] = [
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t, b in zip(received, spec.recv)
                if b.grad
            ]

    def _grad_sync(self, a: Action) -> None:
        if self.on_grad_sync is not None:
            self.on_grad_sync(a.chunk)

    def _deallocate(self, a: Action) -> None:
        """Free sent activations' storage, keep their autograd nodes (Megatron:
        deallocate_output_tensor); backward then runs through them anyway."""
        self._await(Action(a.chunk, Kind.SEND_F, a.mb))  # the send must have read it
        if not self._train:
            return
        _, sends, _ = self._state.saved[(a.chunk, a.mb)]
        for t, free in zip(sends, self.specs[a.chunk].deallocate):
            if not free:
                continue
            self.counters.sent_for_dealloc += 1
            if t._base is None and t.grad_fn is not None and not _saves_its_result(t):
                t.data = torch.empty((1,), dtype=t.dtype, device=t.device)
                self.counters.deallocated += 1

    # ------------------------------------------------------------ communication

    def _post(self, step: Step) -> None:
        """Post every point-to-point op of the group at once; each is awaited where its
        tensor is needed (``_await``)."""
        ops, owners = [], []
        for a in step:
            tensors, peer_chunk, send = self._buffers(a)
            peer = self.peer(self.placement[peer_chunk])
            ops.extend(dist.P2POp(dist.isend if send else dist.irecv, t, peer, self.group) for t in tensors)
            owners.append((a, len(tensors), tensors, peer))
        if not ops:
            return
        if len(ops) == 1:  # a fifth of the host time of a batch of one
            op = ops[0]
            works = [op.op(op.tensor, op.peer, op.group)]
        else:
            works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # coalesced (NCCL): one handle stands for the group
            works = works[:1] * len(ops)
        i = 0
        for a, n, tensors, peer in owners:
            self._state.posted[a] = (works[i : i + n], tensors, peer)
            i += n

    def _await(self, a: Action | None) -> None:
        """Wait, at most the timeout, for posted action ``a`` (no-op when not posted): a
        peer that stops answering fails the step by name."""
        entry = self._state.posted.pop(a, None) if a is not None else None
        if entry is None:
            return
        works, _, peer = entry
        start = time.perf_counter_ns()
        for work in works:
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as exc:
                stage = self.placement[peer_chunk(a)]
                what = "sending to" if is_send(a) else "receiving from"
                raise CommTimeoutError(
                    f"pipeline stage {self.rank_stage} waited {self.timeout.total_seconds():g} s "
                    f"{what} rank {peer} (pipeline stage {stage}) for {a}; that rank stopped "
                    f"answering (crashed, hung, or far slower). Raise comm_timeout_s if it is "
                    f"just slow. ({exc})"
                ) from exc
        self.tracer.add(f"wait {a}", "p2p", start, time.perf_counter_ns())

    def _hand_off(self, a: Action) -> None:
        """Chunks next to each other on this rank (chunks pp-1 and pp of a V placement)
        exchange no message: what ``a`` made for the neighbour goes straight to its inbox,
        detached like a received tensor, so each chunk's backward stops at its inputs."""
        key, s = (a.chunk, a.mb), self._state
        if key in s.outbox and a.chunk + 1 in self.chunks:
            s.inbox[(a.chunk + 1, a.mb)] = [t.detach() for t in s.outbox.pop(key)]
        if key in s.grad_outbox and a.chunk - 1 in self.chunks:
            s.grad_inbox[(a.chunk - 1, a.mb)] = s.grad_outbox.pop(key)

    def _buffers(self, a: Action) -> tuple[list[torch.Tensor], int, bool]:
        key, spec = (a.chunk, a.mb), self.specs[a.chunk]
        s = self._state
        if a.kind is Kind.SEND_F:
            return [t.contiguous() for t in s.outbox.pop(key)], a.chunk + 1, True
        if a.kind is Kind.SEND_B:
            return s.grad_outbox.pop(key), a.chunk - 1, True
        if a.kind is Kind.RECV_F:
            s.inbox[key] = [self._empty(b.shape, b.dtype) for b in spec.recv]
            return s.inbox[key], a.chunk - 1, False
        assert a.kind is Kind.RECV_B
        s.grad_inbox[key] = [self._empty(b.shape, b.dtype) for b in spec.send if b.grad]
        return s.grad_inbox[key], a.chunk + 1, False

    def _empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    # ------------------------------------------------------------ errors

    def _failure(self, index: int, exc: BaseException) -> str:
        cells = [fmt(s) for s in self.steps]
        cells[index] = f">>{cells[index]}<<"
        return (
            f"rank {self.rank}: step {index} ({fmt(self.steps[index])}) failed: "
            f"{type(exc).__name__}: {exc}\nthis rank's schedule, failing step marked:\n"
            + " ".join(cells)
        )


def _saves_its_result(t: torch.Tensor) -> bool:
    """True when t's autograd node saved t itself (e.g. relu, exp): freeing it would
    corrupt backward."""
    kind = type(t.grad_fn)
    if kind not in _SAVES_RESULT:
        _SAVES_RESULT[kind] = any(name.startswith("_saved_result") for name in dir(t.grad_fn))
    return _SAVES_RESULT[kind]


_SAVES_RESULT: dict[type, bool] = {}
