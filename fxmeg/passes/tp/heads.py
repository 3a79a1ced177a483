"""Attention layouts the tensor-parallel pass meets before it places a single value:
linears written as products with a transposed parameter (``linears_from_products``),
key/value heads fewer than the tp ranks, computed whole on every rank (``kv_replicas``,
``kv_linear``, ``check_kv_readers``), and the projections it leaves whole, said aloud
(``say_whole_projections``). Found by shapes, never by name; the gradients' reasoning:
docs/architecture.md §8.12.
"""

from __future__ import annotations

import fnmatch
import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx

from fxmeg.errors import PassError
from fxmeg.frontend.capture import owning_module
from fxmeg.ir.layouts import LOCAL, Replicate, Shard
from fxmeg.ir.tags import set_tag, tag
from fxmeg.passes.graph_utils import attr, call, full_args, val
from fxmeg.passes.op_rules import LINEAR_SLOTS, SHAPE_ARGUMENT, dim_argument, in_family
from fxmeg.passes.tp.moe import layer_glob

aten = torch.ops.aten
log = logging.getLogger("fxmeg.passes.tensor_parallel")
_TRANSPOSES = (aten.numpy_T.default, aten.t.default, aten.transpose.int, aten.permute.default)
KV, QUERY = "kv", "query"
"""Roles of the linears ``kv_replicas`` marks: a replicated key/value projection, or the
column-split query block of a fused projection."""


def linears_from_products(gm: fx.GraphModule) -> None:
    """``matmul(x, weight.T)`` of a 2-D parameter becomes ``linear(x, weight)``;
    ``matmul(weight, x)`` (Jamba's ``dt_proj.weight @ x``, features along dim -2) becomes
    ``linear(x.mT, weight).mT``."""
    g = gm.graph
    for node in list(g.nodes):
        if (
            node.target == aten.matmul.default
            and _is_param(node.args[0])
            and _is_value(node.args[1])
        ):
            _weight_first(g, node)
            continue
        if node.target != aten.matmul.default or not isinstance(node.args[1], fx.Node):
            continue
        t = node.args[1]
        if t.target not in _TRANSPOSES or t.args[0].op != "get_attr" or val(t.args[0]).dim() != 2:
            continue
        if t.target == aten.transpose.int and sorted(a % 2 for a in t.args[1:3]) != [0, 1]:
            continue
        if t.target == aten.permute.default and list(t.args[1]) != [1, 0]:
            continue
        with g.inserting_before(node):
            linear = call(g, aten.linear.default, (node.args[0], t.args[0]), like=node)
        node.replace_all_uses_with(linear)
        g.erase_node(node)
        if not t.users:
            g.erase_node(t)


def _is_value(x) -> bool:
    return (
        isinstance(x, fx.Node) and x.op != "get_attr" and val(x) is not None and val(x).dim() >= 2
    )


def _weight_first(g: fx.Graph, node: fx.Node) -> None:
    """``weight @ x`` (x: (..., in, n)) as ``linear(x.transpose(-1, -2), weight)`` transposed back.
    """
    w, x = node.args[:2]
    with g.inserting_before(node):
        xt = call(g, aten.transpose.int, (x, -1, -2), like=node)
        linear = call(g, aten.linear.default, (xt, w), like=node)
        out = call(g, aten.transpose.int, (linear, -1, -2), like=node)
    node.replace_all_uses_with(out)
    g.erase_node(node)


@dataclass(frozen=True)
class _Block:
    """Features [start, end) of a projection's output, holding ``heads`` heads; ``taken``
    is the node that extracts them (None: the whole output)."""

    start: int
    end: int
    heads: int | None
    taken: fx.Node | None


def kv_replicas(tpass) -> dict[fx.Node, str]:
    """Find the key/value projections to replicate (module docstring) and rewrite fused
    ones into a linear per block. Returns linear -> KV | QUERY; records each replicated
    weight's heads in ``tpass.kv_weights``."""
    roles: dict[fx.Node, str] = {}
    for node in list(tpass.g.nodes):
        slots = LINEAR_SLOTS.get(node.target)
        if slots is None or node not in tpass.block or not _is_param(node.args[slots.weight]):
            continue
        if any(fnmatch.fnmatch(owning_module(node), glob) for glob in tpass.plan):
            continue  # the user's plan decides
        blocks = _blocks(node)
        if not blocks or all(b.heads is None or b.heads % tpass.tp == 0 for b in blocks):
            continue
        w = node.args[slots.weight].target
        if len(blocks) == 1:
            if _query_sibling(node, tpass.tp, val(node).shape[-1] // blocks[0].heads):
                roles[node] = KV
                tpass.kv_weights[w] = (
                    f"{blocks[0].heads} key/value head(s), not divisible by tp={tpass.tp}: "
                    "replicated, its gradient summed over tp"
                )
            continue
        kv = [b for b in blocks if b.heads is not None and b.heads % tpass.tp]
        if len(kv) < len(blocks) and all(b.heads for b in blocks):
            roles |= _per_block(tpass, node, blocks)
            tpass.kv_weights[w] = (
                f"fused query/key/value with {' and '.join(str(b.heads) for b in kv)} key/value "
                f"head(s), not divisible by tp={tpass.tp}: the weight is held whole and its "
                "gradient summed over tp; each rank computes its own query heads and every "
                "key/value head"
            )
    return roles


def _is_param(w) -> bool:
    return (
        isinstance(w, fx.Node) and w.op == "get_attr" and val(w) is not None and val(w).dim() == 2
    )


def _keeps(node: fx.Node, size: int) -> bool:
    """A view that keeps the last dim's ``size`` (unsqueeze, expand, flattening tokens)."""
    out = val(node)
    return (
        isinstance(out, torch.Tensor)
        and out.dim() > 0
        and out.shape[-1] == size
        and in_family(node.target, "view")
    )


def head_view(node: fx.Node, size: int) -> tuple[fx.Node, int, int] | None:
    """(view, H, D): the first view after ``node`` (through views keeping the last dim)
    that splits its ``size`` features into H heads of D."""
    todo = [node]
    while todo:
        n = todo.pop()
        for user in n.users:
            out = val(user)
            if (
                not isinstance(out, torch.Tensor)
                or not in_family(user.target, "view")
                or out.dim() < 2
            ):
                continue
            split = (
                out.shape[-1] * out.shape[-2] == size
                and out.shape[:-2].numel() == val(n).shape[:-1].numel()
            )
            if split and (
                out.shape[-1] != size
                or user.target in SHAPE_ARGUMENT
                and out.dim() == val(n).dim() + 1
            ):
                # (..., H * D) -> (..., H, D), a single head too
                return user, out.shape[-2], out.shape[-1]
            if out.shape[-1] == size:
                todo.append(user)
    return None


def _blocks(linear: fx.Node) -> list[_Block] | None:
    """The blocks of ``linear``'s output (one: the output used whole) with their heads."""
    size = val(linear).shape[-1]
    pieces = _pieces(linear, size)
    if pieces:
        blocks = [_Block(a, b, h[1] if (h := head_view(n, b - a)) else None, n)
                  for a, b, n in pieces]
        dims = {(b.end - b.start) // b.heads for b in blocks if b.heads}
        if len(dims) != 1:
            return None
        d = dims.pop()  # a block no view splits (a single key head) holds (end - start) / D heads
        return [
            b
            if b.heads or (b.end - b.start) % d
            else _Block(b.start, b.end, (b.end - b.start) // d, b.taken)
            for b in blocks
        ]
    found = head_view(linear, size)
    if found is None:
        return None
    view, heads, d = found
    picked = _head_pieces(view, heads)
    if picked is None:
        return [_Block(0, size, heads, None)]
    return [_Block(a * d, b * d, b - a, n) for a, b, n in picked]


def _pieces(linear: fx.Node, size: int) -> list[tuple[int, int, fx.Node]] | None:
    """Disjoint feature ranges split or sliced off ``linear``'s output along its last dim
    (through views keeping it), with the node extracting each; None unless every use is one."""
    out, todo = [], [linear]
    while todo:
        n = todo.pop()
        rank = val(n).dim()
        for user in n.users:
            if _keeps(user, size):
                todo.append(user)
            elif (
                user.target == aten.slice.Tensor
                and full_args(user)[1] % rank == rank - 1
                and full_args(user)[4] == 1
            ):
                start, end = full_args(user)[2:4]
                start, end = slice(start, end).indices(size)[:2]
                out.append((start, end, user))
            elif in_family(user.target, "split") and dim_argument(user, 0) % rank == rank - 1:
                edges = [0]
                for v in user.meta["val"]:
                    edges.append(edges[-1] + v.shape[-1])
                for piece in user.users:
                    if piece.target is not operator.getitem:
                        return None
                    out.append((edges[piece.args[1]], edges[piece.args[1] + 1], piece))
            else:
                return None
    out.sort(key=lambda p: p[0])
    if len(out) < 2 or any(a[1] > b[0] for a, b in zip(out, out[1:])):
        return None
    return out


def _head_pieces(view: fx.Node, heads: int) -> list[tuple[int, int, fx.Node]] | None:
    """Ranges of heads sliced, selected or indexed (a constant index of consecutive heads:
    Falcon's ``qkv[:, :, [-2]]``) off the heads dim of ``view``, one per use; None unless
    every use is one."""
    rank, out = val(view).dim(), []
    dim = rank - 2
    for user in view.users:
        if (
            user.target == aten.slice.Tensor
            and full_args(user)[1] % rank == dim
            and full_args(user)[4] == 1
        ):
            out.append((*slice(*full_args(user)[2:4]).indices(heads)[:2], user))
        elif user.target == aten.select.int and user.args[1] % rank == dim:
            i = user.args[2] % heads
            out.append((i, i + 1, user))
        elif (
            user.target == aten.index.Tensor
            and (index := _constant_index(view, user, dim)) is not None
        ):
            out.append((index[0], index[-1] + 1, user))
        else:
            return None
    return out or None


def _constant_index(view: fx.Node, node: fx.Node, dim: int) -> list[int] | None:
    """The consecutive heads a constant index tensor picks along ``dim``, or None."""
    indices = node.args[1]
    if (
        len(indices) != dim + 1
        or any(i is not None for i in indices[:dim])
        or not isinstance(indices[dim], fx.Node)
    ):
        return None
    src = indices[dim]
    while src.op == "call_function" and src.target in (
        aten.lift_fresh_copy.default,
        aten.clone.default,
    ):
        src = src.args[0]
    t = attr(view.graph.owning_module, src.target) if src.op == "get_attr" else None
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_meta or t.is_floating_point():
        return None
    picked = [int(i) % val(view).shape[dim] for i in t.tolist()]
    return picked if picked == list(range(picked[0], picked[0] + len(picked))) else None


def _query_sibling(linear: fx.Node, tp: int, d: int) -> bool:
    """Whether another linear of the module reads ``linear``'s input and splits into heads
    of ``d`` features that tp divides: the queries next to these keys or values."""
    slots = LINEAR_SLOTS[linear.target]
    x, module = linear.args[slots.x], owning_module(linear).rpartition(".")[0]
    for other in x.users:
        if (
            other is linear
            or other.target not in LINEAR_SLOTS
            or owning_module(other).rpartition(".")[0] != module
        ):
            continue
        found = head_view(other, val(other).shape[-1])
        if found and found[2] == d and found[1] % tp == 0:
            return True
    return False


def _per_block(tpass, linear: fx.Node, blocks: list[_Block]) -> dict[fx.Node, str]:
    """Rewrite fused ``linear`` into one linear per block, each reading the block's rows of
    the weight (and bias); every extracting node becomes a reshape of its block's output."""
    g, slots = tpass.g, LINEAR_SLOTS[linear.target]
    args, roles = list(linear.args), {}
    b = args[slots.bias] if slots.bias is not None and len(args) > slots.bias else None
    for block in blocks:
        piece = list(args)
        with g.inserting_before(linear):
            piece[slots.weight] = call(
                g,
                aten.slice.Tensor,
                (args[slots.weight], slots.out_dim, block.start, block.end),
                like=linear,
            )
            if b is not None:
                piece[slots.bias] = call(
                    g, aten.slice.Tensor, (b, 0, block.start, block.end), like=linear
                )
            new = call(g, linear.target, tuple(piece), like=linear)
            roles[new] = QUERY if block.heads % tpass.tp == 0 else KV
            shape = list(val(block.taken).shape)
            out = (
                new
                if list(val(new).shape) == shape
                else call(g, aten.reshape.default, (new, shape), like=linear)
            )
        block.taken.replace_all_uses_with(out)
    for n in reversed(list(g.nodes)):  # the old extractions and the fused linear, now unused
        if n.op == "call_function" and not n.users and n is not linear and _depends_on(n, linear):
            g.erase_node(n)
    g.erase_node(linear)
    return roles


def _depends_on(node: fx.Node, root: fx.Node) -> bool:
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n is root:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def kv_linear(tpass, node: fx.Node):
    """Place a linear ``kv_replicas`` marked: its input through ``tp_copy``; a query block
    reads this rank's rows of its weight and bias and is column-split; a key/value
    projection is replicated (``check_kv_readers`` checks its readers)."""
    slots = LINEAR_SLOTS[node.target]
    x = node.args[slots.x]
    px = tpass.place.get(x)
    if isinstance(px, Shard) and not px.seq:
        raise tpass.refuse(
            node, "a query or key/value projection reads a value split over its features", px
        )
    args = list(node.args)
    args[slots.x] = tpass._entry(node, x)
    if tpass.heads[node] == KV:
        node.args = tuple(args)
        tpass.kv_outputs.append(node)
        return None
    for i, dim in ((slots.weight, slots.out_dim), (slots.bias, 0)):
        if i is not None and i < len(args) and isinstance(args[i], fx.Node):
            tpass._check_divides(node, val(args[i]).shape[dim], "query rows of a fused projection")
            args[i] = tpass.move(args[i], "replicated", "local", dim=dim, at=node)
            tpass.place[args[i]] = LOCAL
    node.args = tuple(args)
    return Shard(val(node).dim() - 1, (val(node).shape[-1],), origin=owning_module(node))


def check_kv_readers(tpass) -> None:
    """A replicated key/value's gradient on a rank is its split readers' part: every path
    from it must reach a value split over tp (or this rank's slice of it) before any
    collective or output, else that reader's gradient would be summed tp times. Paths go
    into and out of the region bodies the pass entered (a no-grad body passes no gradient)."""
    for kv in tpass.kv_outputs:
        for kind, n in tpass._gradient_readers(kv):
            if kind == "split":
                continue
            glob = layer_glob(owning_module(kv))
            raise PassError(
                f"cannot replicate the key/value projection {owning_module(kv)!r} over "
                f"tp={tpass.tp} ranks (tp does not divide its key/value heads): its output reaches "
                f"node {n.name!r} ({n.target}, module {owning_module(n)!r}) without passing "
                "through the query heads split over tp, so its gradient would be summed tp times. "
                f"Fix: keep the attention whole with tp_plan={{{glob.rpartition('.')[0] + '.*'!r}: "
                "'replicate'}, or choose a tp that divides the key/value heads"
            )


def whole_projections(tpass) -> list[tuple[str, str]]:
    """(module glob, why) of every block's projection (a trainable 2-D weight) left whole
    on every tp rank, routers (said by tp_moe) aside."""
    blocks = set(tpass.block.values())
    routers = {layer_glob(m) for m in tpass.routers}
    params = [n for n in tpass.g.nodes if n.op == "get_attr" and isinstance(val(n), torch.Tensor)]
    experts = {n.target.rpartition(".")[0] for n in params if val(n).dim() >= 3}  # said by tp_moe
    out: dict[str, str] = {}
    for n in params:
        layout = tag(n, "tp")
        if not isinstance(layout, Replicate) or val(n).dim() != 2:
            continue
        module = n.target.rpartition(".")[0]
        glob = layer_glob(module)
        if (
            glob in routers
            or module in experts
            or not any(n.target.startswith(b + ".") for b in blocks)
        ):
            continue
        if n.target in tpass.kv_weights:
            why = tpass.kv_weights[n.target]
        elif module in tpass.rejoined:
            why = (
                "its output is added back to the residual stream it reads with no row-parallel "
                "linear between (split by columns, it would split the stream)"
            )
        elif module in tpass.latents:
            why = (
                "a down projection every head reads (its output feeds a per-head up projection, "
                "which is split by columns: Megatron's latent attention)"
            )
        elif any(fnmatch.fnmatch(module, g) and r == "replicate" for g, r in tpass.plan.items()):
            why = "tp_plan says 'replicate'"
        else:
            readers = sorted({str(u.target) for u in n.users})
            why = f"no linear fxmeg splits reads it (read by {', '.join(readers)})"
        out.setdefault(glob, why)
    return sorted(out.items())


def say_whole_projections(tpass) -> None:
    """Warn about ``whole_projections`` and record them in ``gm.meta["fxmeg"]["tp_whole"]``."""
    whole = whole_projections(tpass)
    set_tag(tpass.gm, "tp_whole", tuple(whole))
    if whole:
        log.warning(
            "tp=%d leaves the weights of %d block projections whole on every tp rank (each rank "
            "holds and computes them in full): %s",
            tpass.tp,
            len(whole),
            "; ".join(f"{g!r}: {why}" for g, why in whole),
        )
