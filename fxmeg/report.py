"""Theoretical memory per pipeline stage (docs/design.md §8.8): what stays resident (parameters,
gradient buffers, optimizer state) and what flows (activations of the micro-batches in
flight, at the schedule's peak). Computed from the chunk graphs and the schedule
simulator, for this tensor-parallel rank; no process is asked.

Optimizer state assumes Adam-like two fp32 states per element, plus an fp32 master copy
in half precision; the distributed optimizer divides both by dp. Activations are an upper
bound: every floating value that requires grad in a chunk, kept for its backward.
"""

from __future__ import annotations

import torch

from fxmeg.passes.graph_utils import requires_grad_nodes, val
from fxmeg.program import Program
from fxmeg.runtime.context import RankContext
from fxmeg.runtime.schedules import simulate


def activation_bytes(gm: torch.fx.GraphModule) -> int:
    """Upper bound of one micro-batch's activations autograd keeps for a chunk."""
    grads = requires_grad_nodes(gm)
    total = 0
    for node in gm.graph.nodes:
        v = val(node)
        if node.op == "call_function" and node in grads and v is not None and v.is_floating_point():
            total += v.numel() * v.element_size()
    return total


def memory_report(program: Program, ctx: RankContext) -> list[dict]:
    """One entry per pipeline stage, in bytes (this tensor-parallel rank's shards)."""
    cfg, par = ctx.config, ctx.config.parallel
    peak = simulate(ctx.lower(ctx.schedule), pp=par.pp).peak_in_flight
    out = []
    for stage in range(par.pp):
        mine = [program.chunks[c] for c in program.chunks_of(stage)]
        params = {}  # name -> the local (shard) shape recorded on its get_attr node
        for gm in mine:
            for node in gm.graph.nodes:
                if node.op == "get_attr" and node.target in program.parameters:
                    params[node.target] = val(node)
        elements = sum(v.numel() for v in params.values())
        param_bytes = sum(v.numel() * v.element_size() for v in params.values())
        grad_bytes = sum(lay.numel * lay.dtype.itemsize for c in program.chunks_of(stage) for lay in program.buffers[c])
        per_state = 4 * elements / (par.dp if cfg.distributed_optimizer else 1)
        master = per_state if cfg.precision != "fp32" else 0.0
        act = max(activation_bytes(gm) for gm in mine)
        out.append({
            "stage": stage,
            "parameters": param_bytes,
            "gradient_buffers": grad_bytes,
            "optimizer_state": int(2 * per_state + master),
            "activations_per_microbatch": act,
            "microbatches_in_flight": peak[stage],
            "activations": act * peak[stage],
            "total": int(param_bytes + grad_bytes + 2 * per_state + master + act * peak[stage]),
        })
    return out


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
