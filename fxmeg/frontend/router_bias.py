"""Router expert biases in fp32 whatever the precision.

Loss-free balancing (``moe_router_bias_update_rate``, runtime/expert_load.py) moves each
router's expert bias (DeepSeek-V3's ``e_score_correction_bias``) by ``rate * sign(...)``
after every step. Under bf16 / fp16 the driver casts the model, buffers included, before
capture (pass_driver ``_cast``), so the bias would be stored in half precision: 0.05 is
0.0500488 in bf16, and once the bias has grown each update is rounded to a multiple of
its spacing, or lost. Megatron keeps ``expert_bias`` fp32 in any precision (its router
casts it back after Float16Module's cast); so does fxmeg, for the buffers the
expert-parallel pass names as a router's bias (the ``bias`` of its ``expert_load``
markers: found by their role in the graph, not by name).

The routing reads the fp32 bias as Megatron's does: added to the scores only to choose
the top-k experts. Where the scores are fp32 (DeepSeek-V3 and the routers like it compute
them from an fp32 linear) nothing but the bias's rounding changes; where they are half
precision the sum is promoted to fp32, which changes no dtype outside the selection as
long as only integer results (the top-k indices) leave it, which ``only_selects`` checks
on the whole-model graph. A bias whose sum feeds anything else (the routing weights, the
loss) keeps the model's precision: promoting it would change the dtype of the
computation that follows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import fx, nn

from fxmeg.ir.program import chunks, load_marks
from fxmeg.torch_private import op_schema, own_buffers

log = logging.getLogger(__name__)


def keep_router_biases_fp32(model: nn.Module, graph: fx.GraphModule,
                            reference: fx.GraphModule | None,
                            before: dict[str, torch.Tensor]) -> None:
    """Make each router bias the markers of ``graph``'s chunks name one fp32 tensor, held
    by ``model``, ``graph`` and ``reference`` wherever they held the cast one.

    Requires: ``graph`` after the expert-parallel pass; ``reference`` the whole-model
    graph (its buffers the model's tensors); ``before``: ``model``'s buffers by name as
    they were before the half-precision cast (their own tensors, not copies).
    Ensures: the one tensor is the user's own where it was fp32 already (so the runtime's
    in-place update and a checkpoint's read of the model's buffers see the same tensor),
    else the pre-cast value in fp32; a bias whose sum does not ``only_selects`` is left as
    it is (logged)."""
    names = {id(t): n for n, t in model.named_buffers(remove_duplicate=False)}
    swap: dict[int, torch.Tensor] = {}
    for bias in _marked_biases(graph):
        if bias.dtype == torch.float32 or id(bias) in swap:
            continue
        if reference is not None and not only_selects(reference, bias):
            log.warning("the router bias %s stays %s: its sum with the scores feeds more than "
                        "the top-k choice", names.get(id(bias), "?"), bias.dtype)
            continue
        swap[id(bias)] = before.get(names.get(id(bias)), bias).detach().to(torch.float32)
    if swap:
        replace_buffers(swap, (model, graph, reference))


def only_selects(gm: fx.GraphModule, bias: torch.Tensor) -> bool:
    """Whether every floating-point value computed from ``bias`` in ``gm`` ends in integer
    or boolean results (top-k indices, masks) or in nothing: no such value reaches the
    graph's output or a mutation, so its dtype matters to the selection alone."""
    reads = [n for n in gm.graph.nodes
             if n.op == "get_attr" and _attr(gm, n.target) is bias]
    seen: set[fx.Node] = set()
    todo = list(reads)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output" or _writes_state(n):
            return False
        if _integral(n):
            continue  # indices, masks: their dtype does not follow the bias's
        todo.extend(n.users)
    return True


def _marked_biases(graph: fx.GraphModule) -> Iterable[torch.Tensor]:
    for chunk in chunks(graph):
        for mark in load_marks(chunk):
            if mark.kwargs.get("bias"):
                yield chunk.get_buffer(mark.kwargs["bias"])


def replace_buffers(swap: dict[int, torch.Tensor], roots) -> None:
    """Every buffer slot of ``roots`` holding a tensor of ``swap`` (by identity) holds its
    replacement: one tensor everywhere, as before."""
    for root in roots:
        if root is None:
            continue
        for module in root.modules():
            table = own_buffers(module)
            for key, t in table.items():
                if t is not None and id(t) in swap:
                    table[key] = swap[id(t)]


def _attr(gm: fx.GraphModule, target: str):
    """The object a get_attr ``target`` names in ``gm`` (None where it names none)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _integral(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())


def _writes_state(n: fx.Node) -> bool:
    """An in-place ATen op writing into a buffer or an input (a ``copy_`` into state); one
    writing into a value computed from the bias (``scatter_`` into a mask) is in the walk."""
    schema = op_schema(n.target)
    if schema is None:
        return False
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        written = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
        if isinstance(written, fx.Node) and written.op in ("get_attr", "placeholder"):
            return True
    return False
