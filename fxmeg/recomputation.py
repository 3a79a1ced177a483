"""Whether a recompute region is running again in backward, and what must happen before it
does (``preparing``: zero=3 gathers the parameters it reads). Whether it is running again: the recompute pass enters
``recomputation_contexts`` around each region (passes/recompute.py), and what counts per
micro-batch (the expert-load recorder, fxmeg/runtime/load.py; the capacity mode's dropped
pairs, fxmeg/moe.py) asks ``recomputing()`` so a recomputed forward counts nothing."""

from __future__ import annotations

import contextlib


class _Recomputation:
    """Entered around each recomputation of a recompute region (reentrant: a second
    backward may run a region again)."""

    depth = 0

    def __enter__(self) -> None:
        _Recomputation.depth += 1

    def __exit__(self, *exc) -> None:
        _Recomputation.depth -= 1


def recomputation_contexts():
    """torch.utils.checkpoint's ``context_fn`` of a recompute region (passes/recompute.py):
    nothing around forward, ``recomputing()`` True around the recomputation."""
    return contextlib.nullcontext(), _Recomputation()


def recomputing() -> bool:
    """Whether a recompute region is running again in backward, not in forward: what
    runs then ran once already (the expert-load recorder counts each micro-batch once by it)."""
    return _Recomputation.depth > 0


_prepare: list = []


@contextlib.contextmanager
def preparing(fn):
    """While inside, every recompute region calls ``fn(args)`` with its inputs before it
    runs, in forward and when backward runs it again (the runtime's zero=3 gather)."""
    _prepare.append(fn)
    try:
        yield
    finally:
        _prepare.pop()


def prepare(args) -> None:
    """What the recompute regions call before they run (see ``preparing``)."""
    for fn in _prepare:
        fn(args)
