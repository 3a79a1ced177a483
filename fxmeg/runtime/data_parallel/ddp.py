"""Data parallelism: contiguous gradient buffers and bucketed reduction overlapped with
backward (docs/architecture.md §5.2; docs/megatron-semantics.md §2.3.2, §2.6.1-2.6.2;
Megatron's DistributedDataParallel).

Every trainable parameter's ``main_grad`` is a view into its chunk's buffer. A
post-accumulate-grad hook adds ``param.grad`` into ``main_grad`` and drops
``param.grad``. Nothing is communicated until ``start_sync()`` (the schedule's GRAD_SYNC
action, just before a chunk's last micro-batch backward); from then on a bucket's asynchronous
reduction is issued the moment its last gradient arrives, so it overlaps the rest of backward.
Buckets are issued strictly in index order, so every data-parallel rank issues the same collectives
in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fxmeg.ir.program import Bucket, BufferLayout
from fxmeg.runtime.groups import WeakGroup, all_gather_, group_named, reduce_scatter_


@dataclass
class Events:
    """What happened in the current step, in order (for tests and traces):
    ("sync", label) at the chunk's GRAD_SYNC, ("ready", param) when a gradient of the
    last micro-batch arrives, ("issue", "label/bucket") when a reduction is issued,
    ("gather", "label/bucket") / ("gathered", ...) when a parameter all-gather is issued /
    waited for (distributed optimizer)."""

    log: list[tuple[str, str]] = field(default_factory=list)
    issued: int = 0
    """Reductions issued this step."""


class GradBuffer:
    """One chunk's contiguous buffer for one gradient dtype, cut into buckets.

    With the distributed optimizer (``shard=True``) buckets are reduce-scattered, and the
    parameters themselves move into ``param_data``, a buffer with the same layout, so the
    updated shards can be all-gathered back one bucket at a time. Buckets holding a
    parameter in ``deferred`` (a weight tied across pipeline ranks) are reduced only in
    ``finish_deferred``: its pipeline all-reduce must precede the reduce-scatter, since
    after it each rank holds only its own shard, and shards of different pipeline ranks'
    layouts do not line up.
    """

    group = WeakGroup()  # never holds the group alive (fxmeg/runtime/groups.py)

    def __init__(
        self,
        layout: BufferLayout,
        params: dict[str, nn.Parameter],
        *,
        label: str,
        group: dist.ProcessGroup | None,
        overlap: bool,
        shard: bool,
        events: Events,
        deferred: frozenset[str] = frozenset(),
        tracer=None,
    ) -> None:
        self.layout, self.label, self.group = layout, label, group
        self.overlap, self.shard, self.events = overlap, shard, events
        self.tracer = tracer
        device = next(iter(params.values())).device
        self.data = torch.zeros(layout.numel, dtype=layout.dtype, device=device)
        self.params = {s.name: params[s.name] for s in layout.slots}
        for s in layout.slots:
            p = self.params[s.name]
            p.main_grad = self.data[s.offset : s.offset + s.numel].view(p.shape)
        self.param_data = self._move_params_into_buffer() if shard else None
        self._deferred = (
            {b.index for b in layout.buckets if deferred & set(b.params)} if shard else set()
        )
        self._bucket_of = {s.name: s.bucket for s in layout.slots}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params.values()
        ]
        self._name_of = {id(p): n for n, p in self.params.items()}
        self.pending: dict[int, _PendingGather] = {}
        """Bucket index -> its parameter all-gather in flight (overlap_param_gather)."""
        self.reset()

    def _move_params_into_buffer(self) -> torch.Tensor:
        """Parameters become views of one contiguous buffer laid out like the gradients
        (Megatron's param buffer): the user's Parameter objects stay, their storage moves."""
        dtypes = {p.dtype for p in self.params.values()}
        assert len(dtypes) == 1, (
            f"{self.label}: parameters of several dtypes {dtypes} in one buffer"
        )
        first = next(iter(self.params.values()))
        data = torch.zeros(self.layout.numel, dtype=first.dtype, device=first.device)
        for s in self.layout.slots:
            p = self.params[s.name]
            view = data[s.offset : s.offset + s.numel].view(p.shape)
            view.copy_(p.detach())
            p.data = view
        return data

    def reset(self) -> None:
        """Zero the buffer in place (never freed, docs/megatron-semantics.md §2.8) and forget
        the step."""
        self.data.zero_()
        self.syncing = False
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._next = 0  # the next bucket to issue
        self._works: list[dist.Work] = []

    def start_sync(self) -> None:
        """From now on (the last micro-batch), reduce each bucket once complete."""
        self.syncing = True

    def _accumulate(self, p: nn.Parameter) -> None:
        """Autograd's post-accumulate-grad hook."""
        self.accumulate(p, p.grad)
        p.grad = None

    def accumulate(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` into ``p.main_grad`` and count it toward its bucket (the autograd
        hook, or a weight-gradient graph's output under a zero-bubble schedule)."""
        p.main_grad.add_(grad)
        if not self.syncing:
            return
        name = self._name_of[id(p)]
        self.events.log.append(("ready", name))
        self._pending[self._bucket_of[name]] -= 1
        if self.overlap:
            self._issue_ready()

    def _issue_ready(self, *, all_left: bool = False) -> None:
        """Issue complete buckets in index order (all of them with ``all_left``), skipping
        deferred ones; the order is the same on every data-parallel rank."""
        buckets = self.layout.buckets
        while self._next < len(buckets) and (all_left or self._pending[self._next] == 0):
            if self._next not in self._deferred:
                self._issue(buckets[self._next])
            self._next += 1

    def _issue(self, bucket: Bucket) -> None:
        self.events.log.append(("issue", f"{self.label}/{bucket.index}"))
        if self.tracer is not None and self.tracer.on:
            now = time.perf_counter_ns()
            self.tracer.add(f"reduce {self.label}/{bucket.index}", "dp_issue", now, now)
        self.events.issued += 1
        flat = self.data[bucket.start : bucket.end]
        if self.shard:
            work = reduce_scatter_(flat, self.group)
        elif self.group is not None:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        else:
            work = None
        if work is not None:
            self._works.append(work)

    def finish(self) -> None:
        """Issue what is left (no overlap, or a parameter without a gradient in the last
        micro-batch), except deferred buckets, and wait for every reduction issued."""
        self._issue_ready(all_left=True)
        self._wait()

    def finish_deferred(self) -> None:
        """Reduce the deferred buckets (after the tied weights' pipeline all-reduce)."""
        for index in sorted(self._deferred):
            self._issue(self.layout.buckets[index])
        self._wait()

    def _wait(self) -> None:
        if not self._works:
            return
        start = time.perf_counter_ns()
        for work in self._works:
            work.wait()
        self._works = []
        if self.tracer is not None:
            self.tracer.add(
                f"wait reductions {self.label}", "dp_wait", start, time.perf_counter_ns()
            )

    def gather_params(self, *, overlap: bool) -> None:
        """All-gather every bucket's updated parameter shards (distributed optimizer).
        With ``overlap`` each bucket's gather stays pending until the next forward's
        ``wait_param_gather`` marker (or ``wait_for_params``) waits for it."""
        assert self.param_data is not None
        for b in self.layout.buckets:
            label = f"{self.label}/{b.index}"
            self.events.log.append(("gather", label))
            pending = _PendingGather(
                all_gather_(self.param_data[b.start : b.end], self.group), label, self.events
            )
            if overlap:
                self.pending[b.index] = pending
            else:
                pending.wait()

    def wait_for_params(self) -> None:
        """Wait for every pending parameter gather (before anything but forward reads them)."""
        while self.pending:
            self.pending.popitem()[1].wait()

    # What readers of gradients and parameters use, whatever the ZeRO stage (zero=2 and 3
    # override them: fxmeg/runtime/data_parallel/zero.py).

    def grad_piece(self, a: int, b: int) -> torch.Tensor:
        """The reduced gradient of buffer elements [a, b), inside this rank's shard of one bucket.
        """
        return self.data[a:b]

    def param_piece(self, a: int, b: int) -> torch.Tensor:
        """The parameter storage of buffer elements [a, b) (distributed optimizer)."""
        return self.param_data[a:b]

    def reduced(self) -> torch.Tensor:
        """Every reduced gradient this rank keeps (compared whole by check_determinism)."""
        return self.data

    def local_grads(self) -> torch.Tensor:
        """A flat tensor laid out like the buffer whose shard of each bucket on this rank
        holds the reduced gradients (all of it without sharding); may be ``data`` itself."""
        return self.data

    def grad_of(self, name: str) -> torch.Tensor:
        """What finalize all-reduces over the tied or tensor-parallel group for ``name``:
        its whole gradient, or the part that this rank keeps."""
        return self.params[name].main_grad

    def scale_(self, factor: float) -> None:
        self.data.mul_(factor)

    def end_backward(self) -> None:
        """After a backward (or weight-gradient) action of this buffer's chunk."""


class _PendingGather:
    """A bucket's all-gather in flight; waiting twice is harmless."""

    def __init__(self, work: dist.Work | None, label: str, events: Events) -> None:
        self.work, self.label, self.events = work, label, events
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        self.done = True
        self.events.log.append(("gathered", self.label))


class DataParallel:
    """All gradient buffers of this rank's chunks."""

    def __init__(self, buffers: dict[int, list[GradBuffer]], events: Events) -> None:
        self.buffers, self.events = buffers, events
        self._home = {id(p): (b, n) for b in self.all() for n, p in b.params.items()}

    def accumulate(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add a gradient computed outside autograd (a W action) to ``param``'s buffer."""
        self._home[id(param)][0].accumulate(param, grad)

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
        for b in self.all():
            b.finish()

    def finish_deferred(self) -> None:
        for b in self.all():
            b.finish_deferred()

    def wait_for_params(self) -> None:
        for b in self.all():
            b.wait_for_params()

    def wait_param_gather(self, param: torch.Tensor, *, bucket: tuple) -> None:
        """What a bound ``ops.wait_param_gather`` marker calls: wait for the all-gather of
        ``bucket`` (``BucketSlot.gather_key``) if it is still pending."""
        pending = buffer_of(self.buffers, bucket).pending.pop(bucket[1], None)
        if pending is not None:
            pending.wait()

    def all(self) -> list[GradBuffer]:
        return [b for bufs in self.buffers.values() for b in bufs]

    def grad_of(self, param: nn.Parameter) -> torch.Tensor:
        buf, name = self._home[id(param)]
        return buf.grad_of(name)

    def early_linear(self, x: torch.Tensor, weight: nn.Parameter, *, name: str) -> torch.Tensor:
        """What a bound ``ops.early_linear`` calls (zero >= 2): ``linear(x, weight)``, whose
        backward hands the weight's gradient to its buffer's ``reduce_read``."""
        return _EarlyLinear.apply(x, weight, self._home[id(weight)][0], name)

    def end_backward(self, chunk: int) -> None:
        """A backward or weight-gradient action of ``chunk`` is done (zero >= 2 reduces then)."""
        for b in self.buffers.get(chunk, ()):
            b.end_backward()


def buffer_of(buffers: dict[int, list[GradBuffer]], bucket: tuple) -> GradBuffer:
    """Of the chunks' ``buffers``, the one that holds ``bucket`` (``BucketSlot.gather_key``:
    (chunk, index), or (chunk, index, 'experts') in the chunk's buffer of expert banks)."""
    experts = len(bucket) > 2
    return next(b for b in buffers[bucket[0]] if b.layout.experts == experts)


class _EarlyLinear(torch.autograd.Function):
    """``linear(x, weight)`` whose backward makes the input's gradient with the weight
    whole, lets its buffer free the weight, then makes the weight's gradient and hands it
    to the buffer (``reduce_read``); none goes on to the parameter (its other reads' do).
    So the weight and its gradient are never whole at once (a tied embedding: the
    largest parameter), and the gradient lives only until its reduction."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, buffer: GradBuffer, name: str
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight, ctx.buffer, ctx.name = weight, buffer, name  # not saved: whole again on demand
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        with ctx.buffer.whole(ctx.name):
            grad_x = grad @ ctx.weight if ctx.needs_input_grad[0] else None
        ctx.buffer.reduce_read(ctx.name, grad.flatten(0, -2).t() @ x.flatten(0, -2))
        return grad_x, None, None, None


def finalize_model_grads(
    ddp: DataParallel,
    tied: list[tuple[nn.Parameter, str | None]],
    divisor: float,
) -> None:
    """Megatron's finalize_model_grads (docs/megatron-semantics.md §2.6.3): wait for every
    bucket reduction, all-reduce gradients of parameters held on several pipeline ranks (a tied
    embedding on the first and last stage; ``tied`` is in the same order on every rank, each group
    by name; with the
    distributed optimizer this precedes their buckets' reduce-scatter), then scale every
    gradient by ``1 / divisor``: global tokens (per-token loss, §2.5.2 there), times the fp16
    loss scale (unscaling, §2.7)."""
    ddp.finish_grad_sync()
    for p, group in tied:
        grad = ddp.grad_of(p)
        if group is not None and grad.numel():
            dist.all_reduce(grad, group=group_named(group))
    ddp.finish_deferred()
    for buf in ddp.all():
        buf.scale_(1.0 / divisor)
