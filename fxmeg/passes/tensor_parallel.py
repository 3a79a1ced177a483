"""Tensor-parallel pass: Megatron's column / row-parallel linears, vocab-parallel embedding
and cross-entropy, and sequence parallelism, found and applied on the ATen graph.

Requires: the loss pass's ``(loss_sum, num_tokens)`` outputs.
Ensures, for every tp rank alike (the graph holds no rank: what differs per rank happens
inside ``fxmeg::`` ops, from the group the runtime binds):
  * inside a block (numbered module list), a linear with a replicated input becomes
    column-parallel (weight rows split; a fused output sliced or split into pieces that
    tile it is split block by block) and a linear whose input is split on its feature dim
    becomes row-parallel (weight columns split; its output all-reduced, then its bias added);
    ``plan`` (module-FQN glob -> colwise | rowwise | replicate | vocab) overrides this;
  * every other op carries the split by its kind (docs/design.md §4), so an op never seen
    before is handled when its kind is known: pointwise ops (``torch.Tag.pointwise``) keep
    their operands' split (a replicated operand spanning it is cut to this rank's part, a
    parameter read only there, as a norm's weight, is split instead); views, transposes,
    splits and repeat_interleave (GQA) move it, their shape arguments (heads, KV heads, split
    sizes) divided by tp; reductions (``torch.Tag.reduction``) over other dims keep it, and
    a sum or mean over the split dim (RMSNorm over a whole split projection; layer_norm is
    decomposed so) is the local sum all-reduced over tp (its gradient too, when it is read
    with split values, as a norm's statistic is); the matmul
    family (matmul, bmm, mm of activations, einsum: eager attention) passes a split batch or
    free dim through and refuses a split contracting dim; a slice of whole blocks of a
    fused output (Phi-3's ``qkv[..., :q]``) takes this rank's part of them; cat / stack,
    select / index_select and attention follow one rule each;
  * the embedding over the vocabulary and the LM head (the linear feeding the loss) split
    the vocabulary: ``fxmeg::vocab_shard_ids`` maps ids to this rank's rows and masks the
    others, the looked-up rows are all-reduced; a ``padding_idx`` stays a global row whose
    tokens pass no gradient to the weight; the loss is
    ``fxmeg::vocab_parallel_cross_entropy`` on the local logits, never gathered.
    A tied embedding / head weight is split the same way for both uses;
  * collectives are ``fxmeg::`` ops on the symbolic group "tp" (bound at run time):
    ``tp_copy`` before column-parallel inputs, ``tp_reduce`` after row-parallel outputs;
  * with ``sequence_parallel`` the residual stream between blocks is split along the
    sequence: ``sp_gather`` replaces tp_copy, ``sp_scatter`` replaces tp_reduce, and a
    replicated operand of the stream (position embeddings) is cut to the local part
    (``fxmeg::tp_slice``);
  * parameters are not touched: each trainable parameter's get_attr carries
    ``meta["fxmeg"]["tp"]`` = ("shard", dim, parts) or ("replicate", reduce_grad),
    reduce_grad True when its gradient differs per tp rank (it touches a split value:
    norm weights under sequence parallelism) and must be all-reduced; the runtime
    materialises each rank's shard from these tags (``fxmeg.runtime.context``);
  * ``meta["val"]`` holds the local shapes, parameters' get_attr nodes included.
Anything it cannot split safely is a PassError naming the node, the module, the numbers
and a fix. A higher-order op (an autocast or no-grad region, ``wrap``) whose operands are
all replicated stays as it is; one that reads a split value is refused (its body is not
split).
"""

from __future__ import annotations

import fnmatch
import operator
import re

import torch
from torch import fx

from fxmeg.capture import owning_module
from fxmeg.config import EngineConfig
from fxmeg.errors import PassError
from fxmeg.ops import TP
from fxmeg.passes.graph_utils import attr, call, fake_eval, finish, full_args, is_hop, val
from fxmeg.passes.partition import find_blocks
from fxmeg.passes.tp_placement import Indivisible, Shard, divisors, reshape_shard

aten = torch.ops.aten
ROLES = ("colwise", "rowwise", "replicate", "vocab")
# Ops are handled by kind, not one by one: pointwise ops (torch tags them
# ``torch.Tag.pointwise``) keep their operands' split, reductions (``torch.Tag.reduction``)
# follow their ``dim`` argument, and the families below follow one rule over dims each.
# _SAME: ops that keep their input's split but carry no pointwise tag.
_SAME = {
    aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.contiguous.default,
    aten.dropout.default, aten.type_as.default, aten.detach.default, aten.clone.default,
}
_POINTWISE = torch.Tag.pointwise
_REDUCTION = torch.Tag.reduction
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_VIEW_LIKE = {aten.flatten.using_ints, aten.unsqueeze.default, aten.squeeze.dim,
              aten.squeeze.default, aten.unflatten.int}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
# ops along one dim (their ``dim`` argument): the split must lie elsewhere
_ALONG = {aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
          aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default}
# products of activations, read as einsum (_matmul_letters, _einsum_letters)
_MATMULS = {aten.matmul.default, aten.bmm.default, aten.mm.default, aten.einsum.default}
# linear-like ops: (index of x, index of the weight, index of the bias or None, weight's
# output dim). Hugging Face's Conv1D is addmm(bias, x, weight[in, out]).
_LINEARS = {
    aten.linear.default: (0, 1, 2, 0),
    aten.addmm.default: (1, 2, 0, 1),
    aten.mm.default: (0, 1, None, 1),
}
_CLASS_LOSS = {aten.cross_entropy_loss.default}
fxmeg_ops = torch.ops.fxmeg
# collectives whose backward reduces the gradient over tp ranks: a parameter reaching a split
# value only through one of them gets the same gradient on every rank (tp_slice does not)
_SYNCED = {fxmeg_ops.tp_copy.default, fxmeg_ops.tp_reduce.default, fxmeg_ops.sp_gather.default,
           fxmeg_ops.sp_scatter.default, fxmeg_ops.vocab_parallel_cross_entropy.default}


def tensor_parallel(gm: fx.GraphModule, config: EngineConfig) -> fx.GraphModule:
    """Shard ``gm`` over ``config.parallel.tp`` ranks (see the module docstring)."""
    par = config.parallel
    if par.tp == 1:
        return gm
    _TensorParallel(gm, par.tp, dict(par.tp_plan), par.sequence_parallel).run()
    return finish(gm)


class _TensorParallel:
    def __init__(self, gm, tp, plan, sp):
        self.gm, self.g, self.tp, self.sp = gm, gm.graph, tp, sp
        for glob, role in plan.items():
            if role not in ROLES:
                raise PassError(f"tp_plan[{glob!r}] = {role!r} is not one of {ROLES}")
        self.plan = plan
        self.place: dict[fx.Node, object] = {}
        self.specs: dict[str, tuple[int, tuple[int, ...]]] = {}  # param -> (dim, parts)
        self.whole: dict[str, fx.Node] = {}  # param -> a replicated linear reading it
        self.entries: dict[fx.Node, fx.Node] = {}
        self.statistics: list[tuple[fx.Node, fx.Node]] = []  # all-reduced sums (norms)
        self.block = find_blocks(gm)
        self.vocab, self.head = self._find_head()
        self.seq_dim = 1

    # ------------------------------------------------------------------ driver

    def run(self) -> None:
        for node in list(self.g.nodes):
            if node.op != "call_function":
                continue
            self.place[node] = self._visit(node)
        self._check_statistics()
        self._tag_parameters()
        self._refresh_values()

    def _visit(self, node: fx.Node):
        t = node.target
        if t in _LINEARS and node.args[_LINEARS[t][1]].op == "get_attr":
            return self._linear(node)
        if t == aten.embedding.default:
            return self._embedding(node)
        args = [self.place.get(a) for a in node.all_input_nodes]
        if t in _CLASS_LOSS and isinstance(self.place.get(node.args[0]), Shard):
            return self._vocab_loss(node)
        if not any(isinstance(p, (Shard, list)) for p in args):
            return None
        if is_hop(node):
            split = next(p for p in args if isinstance(p, (Shard, list)))
            glob = re.sub(r"\.\d+\.", ".*.", owning_module(node) + ".") + "*"
            raise self._unsupported(
                node, f"it is a higher-order op ({t.name()}: an autocast, no-grad or wrap region "
                "of the model) that reads a value split over tp ranks, and fxmeg does not split "
                "the region's body", split if isinstance(split, Shard) else None,
                fix=f"keep the linears that feed it whole with tp_plan={{{glob!r}: 'replicate'}}, "
                    "or use tp=1")
        if t is operator.getitem:
            parts = self.place[node.args[0]]
            return parts[node.args[1]] if isinstance(parts, list) else parts
        tags = getattr(t, "tags", ())
        if t in _SAME:
            return self.place[node.args[0]]
        if _POINTWISE in tags:
            return self._elementwise(node)
        if t in _RESHAPES or t in _VIEW_LIKE or t == aten.expand.default:
            return self._reshape(node)
        if t in (aten.transpose.int, aten.permute.default, aten.t.default):
            return self._permute(node)
        if t in _SPLITS:
            return self._split(node)
        if t == aten.slice.Tensor:
            return self._slice(node)
        if t in (aten.cat.default, aten.stack.default):
            return self._cat(node)
        if t in (aten.select.int, aten.index_select.default):
            return self._select(node)
        if t == aten.repeat_interleave.self_int:
            return self._repeat_interleave(node)
        if t == aten.scaled_dot_product_attention.default:
            return self._attention(node)
        if t in _MATMULS:
            return self._matmul(node)
        if t in _ALONG:
            return self._along(node, full_args(node)[1], "computes along")
        if t == aten.layer_norm.default:
            return self._layer_norm(node)
        if _REDUCTION in tags:
            return self._reduction(node)
        schema = getattr(t, "_schema", None)
        kind = ("not an ATen op" if schema is None else
                "a view" if any(r.alias_info for r in schema.returns) else "an op of no kind it knows")
        raise self._unsupported(node, f"fxmeg has no rule for it ({kind}: not pointwise, a reduction, "
                                      "a view, a concatenation, an index or a product)")

    # ------------------------------------------------------------------ linears

    def _role(self, node: fx.Node) -> str:
        module = owning_module(node)
        for glob, role in self.plan.items():
            if fnmatch.fnmatch(module, glob):
                return role
        if node is self.head:
            return "vocab"
        if node not in self.block:
            return "replicate"
        x = self.place.get(node.args[_LINEARS[node.target][0]])
        return "rowwise" if isinstance(x, Shard) and not x.seq else "colwise"

    def _linear(self, node: fx.Node):
        xi, wi, bi, out_dim = _LINEARS[node.target]
        x, w = node.args[xi], node.args[wi]
        b = node.args[bi] if bi is not None and len(node.args) > bi else None
        role, px = self._role(node), self.place.get(x)
        if role == "replicate":
            if isinstance(px, Shard) and not px.seq:
                raise self._unsupported(node, "a replicated linear reads a value split over its features", px)
            self._whole(w, node)
            return px  # per token: a sequence shard stays one
        args = list(node.args)
        if role in ("colwise", "vocab"):
            out = val(node).shape[-1]
            parts = (self.vocab,) if role == "vocab" else self._parts(node, out)
            for p in parts:
                self._check_divides(node, p, "output features of a column-parallel linear")
            args[xi] = self._entry(node, x)
            node.args = tuple(args)
            self._spec(w, out_dim, parts, node)
            if b is not None:
                self._spec(b, 0, parts, node)
            return Shard(val(node).dim() - 1, parts, vocab=role == "vocab", origin=owning_module(node))
        if not (isinstance(px, Shard) and px.dim == val(x).dim() - 1 and not px.seq):
            raise self._unsupported(node, "a row-parallel linear needs its input split on its last dim", px)
        self._spec(w, 1 - out_dim, px.parts, node)
        if node.target == aten.addmm.default:  # the bias goes after the reduction
            node.target, node.args = aten.mm.default, (x, w)
        else:
            node.args = (x, w)
        return self._reduce(node, bias=b)

    def _parts(self, node: fx.Node, out: int) -> tuple[int, ...]:
        """Blocks of a fused output: the sizes it is split into along its last dim (after
        reshapes that keep that dim, as Conv1D's), if any."""
        todo = [node]
        while todo:
            n = todo.pop()
            slices = set()
            for user in n.users:
                if user.target == aten.slice.Tensor:
                    dim, start, end, step = full_args(user)[1:5]
                    if dim % val(n).dim() == val(n).dim() - 1 and step == 1:
                        slices.add(_bounds(start, end, out))
                    continue
                if user.target in _RESHAPES and val(user).shape[-1] == out:
                    todo.append(user)
                elif user.target in _SPLITS and _dim(user, val(user.args[0]).dim()) == val(n).dim() - 1:
                    if user.target == aten.split.Tensor:
                        return (user.args[1],) * (out // user.args[1])
                    if user.target == aten.chunk.default:
                        return (out // user.args[1],) * user.args[1]
                    return tuple(user.args[1])
            blocks = sorted(slices - {(0, out)})
            if blocks and blocks[0][0] == 0 and blocks[-1][1] == out and all(
                    a[1] == b[0] for a, b in zip(blocks, blocks[1:])):
                return tuple(e - b for b, e in blocks)  # slices that tile the output: qkv[..., :q]
        return (out,)

    def _entry(self, node: fx.Node, x: fx.Node) -> fx.Node:
        """The replicated input of column-parallel linears, through Megatron's f (or an
        all-gather of the sequence shard); one per input value."""
        if x not in self.entries:
            px = self.place.get(x)
            with self.g.inserting_before(node):
                if isinstance(px, Shard) and px.seq:
                    op, args = torch.ops.fxmeg.sp_gather.default, (x, px.dim, self.tp, TP)
                else:
                    op, args = torch.ops.fxmeg.tp_copy.default, (x, TP)
                self.entries[x] = call(self.g, op, args, like=node)
            self.place[self.entries[x]] = None
        return self.entries[x]

    def _reduce(self, node: fx.Node, *, bias: fx.Node | None):
        """Sum a partial output over tp ranks (or reduce-scatter it along the sequence),
        then add the bias; later readers see the result."""
        users = list(node.users)
        with self.g.inserting_after(node):
            if self.sp:
                red = call(self.g, torch.ops.fxmeg.sp_scatter.default,
                           (node, self.seq_dim, self.tp, TP), like=node)
                place = Shard(self.seq_dim, (val(node).shape[self.seq_dim],), seq=True,
                              origin=owning_module(node))
            else:
                red, place = call(self.g, torch.ops.fxmeg.tp_reduce.default, (node, TP), like=node), None
        self.place[red] = place
        out = red
        if bias is not None:
            with self.g.inserting_after(red):
                out = call(self.g, aten.add.Tensor, (red, bias), like=node)
            self.place[out] = place
        for user in users:
            user.replace_input_with(node, out)
        return "partial"

    # ------------------------------------------------------------------ vocabulary

    def _find_head(self) -> tuple[int | None, fx.Node | None]:
        """Vocabulary size and LM head: the linear whose output feeds the class loss."""
        loss = next((n for n in self.g.nodes if n.target in _CLASS_LOSS), None)
        if loss is None:
            return None, None
        x = loss.args[0]
        while x.op == "call_function" and (x.target in _RESHAPES | _VIEW_LIKE | _SAME or (
                _POINTWISE in getattr(x.target, "tags", ()) and len(x.all_input_nodes) == 1)):
            x = x.args[0]  # through casts and pointwise ops of the logits alone (softcapping)
        vocab = val(loss.args[0]).shape[1]
        return vocab, (x if x.target == aten.linear.default and val(x.args[1]).shape[0] == vocab else None)

    def _embedding(self, node: fx.Node):
        w, ids = node.args[0], node.args[1]
        rows = val(w).shape[0]
        role = self._embedding_role(node, rows)
        if role == "replicate":
            return None
        self._check_divides(node, rows, "vocabulary rows of the embedding",
                            f"pad the vocabulary to a multiple of {self.tp} (e.g. {-(-rows // self.tp) * self.tp})")
        self._spec(w, 0, (rows,), node)
        _, _, padding_idx, by_freq, sparse = full_args(node)[:5]
        if by_freq or sparse:
            raise self._unsupported(node, "scale_grad_by_freq or sparse gradients over a split vocabulary "
                                          "are not implemented")
        with self.g.inserting_before(node):
            both = call(self.g, torch.ops.fxmeg.vocab_shard_ids.default, (ids, rows // self.tp, TP), like=node)
            local = call(self.g, operator.getitem, (both, 0), like=node)
            outside = call(self.g, operator.getitem, (both, 1), like=node)
        node.args = (w, local)  # padding_idx is a global row: it is handled below
        users = list(node.users)
        with self.g.inserting_after(node):
            mask = call(self.g, aten.unsqueeze.default, (outside, -1), like=node)
        with self.g.inserting_after(mask):
            zeroed = call(self.g, aten.masked_fill.Scalar, (node, mask, 0.0), like=node)
        if padding_idx is not None and padding_idx >= 0:
            zeroed = self._no_grad_where(zeroed, ids, padding_idx)
        for user in users:
            user.replace_input_with(node, zeroed)
        self.seq_dim = val(ids).dim() - 1
        if self.sp:
            self._check_divides(node, val(node).shape[self.seq_dim], "sequence length (sequence parallelism)")
        self.place[zeroed] = "partial"
        self._reduce(zeroed, bias=None)
        return None

    def _no_grad_where(self, rows: fx.Node, ids: fx.Node, padding_idx: int) -> fx.Node:
        """``rows`` whose tokens equal ``padding_idx`` pass no gradient to the weight:
        the embedding's padding row, in global ids (each rank's local row 0 is another
        token, so the op's own padding_idx would freeze the wrong rows)."""
        with self.g.inserting_after(rows):
            pad = call(self.g, aten.eq.Scalar, (ids, padding_idx), like=rows)
        with self.g.inserting_after(pad):
            pad = call(self.g, aten.unsqueeze.default, (pad, -1), like=rows)
        with self.g.inserting_after(pad):
            frozen = call(self.g, aten.detach.default, (rows,), like=rows)
        with self.g.inserting_after(frozen):
            return call(self.g, aten.where.self, (pad, frozen, rows), like=rows)

    def _embedding_role(self, node: fx.Node, rows: int) -> str:
        module = owning_module(node)
        for glob, role in self.plan.items():
            if fnmatch.fnmatch(module, glob):
                return "vocab" if role != "replicate" else "replicate"
        reads_inputs = _reaches_placeholder(node.args[1])
        return "vocab" if rows == self.vocab and reads_inputs else "replicate"

    def _vocab_loss(self, node: fx.Node):
        logits, target = node.args[0], node.args[1]
        args = full_args(node)
        if args[5] != 0.0:
            raise self._unsupported(node, "label smoothing over a split vocabulary is not implemented")
        if val(logits).dim() != 2 or self.place[logits].dim != 1:
            raise self._unsupported(node, "the vocabulary-parallel loss needs (tokens, vocabulary) logits")
        with self.g.inserting_before(node):
            both = call(self.g, torch.ops.fxmeg.vocab_parallel_cross_entropy.default,
                        (logits, target, args[4], TP), like=node)
            per_token = call(self.g, operator.getitem, (both, 0), like=node)
            loss_sum = call(self.g, aten.sum.default, (per_token,), like=node)
        loss_sum.meta["fxmeg"]["loss"] = node.meta["fxmeg"].get("loss", "sum")
        node.replace_all_uses_with(loss_sum)
        return None

    # ------------------------------------------------------------------ propagation rules

    def _elementwise(self, node: fx.Node):
        out_dim = val(node).dim()
        shards = [(a, self.place[a]) for a in node.all_input_nodes if isinstance(self.place.get(a), Shard)]
        s0 = shards[0][1].moved(shards[0][1].dim + out_dim - val(shards[0][0]).dim())
        for a, s in shards[1:]:
            if s.moved(s.dim + out_dim - val(a).dim()) != s0:
                raise self._unsupported(node, "its operands are split differently", s)
        for a in node.all_input_nodes:
            if isinstance(self.place.get(a), Shard) or val(a) is None:
                continue
            j = s0.dim - (out_dim - val(a).dim())
            if j >= 0 and val(a).shape[j] != 1:  # a replicated operand spans the split dim
                if self._own_parameter(a):  # a norm's weight over split features: shard it too
                    self._spec(a, j, s0.parts, node)
                    continue
                if len(s0.parts) > 1:
                    raise self._unsupported(node, "a replicated operand spans a dim of fused blocks", s0)
                node.replace_input_with(a, self._local_slice(node, a, j))
        return s0

    def _own_parameter(self, a: fx.Node) -> bool:
        """``a`` is a trainable parameter read here only: it can be split with the value
        it meets instead of being sliced per rank."""
        if a.op != "get_attr" or not getattr(attr(self.gm, a.target), "requires_grad", False):
            return False
        readers = [n for n in self.g.nodes if n.op == "get_attr" and n.target == a.target]
        return readers == [a] and len(a.users) == 1

    def _local_slice(self, node: fx.Node, a: fx.Node, dim: int) -> fx.Node:
        size = val(a).shape[dim]
        self._check_divides(node, size, f"dim {dim} of operand {a.name!r}")
        with self.g.inserting_before(node):
            piece = call(self.g, torch.ops.fxmeg.tp_slice.default, (a, dim, self.tp, TP), like=node)
        self.place[piece] = "local"  # this rank's part of a replicated value
        return piece

    def _reshape(self, node: fx.Node):
        s = self.place[node.args[0]]
        a, b = tuple(val(node.args[0]).shape), tuple(val(node).shape)
        if node.target == aten.expand.default:
            lead = len(b) - len(a)
            sizes = list(node.args[1])
            if sizes[s.dim + lead] not in (-1,):
                sizes[s.dim + lead] //= self.tp
            node.args = (node.args[0], sizes, *node.args[2:])
            return s.moved(s.dim + lead)
        moved = reshape_shard(s, a, b, self.tp)
        if isinstance(moved, Indivisible):  # the usual case: heads or KV heads
            raise PassError(
                f"tp={self.tp} does not divide {moved.size}, the number of heads (or groups) "
                f"that node {node.name!r} ({node.target.__name__}, module "
                f"{owning_module(node)!r}) splits the features into; choose tp in "
                f"{[d for d in divisors(moved.size)]}"
            )
        if isinstance(moved, str):
            raise self._unsupported(node, moved, s)
        if node.target in _RESHAPES:
            shape = list(node.args[1])
            if shape[moved.dim] != -1:
                shape[moved.dim] //= self.tp
            node.args = (node.args[0], shape)
        elif node.target == aten.unflatten.int:
            dim, sizes = node.args[1] % len(a), list(node.args[2])
            sizes[moved.dim - dim] //= self.tp
            node.args = (node.args[0], node.args[1], sizes)
        return moved

    def _permute(self, node: fx.Node):
        s, n = self.place[node.args[0]], val(node).dim()
        if node.target == aten.transpose.int:
            i, j = node.args[1] % n, node.args[2] % n
            return s.moved({i: j, j: i}.get(s.dim, s.dim))
        if node.target == aten.t.default:
            return s.moved(1 - s.dim)
        return s.moved([d % n for d in node.args[1]].index(s.dim))

    def _split(self, node: fx.Node):
        s = self.place[node.args[0]]
        dim = _dim(node, val(node.args[0]).dim())
        pieces = node.meta["val"]  # a list of fake tensors
        if dim != s.dim:
            return [s] * len(pieces)
        sizes = [v.shape[dim] for v in pieces]
        if tuple(sizes) != s.parts:
            raise self._unsupported(node, f"it splits the dim into {sizes}, not into its blocks {s.parts}", s)
        if node.target == aten.split.Tensor:
            node.args = (node.args[0], node.args[1] // self.tp, *node.args[2:])
        elif node.target == aten.split_with_sizes.default:
            node.args = (node.args[0], [x // self.tp for x in node.args[1]], *node.args[2:])
        return [s.moved(dim, (p,)) for p in s.parts]

    def _slice(self, node: fx.Node):
        """A slice along another dim keeps the split; along the split dim, a slice of whole
        blocks (a fused projection's q, k, v: ``qkv[..., :q_size]``) takes this rank's
        part of each of them (its bounds divided by tp); a slice of everything keeps it."""
        s = self.place[node.args[0]]
        x, dim, start, end, step = full_args(node)[:5]
        dim = dim % val(node).dim()
        size = val(node.args[0]).shape[dim]
        start, end = _bounds(start, end, size)
        if dim != s.dim or (start, end, step) == (0, size, 1):
            return s
        edges = [sum(s.parts[:i]) for i in range(len(s.parts) + 1)]
        if step != 1 or start not in edges or end not in edges:
            raise self._unsupported(
                node, f"it slices [{start}:{end}:{step}] of the split dim {dim}, which is not a run of "
                      f"its blocks {s.parts} (a fused projection is sliced block by block)", s)
        node.args, node.kwargs = (x, dim, start // self.tp, end // self.tp), {}
        return s.moved(dim, s.parts[edges.index(start):edges.index(end)])

    def _cat(self, node: fx.Node):
        """cat / stack: operands split alike along another dim keep (move) the split, a
        replicated one is cut to this rank's part; cat along the split dim of split
        operands puts their blocks end to end (each rank holds its part of every block)."""
        tensors, n = node.args[0], val(node).dim()
        dim = full_args(node)[1] % n
        stack = node.target == aten.stack.default
        shards = [self.place.get(a) for a in tensors if isinstance(self.place.get(a), (Shard, list))]
        if any(isinstance(p, list) for p in shards):
            raise self._unsupported(node, "it concatenates an unpacked list")
        s0 = shards[0]
        if not stack and dim == s0.dim:
            places = [self.place.get(a) for a in tensors]
            if not all(isinstance(p, Shard) and p.dim == dim for p in places):
                raise self._unsupported(node, "it concatenates along the split dim a value that is "
                                              "not split along it", s0)
            return s0.moved(dim, tuple(b for p in places for b in p.parts))
        if any(p.dim != s0.dim or p.parts != s0.parts for p in shards):
            raise self._unsupported(node, "its operands are split differently", s0)
        for a in tensors:
            if not isinstance(self.place.get(a), Shard):
                if len(s0.parts) > 1:
                    raise self._unsupported(node, "a replicated operand spans a dim of fused blocks", s0)
                node.replace_input_with(a, self._local_slice(node, a, s0.dim))
        return s0.moved(s0.dim + (stack and dim <= s0.dim))

    def _select(self, node: fx.Node):
        """select / index_select pick along one dim: not the split one."""
        s = self.place.get(node.args[0])
        if not isinstance(s, Shard):
            raise self._unsupported(node, "it indexes a replicated value with a split index")
        dim = node.args[1] % val(node.args[0]).dim()
        if dim == s.dim:
            raise self._unsupported(node, f"it indexes the split dim {dim}", s)
        if node.target == aten.select.int:
            return s.moved(s.dim - (dim < s.dim))
        return s

    def _repeat_interleave(self, node: fx.Node):
        s = self.place[node.args[0]]
        dim = node.args[2] % val(node).dim() if len(node.args) > 2 else None
        if dim == s.dim:  # GQA: each local KV head repeated for its local query heads
            return s.moved(dim, (val(node).shape[dim],))
        if dim is None:
            raise self._unsupported(node, "it flattens the split value", s)
        return s

    def _attention(self, node: fx.Node):
        q, k, v = (self.place.get(a) for a in node.args[:3])
        if not (isinstance(q, Shard) and q == k == v and q.dim < val(node).dim() - 2):
            raise self._unsupported(node, "query, key and value must be split alike over heads", q)
        mask = node.args[3] if len(node.args) > 3 else None
        if isinstance(mask, fx.Node) and not isinstance(self.place.get(mask), Shard):
            j = q.dim - (val(node).dim() - val(mask).dim())
            if j >= 0 and val(mask).shape[j] != 1:
                node.replace_input_with(mask, self._local_slice(node, mask, j))
        return q

    def _matmul(self, node: fx.Node):
        """The matmul family as einsum: a split dim that survives in the output (a batch
        dim such as heads, or a free dim) passes the split through, operands split alike;
        a replicated operand spanning it is cut to this rank's part. A contracting dim
        must not be split."""
        if node.target == aten.einsum.default:
            operands, (ins, out) = list(node.args[1]), _einsum_letters(node)
        else:
            operands = list(node.args[:2])
            ins, out = _matmul_letters(*(val(a).dim() for a in operands))
        split = None
        for a, letters in zip(operands, ins):
            p = self.place.get(a)
            if isinstance(p, list):
                raise self._unsupported(node, "it multiplies an unpacked list")
            if not isinstance(p, Shard):
                continue
            if letters[p.dim] not in out:
                raise self._unsupported(
                    node, f"it contracts dim {p.dim} of {a.name!r}, which is split over tp ranks "
                          "(a product over a split dim is a row-parallel linear's job)", p)
            if split is not None and (split[0] != letters[p.dim] or split[1].parts != p.parts):
                raise self._unsupported(node, "its operands are split differently", p)
            split = (letters[p.dim], p)
        letter, s = split
        for a, letters in zip(operands, ins):
            if isinstance(self.place.get(a), Shard) or letter not in letters:
                continue
            j = letters.index(letter)
            if val(a).shape[j] != 1:
                if len(s.parts) > 1:
                    raise self._unsupported(node, "a replicated operand spans a dim of fused blocks", s)
                node.replace_input_with(a, self._local_slice(node, a, j))
        return s.moved(out.index(letter))

    def _layer_norm(self, node: fx.Node):
        """layer_norm over a split last dim: mean and variance from tp all-reduced sums,
        then the affine weight and bias split like the features."""
        s, n = self.place[node.args[0]], val(node).dim()
        x, shape, w, b, eps = full_args(node)[:5]
        if s.dim < n - len(shape):
            return s
        if len(shape) != 1:
            raise self._unsupported(node, f"it normalizes over dims {list(range(n - len(shape), n))}, "
                                          f"split along dim {s.dim}", s)
        ops = []

        def add(target, *args):
            with self.g.inserting_before(node):
                ops.append(call(self.g, target, args, like=node))
            self.place[ops[-1]] = s if val(ops[-1]).dim() == n and val(ops[-1]).shape[-1] != 1 else None
            return ops[-1]

        def mean(v):
            local = add(aten.sum.dim_IntList, v, [-1], True)
            total = self._all_sum(local, node)
            return add(aten.div.Tensor, total, shape[0])

        xc = add(aten.sub.Tensor, x, mean(x))
        y = add(aten.mul.Tensor, xc, add(aten.rsqrt.default, add(aten.add.Tensor, mean(add(aten.mul.Tensor, xc, xc)), eps)))
        for p, op in ((w, aten.mul.Tensor), (b, aten.add.Tensor)):
            if p is not None:
                y = add(op, y, p)
                self._elementwise(y)
        node.replace_all_uses_with(y)
        self.g.erase_node(node)
        return s

    def _all_sum(self, local: fx.Node, like: fx.Node) -> fx.Node:
        """The sum of ``local`` over tp ranks: all-reduced forward (tp_reduce); backward,
        when its readers combine it with split values (a norm's statistic), each rank holds
        the gradient of its own part and tp_copy all-reduces it (``_check_statistics``
        drops that for readers that are all replicated)."""
        with self.g.inserting_after(local):
            copy = call(self.g, torch.ops.fxmeg.tp_copy.default, (local, TP), like=like)
        with self.g.inserting_after(copy):
            total = call(self.g, torch.ops.fxmeg.tp_reduce.default, (copy, TP), like=like)
        self.place[local] = self.place[copy] = "local"
        self.place[total] = None
        self.statistics.append((total, like))
        return total

    def _check_statistics(self) -> None:
        """The backward of each all-reduced statistic, by its readers: all of them reach a
        split value (a norm): this rank's part of the gradient, summed over ranks (kept
        tp_copy); none does (all replicated): the same gradient on every rank, passed as it
        is (tp_copy dropped: Megatron's g); some do and some not: refused."""
        for total, origin in self.statistics:
            split, whole, todo, seen = [], [], list(total.users), set()
            while todo:
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                p = self.place.get(n)
                if n.target in _SYNCED:  # a column-parallel input: its gradient is summed there
                    whole.append(n)
                elif isinstance(p, Shard):
                    split.append(n)
                elif p is None and n.op == "call_function" and n.users:
                    todo.extend(n.users)
                else:
                    whole.append(n)
            if split and whole:
                raise self._unsupported(
                    origin, f"the sum it takes over tp ranks is read both with split values (node "
                            f"{split[0].name!r}) and without (node {whole[0].name!r}), so its gradient "
                            "is neither this rank's part nor the whole", self.place.get(origin.args[0]))
            if not split:
                copy = total.args[0]
                total.replace_input_with(copy, copy.args[0])
                self.g.erase_node(copy)

    def _along(self, node: fx.Node, dims, what: str):
        s, n = self.place[node.args[0]], val(node).dim()
        dims = [dims] if isinstance(dims, int) else list(dims)
        if s.dim in {d % n for d in dims}:
            raise self._unsupported(node, f"it {what} dim {s.dim}, which is split over tp ranks", s)
        return s

    def _reduction(self, node: fx.Node):
        """Reductions (torch.Tag.reduction) by their ``dim`` argument: over other dims the
        split stays (moves); a sum or mean over the split dim is a local sum all-reduced
        over tp ranks (a mean divides it by the full size): RMSNorm's statistic."""
        s, n = self.place[node.args[0]], val(node.args[0]).dim()
        schema = [a.name for a in node.target._schema.arguments]
        dims = full_args(node)[schema.index("dim")] if "dim" in schema else None
        dims = list(range(n)) if dims is None or dims == [] else dims
        dims = sorted({d % n for d in ([dims] if isinstance(dims, int) else dims)})
        keepdim = val(node).dim() == n
        if s.dim not in dims:
            return s if keepdim else s.moved(s.dim - sum(d < s.dim for d in dims))
        sums = {aten.sum.dim_IntList: None, aten.sum.default: None,
                aten.mean.dim: aten.sum.dim_IntList, aten.mean.default: aten.sum.default}
        if node.target not in sums:
            raise self._unsupported(node, f"it reduces over dim {s.dim}, which is split over tp ranks "
                                          "(only a sum or a mean is all-reduced)", s)
        users = list(node.users)
        size = 1
        for d in dims:
            size *= val(node.args[0]).shape[d]
        out = self._all_sum(node, node)
        if sums[node.target] is not None:  # mean = all-reduced sum / full size
            node.target = sums[node.target]
            with self.g.inserting_after(out):
                out = call(self.g, aten.div.Tensor, (out, size), like=node)
            self.place[out] = None
        for user in users:
            user.replace_input_with(node, out)
        return "local"

    # ------------------------------------------------------------------ parameters

    def _whole(self, w: fx.Node, node: fx.Node) -> None:
        """``w`` is read whole by ``node`` (a replicated linear): it must not be split."""
        self.whole.setdefault(w.target, node)
        if w.target in self.specs:
            self._tied(w, self.specs[w.target])

    def _tied(self, w: fx.Node, split: tuple[int, tuple[int, ...]]) -> None:
        whole = self.whole[w.target]
        raise PassError(
            f"parameter {w.target!r} is split along dim {split[0]} in blocks {split[1]} for one "
            f"use but read whole by node {whole.name!r} (module {owning_module(whole)!r}), a "
            f"replicated linear (the LM head is found only when the loss reads its output "
            f"through views, casts and pointwise ops); set tp_plan for "
            f"{owning_module(whole)!r} to 'vocab' or 'colwise', or tp=1"
        )

    def _spec(self, w: fx.Node, dim: int, parts: tuple[int, ...], node: fx.Node) -> None:
        assert w.op == "get_attr", f"{node.name}: weight is not a parameter"
        spec = (dim, parts)
        if w.target in self.whole:
            self._tied(w, spec)
        if self.specs.setdefault(w.target, spec) != spec:
            raise PassError(
                f"parameter {w.target!r} is read by node {node.name!r} (module "
                f"{owning_module(node)!r}) split along dim {dim} in blocks {parts}, but "
                f"elsewhere along dim {self.specs[w.target][0]} in blocks "
                f"{self.specs[w.target][1]}; tie it only between uses split alike, or "
                f"set tp_plan for one of them to 'replicate'"
            )

    def _tag_parameters(self) -> None:
        for node in self.g.nodes:
            if node.op != "get_attr" or not isinstance(val(node), torch.Tensor):
                continue
            if node.target in self.specs:
                dim, parts = self.specs[node.target]
                node.meta["fxmeg"]["tp"] = ("shard", dim, parts)
                node.meta["val"] = _local_fake(val(node), dim, self.tp)
            elif getattr(attr(self.gm, node.target), "requires_grad", False):
                node.meta["fxmeg"]["tp"] = ("replicate", self._touches_split(node))

    def _touches_split(self, param: fx.Node) -> bool:
        """True when the parameter's gradient differs per tp rank: it reaches a split or
        sliced value through replicated ops, with no collective in between."""
        todo, seen = list(param.users), set()
        while todo:
            n = todo.pop()
            if n in seen or n.target in _SYNCED:
                continue
            seen.add(n)
            p = self.place.get(n)
            if isinstance(p, (Shard, list)) or p == "local":
                return True
            if p is None:
                todo.extend(n.users)
        return False

    def _refresh_values(self) -> None:
        for node in self.g.nodes:
            if node.op == "call_function":
                try:
                    node.meta["val"] = fake_eval(node)
                except Exception as exc:
                    raise PassError(
                        f"after tensor-parallel rewriting, node {node.name!r} (module "
                        f"{owning_module(node)!r}, {node.target}) no longer type-checks: {exc}"
                    ) from exc

    # ------------------------------------------------------------------ errors

    def _check_divides(self, node: fx.Node, size: int, what: str, fix: str | None = None) -> None:
        if size % self.tp:
            choose = [d for d in divisors(size) if d > 1] or [1]
            raise PassError(
                f"tp={self.tp} does not divide the {size} {what} at node {node.name!r} (module "
                f"{owning_module(node)!r}); {fix or f'choose tp in {choose}'}"
            )

    def _unsupported(self, node: fx.Node, why: str, s=None, fix: str | None = None) -> PassError:
        module = owning_module(node)
        op = getattr(node.target, "__name__", str(node.target))
        where, default = "", "use tp=1 or set tp_plan for the linears around it"
        if isinstance(s, Shard):
            where = f" (split along dim {s.dim} by module {s.origin!r})"
            glob = re.sub(r"\.\d+\.", ".*.", s.origin)
            default = f"keep that module whole with tp_plan={{{glob!r}: 'replicate'}}, or use tp=1"
        fix = fix or default
        return PassError(
            f"cannot split node {node.name!r} ({op}, module {module!r}) over tp={self.tp} "
            f"ranks{where}: {why}. Fix: {fix}"
        )


def _dim(node: fx.Node, ndim: int) -> int:
    args = full_args(node)
    return args[2] % ndim


def _bounds(start, end, size: int) -> tuple[int, int]:
    """A slice's [start, end) within a dim of ``size``, as Python clamps it."""
    start = 0 if start is None else start + size if start < 0 else start
    end = size if end is None else end + size if end < 0 else end
    return min(max(start, 0), size), min(max(end, 0), size)


def _matmul_letters(ra: int, rb: int) -> tuple[list[str], str]:
    """torch.matmul of operands of ranks ``ra`` and ``rb`` as einsum letters: batch dims
    broadcast from the right, ``k`` contracted."""
    nb = max(ra - 2, rb - 2, 0)
    batch = "abcdefgh"[:nb]
    a = "k" if ra == 1 else batch[nb - (ra - 2):] + "mk"
    b = "k" if rb == 1 else batch[nb - (rb - 2):] + "kn"
    return [a, b], batch + ("m" if ra > 1 else "") + ("n" if rb > 1 else "")


def _einsum_letters(node: fx.Node) -> tuple[list[str], str]:
    """An einsum's operand and output letters, '...' spelled out (in capitals)."""
    eq, operands = node.args[0].replace(" ", ""), node.args[1]
    ins, _, out = eq.partition("->")
    ins = ins.split(",")
    if not _:
        out = "".join(sorted(c for c in set("".join(ins)) if "".join(ins).count(c) == 1 and c != "."))
    ell = max(val(a).dim() - len(t.replace("...", "")) for a, t in zip(operands, ins))
    caps = "ABCDEFGH"[:ell]

    def spell(t, rank):
        k = rank - len(t.replace("...", ""))
        return t.replace("...", caps[ell - k:] if k else "")

    return [spell(t, val(a).dim()) for a, t in zip(operands, ins)], spell(out, val(node).dim())


def _reaches_placeholder(node: fx.Node) -> bool:
    todo = [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        todo.extend(n.all_input_nodes)
    return False


def _local_fake(full: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    """A fake tensor like ``full`` with ``dim`` cut to one tp rank's share."""
    from torch._guards import detect_fake_mode

    shape = list(full.shape)
    shape[dim] //= tp
    with detect_fake_mode([full]):
        return full.new_empty(shape)
