"""Measured activation memory: what autograd really saves for backward (the estimate it
checks is fxmeg/diagnostics/layout_plan.py's ``activation_bytes``)."""

from __future__ import annotations

import torch


class SavedBytes:
    """The measured counterpart of the activation estimate: peak bytes of what autograd
    saves for backward (parameters excluded) while ``hooks()`` is active, each storage
    counted once. Device-agnostic (CPU has no allocator statistics); this is the memory
    pipeline schedules and recompute change."""

    def __init__(self, params) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return _Handle(t, None, self)
        if self.refs.get(key, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Handle(t, (key, storage.nbytes()), self)

    def release(self, key: tuple[int, int]) -> None:
        self.refs[key[0]] -= 1
        if self.refs[key[0]] == 0:
            self.live -= key[1]


class _Handle:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        if self.key is not None:
            self.meter.release(self.key)
