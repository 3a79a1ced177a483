"""Checks of each pass's Ensures, run after the pass when ``FXMEG_VERIFY=1`` (the tests set
it). A failed check is an internal error: an ``AssertionError`` naming the pass, the chunk
or node, and what does not hold.

One check per pass, named like it; ``fxmeg.frontend.pass_driver.PASSES`` pairs each pass with its
check, and the driver calls the check like the pass: on the result of a per-chunk pass
once per chunk graph (with its ``ChunkInfo``), otherwise on the whole result; a check,
like a pass, names the config sections it reads as its parameters.
"""

from __future__ import annotations

import torch
from torch import fx

from fxmeg.config import ParallelConfig
from fxmeg.config_sections import DataParallelConfig, MoEConfig
from fxmeg.ir import ops
from fxmeg.ir.program import ChunkInfo, buffer_layouts, chunk_spec, chunks, split_spec
from fxmeg.ir.tags import has_tag, tag
from fxmeg.passes.graph_utils import val
from fxmeg.passes.recompute import Recompute


def loss(gm: fx.GraphModule) -> None:
    outputs = gm.graph.output_node().args[0]
    tags = [tag(n, "loss") for n in outputs]
    assert tags == ["sum", "count"], f"loss: outputs are tagged {tags}, not ['sum', 'count']"
    assert all(val(n) is not None and val(n).dim() == 0 for n in outputs), (
        "loss: outputs are not scalars"
    )


def analyse(gm: fx.GraphModule) -> None:
    facts = tag(gm, "facts")
    assert facts is not None and facts.flops_per_microbatch >= 0, "analyse: no model facts recorded"


def context_parallel(gm: fx.GraphModule, parallel: ParallelConfig) -> None:
    cp = parallel.cp
    if cp == 1:
        return
    layout = tag(gm, "cp")
    assert layout.seq % (2 * cp) == 0, (
        f"context_parallel: sequence {layout.seq} is not in 2 * cp chunks"
    )
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, dim in zip(inputs, layout.dims):
        if dim is not None:
            assert val(node).shape[dim] == layout.seq // cp, (
                f"context_parallel: input {node.name} is not local"
            )
    for node in gm.graph.nodes:
        # under a sliced mask
        if node.target == torch.ops.aten.scaled_dot_product_attention.default:
            assert all(a.target in (torch.ops.fxmeg.cp_gather.default,
                                    torch.ops.fxmeg.cp_to_heads.default) for a in node.args[1:3]), (
                f"context_parallel: attention {node.name} does not read every key")
        if node.target == torch.ops.fxmeg.cp_attention.default:
            assert node.args[5] == cp and node.args[6] == ops.CP, (
                f"context_parallel: {node.name} is not over cp"
            )
        if node.target == torch.ops.fxmeg.cp_ring_attention.default:
            assert node.args[7] == cp and node.args[9] == ops.CP, (
                f"context_parallel: {node.name} is not over cp"
            )
        if node.op == "call_function":
            assert "val" in node.meta, f"context_parallel: {node.name} has no local value"


def tensor_parallel(gm: fx.GraphModule, parallel: ParallelConfig) -> None:
    if parallel.tp == 1:
        return
    for node in gm.graph.nodes:
        if node.op == "get_attr" and getattr(
            gm.get_parameter(node.target) if _is_param(gm, node) else None, "requires_grad", False
        ):
            assert has_tag(node, "tp"), f"tensor_parallel: parameter {node.target!r} has no tp tag"
        if node.target in ops.COLLECTIVES:
            assert ops.TP in node.args or ops.CP in node.args, (
                f"tensor_parallel: {node.name} is on no symbolic group"
            )
        if node.op == "call_function":
            assert "val" in node.meta, f"tensor_parallel: {node.name} has no local value"


def partition(gm: fx.GraphModule, parallel: ParallelConfig) -> None:
    k = parallel.num_chunks
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        c = tag(node, "chunk")
        assert c is not None and 0 <= c < k, f"partition: {node.name} has chunk {c}"
        for i in node.all_input_nodes:
            ci = tag(i, "chunk", 0)
            assert ci <= c, f"partition: {node.name} (chunk {c}) reads {i.name} of later chunk {ci}"
    assert len(tag(gm, "partition").placement) == k, "partition: no placement per chunk"


def pipeline(parent: fx.GraphModule, parallel: ParallelConfig) -> None:
    graphs = chunks(parent)
    assert len(graphs) == parallel.num_chunks, "pipeline: wrong number of chunks"
    for c, gm in enumerate(graphs):
        spec = chunk_spec(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert len(placeholders) == len(spec.data_inputs) + len(spec.recv), (
            f"pipeline: chunk {c} inputs"
        )
        outputs = gm.graph.output_node().args[0]
        assert len(outputs) == len(spec.send) + 2 * spec.is_last, f"pipeline: chunk {c} outputs"
        for b, out in zip(spec.send, outputs):
            assert out.target is ops.send and tuple(val(out).shape) == b.shape, (
                f"pipeline: chunk {c} sends {out}"
            )
        recvs = [n for n in gm.graph.nodes if n.target is ops.recv]
        assert len(recvs) == len(spec.recv), f"pipeline: chunk {c} has {len(recvs)} recv markers"


def expert_parallel(
    gm: fx.GraphModule, parallel: ParallelConfig, moe: MoEConfig, chunk: ChunkInfo
) -> None:
    ep = parallel.ep
    calls = [n for n in gm.graph.nodes if n.target is ops.routed_experts]
    banks = {n.target: tag(n, "ep") for n in gm.graph.nodes
             if n.op == "get_attr" and has_tag(n, "ep")}
    assert ep > 1 or not calls, (
        f"expert_parallel: chunk {chunk.index} has routed_experts nodes at ep=1"
    )
    marks = [n for n in gm.graph.nodes if n.target is ops.expert_load]
    assert ep == 1 or len(marks) == len(calls), (
        f"expert_parallel: chunk {chunk.index}: {len(marks)} expert_load marks"
    )
    for m in marks:
        index = val(m.args[0])
        assert index is not None and index.dim() == 2 and not index.is_floating_point(), (
            f"expert_parallel: {m.name} marks {m.args[0].name}, not a top-k index [tokens, k]")
    assert bool(calls) == bool(banks), (
        f"expert_parallel: chunk {chunk.index}: {len(calls)} blocks, banks {banks}"
    )
    for call in calls:
        assert call.kwargs["capacity_factor"] == moe.moe_capacity_factor, (
            f"expert_parallel: {call.name} has capacity_factor={call.kwargs['capacity_factor']}")
    for name, shard in banks.items():
        local = val(next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == name))
        assert local.shape[0] * ep == shard.experts, (
            f"expert_parallel: {name} holds {local.shape[0]} of {shard.experts} experts at ep={ep}")


def recompute(gm: fx.GraphModule, chunk: ChunkInfo) -> None:
    for name, module in gm.named_children():
        if isinstance(module, Recompute):
            assert not list(module.parameters()), (
                f"recompute: chunk {chunk.index} region {name} owns parameters"
            )


def buckets(parent: fx.GraphModule, parallel: ParallelConfig) -> None:
    placement = tag(parent, "partition").placement
    dp = parallel.dp_cp
    slots: dict[tuple[int, str], int] = {}
    for c, gm in enumerate(chunks(parent)):
        shapes = {n.target: val(n).shape for n in gm.graph.nodes
                  if n.op == "get_attr" and val(n) is not None}  # not a region's body
        for layout in buffer_layouts(gm):
            assert layout.dtype == torch.float32, f"buckets: chunk {c} buffer is {layout.dtype}"
            end = 0
            for b in layout.buckets:
                assert b.start == end and (b.end - b.start) % dp == 0, (
                    f"buckets: chunk {c} bucket {b.index}"
                )
                end = b.end
            assert end == layout.numel, f"buckets: chunk {c} buckets do not cover the buffer"
            for s in layout.slots:
                bucket = layout.buckets[s.bucket]
                assert bucket.start <= s.offset and s.offset + s.numel <= bucket.end, (
                    f"buckets: {s.name}"
                )
                assert s.numel == shapes[s.name].numel(), (
                    f"buckets: {s.name} slot is not its local size"
                )
                key = (placement[c], s.name)
                assert key not in slots, (
                    f"buckets: {s.name} has two slots on pipeline rank {placement[c]}"
                )
                slots[key] = c
    for c, gm in enumerate(chunks(parent)):
        for name, p in gm.named_parameters():
            if p.requires_grad:
                assert (placement[c], name) in slots, f"buckets: {name} (chunk {c}) has no slot"


def param_gather(gm: fx.GraphModule, data_parallel: DataParallelConfig, chunk: ChunkInfo) -> None:
    if data_parallel.zero_stage == 3:
        return _zero_gather(gm, chunk, reshard=data_parallel.reshard_after_forward)
    if not data_parallel.overlap_param_gather:
        return
    waited: set[tuple] = set()
    for node in gm.graph.nodes:
        if node.target is ops.wait_param_gather:
            waited.add(node.kwargs["bucket"])
            continue
        for arg in node.all_input_nodes:
            slot = tag(arg, "bucket") if arg.op == "get_attr" else None
            if slot is not None:
                assert slot.gather_key in waited, (
                    f"param_gather: chunk {chunk.index} {node.name} reads {arg.target} unwaited")


def _zero_gather(gm: fx.GraphModule, chunk: ChunkInfo, *, reshard: bool) -> None:
    """zero=3: each bucket the chunk reads is gathered once before any read of its
    parameters and, with ``reshard`` (reshard_after_forward), released once after the
    last; each gather prefetches the next one."""
    gathered, released, prefetched = [], set(), []
    for node in gm.graph.nodes:
        if node.target is ops.zero_gather:
            assert node.kwargs["bucket"] not in gathered, (
                f"param_gather: {node.kwargs['bucket']} gathered twice"
            )
            gathered.append(node.kwargs["bucket"])
            prefetched.append(node.kwargs["prefetch"])
            continue
        if node.target is ops.zero_release:
            key = node.kwargs["bucket"]
            assert key in gathered and key not in released, (
                f"param_gather: {key} released twice or ungathered"
            )
            released.add(key)
            continue
        for arg in node.all_input_nodes:
            slot = tag(arg, "bucket") if arg.op == "get_attr" else None
            if slot is not None:
                assert slot.gather_key in gathered and slot.gather_key not in released, (
                    f"param_gather: chunk {chunk.index} {node.name} reads {arg.target} outside its "
                    "gather"
                )
    want = set(gathered) if reshard else set()
    assert released == want, f"param_gather: chunk {chunk.index} releases {released}, not {want}"
    assert prefetched == [*gathered[1:], None], (
        f"param_gather: chunk {chunk.index} prefetches {prefetched}, not {gathered[1:]}")


def _is_param(gm: fx.GraphModule, node: fx.Node) -> bool:
    try:
        gm.get_parameter(node.target)
    except AttributeError:
        return False
    return True


def split_backward(gm: fx.GraphModule, parallel: ParallelConfig, chunk: ChunkInfo) -> None:
    c, split = chunk.index, split_spec(gm)
    if not parallel.splits_backward:
        assert split is None, f"split_backward: chunk {c} split for schedule {parallel.schedule!r}"
        return
    assert split is not None, f"split_backward: chunk {c} has no split"
    for name in ("zb_forward", "zb_input", "zb_weight"):
        sub = getattr(gm, name)
        assert not list(sub.parameters()) and not list(sub.buffers()), (
            f"split_backward: {name} holds tensors"
        )
    inputs = [n for n in gm.zb_weight.graph.nodes if n.op == "placeholder"]
    assert len(inputs) == split.carry, (
        f"split_backward: chunk {c}'s W takes {len(inputs)} values, I carries {split.carry}"
    )
    outputs = gm.zb_weight.graph.output_node().args[0]
    assert len(outputs) == len(split.weights), (
        f"split_backward: chunk {c}'s W returns {len(outputs)} gradients"
    )
