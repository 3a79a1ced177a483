"""Whether a recompute region is running again in backward, and what must happen before it
does (``preparing``: zero=3 gathers the parameters it reads): a ``Recomputation`` object,
one per rank (``RankContext.recomputation``; ``collectives.bind`` hands it to the chunk
graphs' recompute regions, passes/recompute.py). The regions enter ``contexts()`` around
each recomputation, and what counts per micro-batch (the expert-load recorder,
fxmeg/runtime/expert_load.py; the capacity mode's dropped pairs, ``moe.DropCounts``) asks
``recomputing()`` so a recomputed forward counts nothing: the one detector of a
recompute, for both."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class Recomputation:
    """This rank's recompute regions: how deep inside a recomputation backward is, and what
    they call with their inputs before they run."""

    def __init__(self) -> None:
        self.depth = 0
        """Recomputations running (reentrant: a second backward may run a region again)."""
        self._prepare: list[Callable] = []

    def contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """torch.utils.checkpoint's ``context_fn`` of a recompute region: nothing around
        forward, ``recomputing()`` True around the recomputation."""
        return contextlib.nullcontext(), self._again()

    @contextlib.contextmanager
    def _again(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def recomputing(self) -> bool:
        """Whether a recompute region is running again in backward, not in forward: what
        runs then ran once already (the expert-load recorder counts each micro-batch once
        by it)."""
        return self.depth > 0

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
