"""Expert-parallel pass: each routed-experts block of a chunk graph becomes one
``fxmeg.ir.ops.routed_experts`` node whose expert banks are split over ep ranks; the runtime
binds it to an all-to-all token dispatcher (fxmeg/runtime/experts.py). At every ep, each
block's top-k expert index is marked with ``fxmeg.ir.ops.expert_load``, which the runtime
binds to its count of tokens per expert (fxmeg/runtime/expert_load.py).

Scope: one chunk graph (after the pipeline pass).

How a block and its router's bias are recognised from the graph alone (no class or module
name), for grouped and batched experts: docs/architecture.md §8.2.

Requires: a chunk graph; ``parallel.ep`` divides each block's E.
Ensures: right after each block's top-k index an ``expert_load(top_k_index, layer=<the
experts module>, experts=E, bias=<the router's bias buffer FQN, or None>)`` node (it
returns nothing; nothing else changes). At ep = 1 that is all: no node is removed or
rewritten, and a block fxmeg cannot read is not marked (not counted), never refused,
unless ``moe_router_bias_update_rate`` > 0, which refuses (PassError naming the module)
a block it cannot read or a router without a bias buffer. At ep > 1 besides, each
block's nodes are replaced by one ``routed_experts`` node computing the
same values (``fxmeg.ir.moe``: the same rows, matmuls, weights and sums; only the
grouping of rows into matmuls differs; a batched block's skipped experts, which added
exact zeros, are not run), or with ``moe.moe_capacity_factor`` the
same less the (token, slot) pairs over an expert's capacity (its kwargs carry the
factor and the block's module name); its banks' get_attr nodes carry
``meta["fxmeg"]["ep"] = ExpertShard(E)`` and this rank's local shapes ([E / ep, ...]);
a chunk holding banks read by no recognised block raises PassError naming them (a bank:
a 3-D trainable weight whose values reach a matmul: ``_multiplies_like_experts``).
With ``moe_router_load_balancing_type="global_aux_loss"``, in the chunk whose router loss
``fxmeg::scale_aux_loss`` weighs, the loss's tokens per expert (the factor of its product
no gradient flows through) pass through ``ops.global_tokens`` (``_global_router_loss``).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from fxmeg.config import ParallelConfig
from fxmeg.config_sections import MoEConfig
from fxmeg.errors import PassError
from fxmeg.ir import ops
from fxmeg.ir.layouts import ExpertShard
from fxmeg.ir.program import CONSTANTS, ChunkInfo
from fxmeg.ir.tags import has_tag, set_tag, set_tags, tag, tags
from fxmeg.passes.ep_batched import batched_experts, maps_zero_to_zero
from fxmeg.passes.graph_utils import (
    arg,
    attr,
    call,
    fake_eval,
    requires_grad_nodes,
    source,
    users_reached,
    val,
)
from fxmeg.torch_private import op_schema

log = logging.getLogger(__name__)
aten = torch.ops.aten
_GROUPED_MM = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")
CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}
"""The dtype casts a block's rows, offsets and banks pass through (``source`` skips them)."""
_BANK_VIEWS = CASTS | {aten.transpose.int, aten.permute.default, aten.t.default}


def expert_parallel(gm: fx.GraphModule, *, parallel: ParallelConfig, moe: MoEConfig,
                    chunk: ChunkInfo) -> fx.GraphModule:
    """Mark every routed-experts block of chunk graph ``gm`` with ``expert_load`` and, at
    ep > 1, rewrite it for ``parallel.ep`` ranks (module docstring)."""
    ep, rate = parallel.ep, moe.moe_router_bias_update_rate
    blocks = routed_blocks(gm, strict=ep > 1 or rate > 0)
    if ep > 1:
        for i, block in enumerate(blocks):
            _rewrite(gm, block, f"experts_middle_{i}", ep, moe.moe_capacity_factor)
        _refuse_unfound_banks(gm, chunk)
    for block in blocks:
        _mark_load(gm, block, rate)
    global_loss = moe.moe_router_load_balancing_type == "global_aux_loss" and _global_router_loss(
        gm
    )
    if blocks or ep > 1 or global_loss:
        gm.graph.lint()
        gm.recompile()
    return gm


def _global_router_loss(gm: fx.GraphModule) -> bool:
    """Megatron's global_aux_loss: in the router loss that ``fxmeg::scale_aux_loss`` weighs
    (the loss pass), the factor of the product of tokens per expert and routing
    probabilities that no gradient flows through (the tokens per expert: Switch's f, next
    to the probabilities' P) is wrapped in ``ops.global_tokens``. Returns whether this
    chunk has such a loss; one whose product fxmeg cannot find is refused by name."""
    aux = next(
        (n for n in gm.graph.nodes if n.target == torch.ops.fxmeg.scale_aux_loss.default), None
    )
    if aux is None:
        return False
    grads = requires_grad_nodes(gm)
    n = aux.args[1]
    while n.op == "call_function":
        operands = [a for a in n.args if isinstance(a, fx.Node)]
        if (
            n.target == aten.mul.Tensor
            and len(operands) == 2
            and sum(a in grads for a in operands) == 1
        ):
            counts = next(a for a in operands if a not in grads)
            with gm.graph.inserting_after(counts):
                mean = gm.graph.call_function(ops.global_tokens, (counts,), {"group": ops.DP})
            mean.meta = {**counts.meta}
            n.replace_input_with(counts, mean)
            return True
        if len(operands) != 1:
            break
        n = operands[0]
    raise PassError(
        "moe_router_load_balancing_type='global_aux_loss', but the router loss "
        f"{aux.args[1].name!r} (module {_module(aux.args[1])!r}) is not a product of tokens per "
        "expert (no gradient) and routing probabilities that fxmeg can find; use "
        "moe_router_load_balancing_type='aux_loss'"
    )


def routed_blocks(gm: fx.GraphModule, *, strict: bool = True) -> list[_Block]:
    """Every routed-experts block of ``gm`` (module docstring), by its first grouped
    matmul, in graph order (the context-parallel pass reads them too: a block is computed
    per token). Not ``strict`` (ep = 1, no bias update): a grouped matmul fxmeg cannot
    read as a block is no block (logged)."""
    blocks = []
    for up in [n for n in gm.graph.nodes if is_grouped_mm(n) or n.target is aten.bmm.default]:
        try:
            block = _block(gm, up) if is_grouped_mm(up) else _batched(gm, up)
        except Exception as exc:  # at ep = 1 a block is only counted: never fail for it
            if strict:
                raise
            log.info(
                "expert_parallel: %s (module %r) is not counted in the expert load: %s",
                up.name,
                _module(up),
                exc,
            )
            continue
        if block is not None:
            blocks.append(block)
    return blocks


def _mark_load(gm: fx.GraphModule, b: _Block, rate: float) -> None:
    """``expert_load`` right after the block's top-k index (module docstring)."""
    bias = _router_bias(gm, b.top_k_index, b.experts)
    if rate > 0 and bias is None:
        raise PassError(
            f"moe_router_bias_update_rate={rate} updates each router's expert bias (loss-free "
            f"balancing), but the router of the experts {b.module!r} adds no 1-D buffer of "
            f"{b.experts} values (one per expert, as DeepSeek-V3's e_score_correction_bias) to the "
            "scores its top-k ranks; train this model with moe_router_bias_update_rate=0 (or give "
            "its router such a buffer)"
        )
    with gm.graph.inserting_after(b.top_k_index):
        mark = gm.graph.call_function(ops.expert_load, (b.top_k_index,),
                                      {"layer": b.module, "experts": b.experts, "bias": bias})
    mark.meta = {}
    set_tags(mark, tags(b.top_k_index))  # its module: its block's region


_MATMULS = {
    aten.linear.default,
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.matmul.default,
}
_INDEX_VIEWS = CASTS | {
    operator.getitem,
    aten.view.default,
    aten.reshape.default,
    aten.clone.default,
    aten.contiguous.default,
}


def _router_bias(gm: fx.GraphModule, top_k_index: fx.Node, experts: int) -> str | None:
    """The FQN of the one 1-D buffer of ``experts`` values added to the scores that
    ``top_k_index`` ranks (module docstring), or None."""
    topk = source(top_k_index, _INDEX_VIEWS)
    if topk.op != "call_function" or topk.target is not aten.topk.default:
        return None
    found, seen, todo = set(), set(), [topk.args[0]]
    while todo:
        n = todo.pop()
        v = val(n)
        if (
            n in seen
            or n.op != "call_function"
            or n.target in _MATMULS
            or v is None
            or v.dim() == 0
            or v.shape[-1] != experts
        ):
            continue
        seen.add(n)
        if n.target in (aten.add.Tensor, aten.add_.Tensor):
            found |= {t for t in (_buffer(gm, a, experts) for a in n.args) if t is not None}
        todo.extend(n.all_input_nodes)
    return found.pop() if len(found) == 1 else None


def _buffer(gm: fx.GraphModule, node, experts: int) -> str | None:
    """``node``'s get_attr target (through casts) when it is a 1-D buffer of ``experts`` values."""
    if not isinstance(node, fx.Node):
        return None
    node = source(node, CASTS)
    if node.op != "get_attr" or node.target.startswith(CONSTANTS):
        return None
    t = attr(gm, node.target)
    if (
        isinstance(t, torch.Tensor)
        and not isinstance(t, torch.nn.Parameter)
        and tuple(t.shape) == (experts,)
    ):
        return node.target
    return None


class _Block:
    """One recognised block: its inputs, banks, middle nodes and result."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)

    def inputs(self) -> set[fx.Node]:
        return {
            n
            for n in (
                self.hidden,
                self.top_k_index,
                self.top_k_weights,
                self.scores,
                self.w_up,
                self.w_down,
                self.b_up,
                self.b_down,
            )
            if n is not None
        }

    def inner(self) -> set[fx.Node]:
        """The nodes between the block's inputs and its result (the result included)."""
        before, todo = set(), list(self.inputs())
        while todo:
            n = todo.pop()
            if n not in before:
                before.add(n)
                todo.extend(n.all_input_nodes)
        inside, todo = set(), [self.result]
        while todo:
            n = todo.pop()
            if n not in inside and n not in before:
                inside.add(n)
                todo.extend(n.all_input_nodes)
        return inside


def is_grouped_mm(node: fx.Node) -> bool:
    """Whether ``node`` is a grouped matmul a routed-experts block is made of
    (``aten._grouped_mm`` or transformers' ``grouped_mm_fallback``)."""
    schema = op_schema(node.target)
    return node.op == "call_function" and schema is not None and schema.name in _GROUPED_MM


def _module(node: fx.Node) -> str:
    return tag(node, "module", "")


def _block(gm: fx.GraphModule, up: fx.Node) -> _Block | None:
    """The block whose first (up) grouped matmul is ``up``, or None when ``up`` is the
    second one of a block or not part of one."""
    offsets = _offsets(up)
    downs = [u for u in offsets.users if is_grouped_mm(u) and u is not up
             and _offsets(u) is offsets]
    if len(downs) != 1 or not _before(up, downs[0]):
        return None
    down = downs[0]
    where = f"module {_module(up)!r}"
    # expert tp with a down bias: the second matmul's rows summed over tp before the bias
    summed = next((u for u in down.users if u.target == torch.ops.fxmeg.tp_reduce.default), None)
    histc = source(offsets, {aten.cumsum.default})
    if histc.target is not aten.histc.default:
        raise PassError(
            f"expert_parallel: the grouped matmuls {up.name!r} and {down.name!r} ({where}) take "
                        f"offsets {offsets.name!r} that are not cumsum(histc(expert ids)); fxmeg "
                        "cannot tell which rows go to which expert")
    experts = int(histc.args[1])
    sorted_ids = source(histc.args[0], CASTS)
    sort = sorted_ids.args[0] if sorted_ids.target is operator.getitem else None
    if sort is None or sort.target not in (aten.sort.default, aten.sort.stable):
        raise PassError(
            f"expert_parallel: the expert ids of {up.name!r} ({where}) are not sorted by "
            "torch.sort")
    flat_index = sort.args[0]
    perm = next((u for u in sort.users if u.args[1] == 1), None)
    rows = source(up.args[0], CASTS)
    if rows.target is not aten.index.Tensor or perm is None:
        raise PassError(
            f"expert_parallel: the rows of {up.name!r} ({where}) are not gathered from the tokens "
                        "by the sorted order")
    hidden = rows.args[0]
    top_k_index = flat_index.args[0]
    weights_g = next((u for u in perm.users if u.target is aten.index.Tensor
                      and u.args[1] == [perm]), None)
    if weights_g is None or top_k_index is None or val(top_k_index).dim() != 2:
        raise PassError(
            f"expert_parallel: no top-k weights are gathered by the sorted order at {up.name!r} "
                        f"({where})")
    top_k_weights = weights_g.args[0].args[0]
    up_out, b_up = _bias(up, sorted_ids)
    mid_in_cast = down.args[0]
    down_out, b_down = _bias(summed or down, sorted_ids)
    middle = _between(up_out, mid_in_cast)
    result = _result(down_out, val(hidden).shape)
    if result is None:
        raise PassError(
            f"expert_parallel: no value shaped like the tokens {list(val(hidden).shape)} follows "
                        f"{down.name!r} ({where}); fxmeg cannot find the block's result")
    banks = [_bank(up.args[1], experts, where), _bank(down.args[1], experts, where)]
    return _Block(up=up, down=down, experts=experts, hidden=hidden, top_k_index=top_k_index,
                  top_k_weights=top_k_weights, scores=None, w_up=up.args[1], w_down=down.args[1],
                  b_up=b_up,
                  b_down=b_down, up_out=up_out, middle=middle, middle_out=mid_in_cast,
                  result=result, where=where,
                  banks=banks + [b for b in (b_up, b_down) if b is not None], module=_module(up),
                  down_sum=summed.args[1] if summed is not None else None)


def _batched(gm: fx.GraphModule, up: fx.Node) -> _Block | None:
    """The batched-experts block (Llama 4's: fxmeg/passes/ep_batched.py) whose first
    matmul is ``up``, or None. Its routing weights are the scores at the top-k index, applied
    to the experts' input (``probs_on_input``); ``scores`` stands for them until the rewrite
    gathers them."""
    found = batched_experts(gm, up)
    if found is None:
        return None
    where = f"module {_module(up)!r}"
    middle = _between(up, found.down.args[0])
    features, out_features = val(up).shape[-1], val(found.down.args[0]).shape[-1]
    if not maps_zero_to_zero(_subgraph(gm, up, middle, found.down.args[0]), features, out_features):
        raise PassError(
            f"expert_parallel: the batched experts' activation between {up.name!r} and "
            f"{found.down.name!r} ({where}) does not run per row, or maps a zero row to a nonzero "
            "one: the experts a token's routing skipped would not add zeros, so fxmeg cannot run "
            "only those it picked. Fix: train this model with ep=1 (every rank computes every "
            "expert)"
        )
    banks = [
        _bank(up.args[1], found.experts, where),
        _bank(found.down.args[1], found.experts, where),
    ]
    return _Block(
        up=up,
        down=found.down,
        experts=found.experts,
        hidden=found.hidden,
        top_k_index=found.top_k_index,
        top_k_weights=None,
        scores=found.scores,
        w_up=up.args[1],
        w_down=found.down.args[1],
        b_up=None,
        b_down=None,
        up_out=up,
        middle=middle,
        middle_out=found.down.args[0],
        result=found.result,
        where=where,
        banks=banks,
        module=_module(up),
        down_sum=None,
    )


def _offsets(mm: fx.Node) -> fx.Node:
    return arg(mm, 2, "offs")


def _before(a: fx.Node, b: fx.Node) -> bool:
    for n in a.graph.nodes:
        if n is a:
            return True
        if n is b:
            return False
    return False


def _bias(mm: fx.Node, ids: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(the matmul's result after its bias, the bias bank) or (the matmul, None)."""
    users = list(mm.users)
    if len(users) == 1 and users[0].target in (aten.add.Tensor, aten.add_.Tensor):
        other = next(a for a in users[0].args if a is not mm)
        if (
            isinstance(other, fx.Node)
            and other.target is aten.index.Tensor
            and other.args[1] == [ids]
        ):
            return users[0], other.args[0]
    return mm, None


def _between(start: fx.Node, end: fx.Node) -> list[fx.Node]:
    """Nodes after ``start`` up to and including ``end`` that ``end`` depends on, in
    graph order; each reads only ``start``, each other, or constants."""
    inside, todo = set(), [end]
    while todo:
        n = todo.pop()
        if n is start or n in inside:
            continue
        inside.add(n)
        todo.extend(n.all_input_nodes)
    nodes = [n for n in start.graph.nodes if n in inside]
    for n in nodes:
        strays = [i for i in n.all_input_nodes if i is not start and i not in inside]
        if strays or n.op != "call_function":
            raise PassError(
                "expert_parallel: the experts' activation reads "
                f"{strays[0].name if strays else n.name!r} besides the first matmul's rows (node "
                f"{n.name!r}, module {_module(n)!r}); fxmeg runs it per row and cannot tell what "
                "that value is per expert"
            )
    return nodes


def _result(start: fx.Node, shape) -> fx.Node | None:
    """The sum over the k slots after ``start`` (single-user chain), shaped ``shape``."""
    n = start
    while len(n.users) == 1:
        n = next(iter(n.users))
        v = val(n)
        if n.target is aten.sum.dim_IntList and v is not None and tuple(v.shape) == tuple(shape):
            return n
    return None


def _bank(node: fx.Node, experts: int, where: str) -> fx.Node:
    bank = source(node, _BANK_VIEWS)
    if bank.op != "get_attr" or val(bank) is None or val(bank).shape[0] != experts:
        raise PassError(
            f"expert_parallel: the grouped matmul's weights {node.name!r} ({where}) are not a "
            f"parameter of {experts} experts on dim 0"
        )
    return bank


def _rewrite(
    gm: fx.GraphModule, b: _Block, name: str, ep: int, capacity_factor: float | None
) -> None:
    if b.experts % ep:
        raise PassError(
            f"ep={ep} does not divide the {b.experts} experts of module {b.module!r}; choose ep "
            f"among {[d for d in range(1, b.experts + 1) if b.experts % d == 0]}"
        )
    graph = gm.graph
    weights, on_input = b.top_k_weights, b.scores is not None
    body_gm = _subgraph(gm, b.up_out, b.middle, b.middle_out)
    # the activation ran on [E, T, N]: give its values the routed rows' shapes [T * k, N]
    if on_input:
        _per_row(body_gm, val(b.top_k_index).numel())
    gm.add_submodule(name, body_gm)
    if on_input:  # batched experts: the scores at the top-k index, [T, k]
        with graph.inserting_before(b.result):
            weights = call(graph, aten.gather.default, (b.scores, 1, b.top_k_index), like=b.result)
    with graph.inserting_before(b.result):
        body = graph.get_attr(name)
        kwargs = {
            "num_experts": b.experts,
            "group": ops.EP,
            "capacity_factor": capacity_factor,
            "layer": b.module,
        } | ({"down_sum": b.down_sum} if b.down_sum is not None else {})
        routed = graph.call_function(ops.routed_experts, *ops.routed_experts_call(
            body, b.hidden, b.top_k_index, weights, b.w_up, b.w_down, b.b_up, b.b_down,
            **kwargs | ({"probs_on_input": True} if on_input else {})))
    routed.meta = {**b.result.meta, "val": val(b.result)}
    body.meta = {}
    set_tags(body, tags(b.result))
    old = b.inner()
    b.result.replace_all_uses_with(routed)
    # in-place ops too: they wrote only the block's temporaries
    for n in reversed(list(graph.nodes)):
        if n in old and not n.users:
            graph.erase_node(n)
    shard = ExpertShard(b.experts, origin=b.module)
    for bank in b.banks:
        set_tag(bank, "ep", shard)
        full = val(bank)
        bank.meta["val"] = full.new_empty(shard.local_shape(full.shape, ep))
    for view in (b.w_up, b.w_down):  # the banks' transposes / casts: local shapes too
        chain = []
        while view.op == "call_function":
            chain.append(view)
            view = view.args[0]
        for n in reversed(chain):
            n.meta["val"] = fake_eval(n)
    log.debug("expert_parallel: %s: %d experts over ep=%d", b.module, b.experts, ep)


def _subgraph(
    gm: fx.GraphModule, start: fx.Node, middle: list[fx.Node], end: fx.Node
) -> fx.GraphModule:
    """The activation ``middle`` (``start`` -> ``end``) as a graph of its own, run on rows."""
    sub = fx.Graph()
    env = {start: sub.placeholder("rows")}
    env[start].meta = dict(start.meta)
    for n in middle:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(env[end])
    return fx.GraphModule(gm, sub)


def _per_row(body: fx.GraphModule, rows: int) -> None:
    """The activation graph's values for ``rows`` rows (what ``routed_experts`` runs it on)."""
    for n in body.graph.nodes:
        if n.op == "placeholder":
            n.meta["val"] = val(n).new_empty((rows, val(n).shape[-1]))
        elif n.op == "call_function":
            n.meta["val"] = fake_eval(n)


_BANK_READS = _BANK_VIEWS | _INDEX_VIEWS | {
    aten.select.int,
    aten.index.Tensor,
    aten.slice.Tensor,
    aten.unbind.int,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten._unsafe_view.default,
}
"""What an expert bank's weights pass through on their way to a matmul: views, casts,
transposes and the selection of one expert (an eager loop's ``bank[e]``)."""


def _multiplies_like_experts(n: fx.Node) -> bool:
    """Whether the values of get_attr ``n`` reach, through ``_BANK_READS`` only, a matmul
    (grouped or not): what a bank of experts computes. A convolution's 3-D weight (a
    depthwise ``conv1d`` of a state-space or linear-attention layer) does not."""
    return any(
        is_grouped_mm(u) or u.target in _MATMULS
        for u in users_reached(n, through=lambda u: u.target in _BANK_READS)
    )


def _refuse_unfound_banks(gm: fx.GraphModule, chunk: ChunkInfo) -> None:
    """A bank of experts no block reads: a trainable parameter of 3 or more dims whose
    values feed a matmul (``_multiplies_like_experts``), never one for its shape alone."""
    for n in gm.graph.nodes:
        if n.op != "get_attr" or has_tag(n, "ep"):
            continue
        t = attr(gm, n.target)
        if (isinstance(t, torch.nn.Parameter) and t.requires_grad and t.dim() >= 3
                and _multiplies_like_experts(n)):
            raise PassError(
                f"ep > 1, but fxmeg cannot find the routed experts that read {n.target!r} (shape "
                f"{list(t.shape)}, module {_module(n) or n.target.rpartition('.')[0]!r}, chunk "
                f"{chunk.index}): expert parallelism recognises a Hugging Face grouped-experts "
                "block (two grouped matmuls over a bank of experts, fed by top-k routing; "
                "fxmeg/passes/expert_parallel.py) and Llama 4's batched experts "
                "(fxmeg/passes/ep_batched.py). Build the model with "
                "experts_implementation='grouped_mm' or train it with ep=1"
            )
