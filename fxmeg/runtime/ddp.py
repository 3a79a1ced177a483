"""Data parallelism: contiguous gradient buffers and bucketed reduction overlapped with
backward (reference §3.2, §6.1-6.2; Megatron's DistributedDataParallel).

Every trainable parameter's ``main_grad`` is a view into its chunk's buffer. A
post-accumulate-grad hook adds ``param.grad`` into ``main_grad`` and drops
``param.grad``. Nothing is communicated until ``start_sync()`` (the schedule's GRAD_SYNC
action, just before a chunk's last micro-batch backward); from then on a bucket's asynchronous reduction is issued the
moment its last gradient arrives, so it overlaps the rest of backward. Buckets are
issued strictly in index order, so every data-parallel rank issues the same collectives
in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fxmeg.program import Bucket, BufferLayout


@dataclass
class Events:
    """What happened in the current step, in order (for tests and traces):
    ("sync", label) at the chunk's GRAD_SYNC, ("ready", param) when a gradient of the
    last micro-batch arrives, ("issue", "label/bucket") when a reduction is issued."""

    log: list[tuple[str, str]] = field(default_factory=list)
    issued: int = 0
    """Reductions issued this step."""


class GradBuffer:
    """One chunk's contiguous buffer for one gradient dtype, cut into buckets."""

    def __init__(
        self,
        layout: BufferLayout,
        params: dict[str, nn.Parameter],
        *,
        label: str,
        group: dist.ProcessGroup | None,
        overlap: bool,
        reduce_scatter: bool,
        events: Events,
    ) -> None:
        self.layout, self.label, self.group = layout, label, group
        self.overlap, self.reduce_scatter, self.events = overlap, reduce_scatter, events
        device = next(iter(params.values())).device
        self.data = torch.zeros(layout.numel, dtype=layout.dtype, device=device)
        self.params = {s.name: params[s.name] for s in layout.slots}
        for s in layout.slots:
            p = self.params[s.name]
            p.main_grad = self.data[s.offset : s.offset + s.numel].view(p.shape)
        self._bucket_of = {s.name: s.bucket for s in layout.slots}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params.values()
        ]
        self._name_of = {id(p): n for n, p in self.params.items()}
        self.reset()

    def reset(self) -> None:
        """Zero the buffer in place (never freed, reference §8) and forget the step."""
        self.data.zero_()
        self.syncing = False
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._next = 0  # the next bucket to issue
        self._works: list[dist.Work] = []

    def start_sync(self) -> None:
        """From now on (the last micro-batch), reduce each bucket once complete."""
        self.syncing = True

    def _accumulate(self, p: nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None
        if not self.syncing:
            return
        name = self._name_of[id(p)]
        self.events.log.append(("ready", name))
        self._pending[self._bucket_of[name]] -= 1
        if self.overlap:
            self._issue_ready()

    def _issue_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next < len(buckets) and self._pending[self._next] == 0:
            self._issue(buckets[self._next])
            self._next += 1

    def _issue(self, bucket: Bucket) -> None:
        self.events.log.append(("issue", f"{self.label}/{bucket.index}"))
        self.events.issued += 1
        if self.group is None:
            return
        flat = self.data[bucket.start : bucket.end]
        if self.reduce_scatter:
            shard = flat.numel() // dist.get_world_size(self.group)
            mine = flat[dist.get_rank(self.group) * shard :][:shard]
            work = dist.reduce_scatter_tensor(mine, flat, group=self.group, async_op=True)
        else:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._works.append(work)

    def finish(self) -> None:
        """Issue what is left (no overlap, or a parameter without a gradient in the last
        micro-batch) and wait for every reduction of this step."""
        while self._next < len(self.layout.buckets):
            self._issue(self.layout.buckets[self._next])
            self._next += 1
        for work in self._works:
            work.wait()
        self._works = []


class DataParallel:
    """All gradient buffers of this rank's chunks."""

    def __init__(self, buffers: dict[int, list[GradBuffer]], events: Events) -> None:
        self.buffers, self.events = buffers, events

    def zero_grad_buffer(self) -> None:
        self.events.log.clear()
        self.events.issued = 0
        for bufs in self.buffers.values():
            for b in bufs:
                b.reset()

    def start_sync(self, chunk: int) -> None:
        """GRAD_SYNC: the chunk's last micro-batch is next; reduce buckets as they fill."""
        self.events.log.append(("sync", f"chunk{chunk}"))
        for b in self.buffers.get(chunk, ()):
            b.start_sync()

    def finish_grad_sync(self) -> None:
        for bufs in self.buffers.values():
            for b in bufs:
                b.finish()

    def all(self) -> list[GradBuffer]:
        return [b for bufs in self.buffers.values() for b in bufs]


def finalize_model_grads(
    ddp: DataParallel,
    tied: list[tuple[nn.Parameter, dist.ProcessGroup | None]],
    num_tokens: float,
) -> None:
    """Megatron's finalize_model_grads (reference §6.3): wait for every bucket reduction,
    all-reduce gradients of parameters held on several pipeline ranks (a tied embedding
    on the first and last stage; ``tied`` is in the same order on every rank), then
    scale every gradient by 1 / global tokens (per-token loss, §5.2)."""
    ddp.finish_grad_sync()
    for p, group in tied:
        if group is not None:
            dist.all_reduce(p.main_grad, group=group)
    scale = 1.0 / max(num_tokens, 1.0)
    for buf in ddp.all():
        buf.data.mul_(scale)
