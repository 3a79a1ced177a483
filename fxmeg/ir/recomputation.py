"""Whether a recompute region is running again in backward, and what must happen before it
does (``preparing``: zero=3 gathers the parameters it reads): a ``Recomputation`` object,
one per rank (``RankContext.recomputation``; ``collectives.bind`` hands it to the chunk
graphs' recompute regions, passes/recompute.py). The regions enter ``contexts()`` around
each recomputation, and what counts per micro-batch (the expert-load recorder,
fxmeg/runtime/expert_load.py; the capacity mode's dropped pairs, ``moe.DropCounts``) asks
``recomputing()`` so a recomputed forward counts nothing: the one detector of a
recompute, for both. What must return in the recomputation the value it returned in
forward (the global router loss's running tokens per expert, which a second call would
advance: fxmeg/runtime/expert_load.py ``GlobalTokens``) runs through ``once``: each
region's run in forward records its values, and backward's run of that region replays
them in order."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


class Recomputation:
    """This rank's recompute regions: how deep inside a recomputation backward is, and what
    they call with their inputs before they run."""

    def __init__(self) -> None:
        self.depth = 0
        """Recomputations running (reentrant: a second backward may run a region again)."""
        self._prepare: list[Callable] = []
        self._recording: list[list] = []
        """The tape of each region running in forward, innermost last (``once``)."""
        self._replaying: list[Iterator] = []
        """The tape of each region running again, innermost last."""

    def contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """torch.utils.checkpoint's ``context_fn`` of a recompute region, called once per
        run of the region in forward: around that run, its values from ``once`` recorded on
        a tape of its own; around its recomputation, ``recomputing()`` True and that tape
        replayed."""
        tape: list = []
        return self._record(tape), self._again(tape)

    @contextlib.contextmanager
    def _record(self, tape: list) -> Iterator[None]:
        self._recording.append(tape)
        try:
            yield
        finally:
            self._recording.pop()

    @contextlib.contextmanager
    def _again(self, tape: list) -> Iterator[None]:
        self.depth += 1
        self._replaying.append(iter(tape))  # from the start each time it runs again
        try:
            yield
        finally:
            self._replaying.pop()
            self.depth -= 1

    def once(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)``, except in a recomputation, where it is the value the
        same call returned when the region ran in forward (recorded in order, so the
        region's n-th call replays its n-th value). Outside any region, just the call."""
        if self.depth > 0 and self._replaying:
            return next(self._replaying[-1])
        value = fn(*args, **kwargs)
        if self._recording:
            self._recording[-1].append(value)
        return value

    def recomputing(self) -> bool:
        """Whether a recompute region is running again in backward, not in forward: what
        runs then ran once already (the expert-load recorder counts each micro-batch once
        by it)."""
        return self.depth > 0

    @contextlib.contextmanager
    def again(self) -> Iterator[None]:
        """Around a recomputation that no region runs (a split routed-experts block run
        again in its I, fxmeg/ir/moe_split.py): ``recomputing()`` is True inside."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    @contextlib.contextmanager
    def preparing(self, fn: Callable) -> Iterator[None]:
        """While inside, every recompute region calls ``fn(args)`` with its inputs before it
        runs, in forward and when backward runs it again (the runtime's zero=3 gather)."""
        self._prepare.append(fn)
        try:
            yield
        finally:
            self._prepare.pop()

    def prepare(self, args) -> None:
        """What the recompute regions call before they run (see ``preparing``)."""
        for fn in self._prepare:
            fn(args)


class Once:
    """A call target whose value a recomputation replays (``Recomputation.once``): what a
    chunk graph's node calls instead of ``fn`` (``collectives.bind``; ``call`` is a bound
    method, which a graph's code names as it names the other bound targets)."""

    def __init__(self, fn: Callable[..., Any], recomputation: Recomputation) -> None:
        self.fn = fn
        self.recomputation = recomputation

    def call(self, *args, **kwargs) -> Any:
        return self.recomputation.once(self.fn, *args, **kwargs)
