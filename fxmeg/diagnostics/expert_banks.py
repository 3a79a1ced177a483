"""Which trainable parameters are banks of routed experts, for ``fxmeg plan`` and the
planner's profiles (fxmeg/diagnostics/layout_plan.py, fxmeg/planner/profile.py)."""

from __future__ import annotations

import torch
from torch import fx

from fxmeg.ir.program import Program


def expert_banks(program: Program) -> frozenset[str]:
    """The trainable parameters that are banks of routed experts. Under ep > 1: those the
    expert-parallel pass split (``Program.ep_specs``). At ep = 1, where that pass does not
    run: those it would split, read from the full shapes (capture may not have grouped the
    experts' matmuls then, and a recompute region hides their reads): every trainable
    parameter of three or more dims that no convolution reads (the pass refuses a model with
    one it cannot split: ``ep-unfound-experts``; a convolution's weight is no bank: Qwen3.5's
    Gated DeltaNet conv1d) and the [E, N] bias banks beside one, in the same module with as
    many rows (GPT-OSS). A convolution read inside a recompute region's body is not seen:
    its weight counts at ep = 1."""
    if program.config.parallel.ep > 1:
        return frozenset(program.ep_specs)
    convolved = _convolution_weights(program.chunks)
    shapes = {n: program.full_shapes[n][0] for n in program.parameters if n not in convolved}
    rows = {n.rpartition(".")[0]: s[0] for n, s in shapes.items() if len(s) >= 3}  # module -> E
    return frozenset(n for n, s in shapes.items()
                     if len(s) >= 3 or (len(s) == 2 and rows.get(n.rpartition(".")[0]) == s[0]))


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._to_copy.default,
          torch.ops.aten.to.dtype, torch.ops.aten.contiguous.default,
          torch.ops.aten.clone.default, torch.ops.aten.squeeze.dim,
          torch.ops.aten.unsqueeze.default}
_CONVOLUTIONS = {torch.ops.aten.convolution.default, torch.ops.aten._convolution.default,
                 torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default,
                 torch.ops.aten.conv3d.default}


def _convolution_weights(chunks) -> set[str]:
    """The parameters the chunk graphs read as a convolution's weight (through views and
    casts)."""
    out = set()
    for gm in chunks:
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in _CONVOLUTIONS:
                w = n.args[1]
                while isinstance(w, fx.Node) and w.op == "call_function" and w.target in _VIEWS:
                    w = w.args[0]
                if isinstance(w, fx.Node) and w.op == "get_attr":
                    out.add(w.target)
    return out
