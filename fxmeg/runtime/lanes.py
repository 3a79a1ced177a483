"""A rank's second lane: DualPipe's overlapped forward and backward
(``MoEConfig.overlap_moe_expert_parallel_comm``; Megatron's flag of that name).

In a unit that pairs one chunk's forward with another chunk's backward (DualPipeV's steady
state), the executor runs the backward here, in a thread of its own, while its own thread
runs the forward. Each lane's expert all-to-alls then wait while the other lane computes:
the counts all-to-all that dropless dispatch reads on the host (``.tolist()``) blocks only
its own lane.

Collectives of the two lanes must not meet on one process group (each rank would issue
them in an order of its threads' timing): a collective called from this lane resolves its
group name to a *twin*, a second process group over the same ranks (``group``). The
groups the chunk graphs name get twins: tp, cp and ep. The data-parallel reductions the
backward starts stay on their own groups: the forward lane issues none. The experts'
all-to-alls of backward run inside autograd, which on an accelerator calls them from a
thread of its own: those go over the ep twin wherever they run (every backward's, paired
or not, so that each group still sees one order: ``AllToAllExchange.twin``).

On an accelerator the lane computes on a stream of its own, which first waits for the
forward lane's stream; the forward lane's stream waits for it at the join. A tensor the
lane reads that was made on the other stream is recorded on the lane's stream before the
lane frees it, and one it hands back is recorded on the other's (``record``). On the CPU
there are no streams: two threads, one core each per rank here, and measured no faster
(docs/performance.md, "Hiding the all-to-all").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fxmeg.torch_private import resolve_process_group

_here = threading.local()
"""``twins`` in a second lane's thread: its groups' registered names -> their twins'."""


def group(name: str):
    """The process group registered as ``name``, or in a second lane its twin."""
    twins = getattr(_here, "twins", None)
    return resolve_process_group(twins.get(name, name) if twins else name)


def in_second_lane() -> bool:
    """Whether the calling thread is a second lane."""
    return getattr(_here, "twins", None) is not None


class Lane:
    """One worker thread whose collectives go over twin groups (``twins``: a group's
    registered name -> its twin's) and, on an accelerator, one stream."""

    def __init__(self, twins: Mapping[str, str], device: torch.device) -> None:
        self.device = device
        self._module = None if device.type == "cpu" else torch.get_device_module(device)
        self._stream = self._module.Stream(device=device) if self._module is not None else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fxmeg-lane",
                                        initializer=_enter, initargs=(dict(twins),))

    def start(self, work: Callable[[], None]) -> Future:
        """Run ``work`` in the lane, after what the calling lane's stream queued so far."""
        if self._stream is not None:
            self._stream.wait_stream(self._module.current_stream(self.device))
        return self._pool.submit(self._run, work)

    def join(self, running: Future) -> None:
        """Wait for ``running`` (raising what it raised); the calling stream (the one that
        started it: the same thread) then waits for the lane's."""
        try:
            running.result()
        finally:
            if self._stream is not None:
                self._module.current_stream(self.device).wait_stream(self._stream)

    def record(self, tensors: Iterable, *, to_lane: bool) -> None:
        """Keep each tensor's memory from reuse until the lane's stream (``to_lane``) or
        the calling lane's has used it: the caching allocator frees a block on the stream
        that made it."""
        if self._stream is None:
            return
        stream = self._stream if to_lane else self._module.current_stream(self.device)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                t.record_stream(stream)

    def _run(self, work: Callable[[], None]) -> None:
        if self._stream is None:
            work()
            return
        with self._module.stream(self._stream):
            work()


def _enter(twins: dict[str, str]) -> None:
    _here.twins = twins
