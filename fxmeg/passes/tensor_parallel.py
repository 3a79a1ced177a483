"""Tensor-parallel pass: Megatron's column / row-parallel linears, vocabulary-parallel
embedding and cross-entropy, and sequence parallelism, found on the ATen graph. The driver
is the one sharding propagation (fxmeg/passes/propagation.py) configured for tp: values
split over tp ranks are ``Shard`` s; its rules by op family are here and in tp_rules.py,
tp_rules_more.py, tp_channels.py; the whole contract, op by op: docs/architecture.md §8.10.

Requires: the loss pass's ``(loss_sum, num_tokens)`` outputs.
Ensures, for every tp rank alike (the graph holds no rank; ``fxmeg::`` ops on the group
"tp" do what differs): linears in blocks column- or row-parallel (``tp_plan`` overrides),
routers and their expert banks whole (said aloud), the vocabulary split in the embedding,
LM head and loss, every other op carrying the split by its family; random ops on split
values drawing from this rank's stream; each trainable parameter's get_attr tagged
``meta["fxmeg"]["tp"]`` (``Shard`` or ``Replicate(reduce_grad)``); ``meta["val"]`` local.
Anything it cannot split exactly is a PassError naming the node, module, numbers and fix.
"""

from __future__ import annotations

import fnmatch
import operator
import re

import torch
from torch import fx

from fxmeg.config import ParallelConfig
from fxmeg.errors import PassError
from fxmeg.frontend.capture import owning_module
from fxmeg.ir import ops as fxmeg_ops
from fxmeg.ir.layouts import LOCAL, PARTIAL, Replicate, Shard
from fxmeg.ir.ops import TP
from fxmeg.ir.tags import set_tag, tag
from fxmeg.passes.graph_utils import attr, call, finish, full_args, val
from fxmeg.passes.op_rules import LINEAR_SLOTS, SHAPE_ARGUMENT, in_family, rule
from fxmeg.passes.partition import find_blocks
from fxmeg.passes.propagation import UNDECIDED, Propagation
from fxmeg.passes.tp.blocks import split_edges
from fxmeg.passes.tp.channels import ChannelRules
from fxmeg.passes.tp.experts import ExpertBlocks
from fxmeg.passes.tp.heads import (
    check_kv_readers,
    kv_linear,
    kv_replicas,
    linears_from_products,
    say_whole_projections,
)
from fxmeg.passes.tp.latent import shared_by_heads
from fxmeg.passes.tp.moe import from_whole, say_what_stays_whole, scores_features
from fxmeg.passes.tp.placement import divisors
from fxmeg.passes.tp.rules import PropagationRules
from fxmeg.passes.tp.rules_more import MoreRules, fused_view
from fxmeg.torch_private import detect_fake_mode

aten = torch.ops.aten
ROLES = ("colwise", "rowwise", "replicate", "vocab")
# Ops are handled by kind, not one by one: fxmeg/passes/op_rules.py finds each op's family
# (by tags, schemas, explicit entries) and the rule this pass registered for it
# (``@rule(TP, ...)`` here and in tp_rules.py).


def tensor_parallel(gm: fx.GraphModule, parallel: ParallelConfig) -> fx.GraphModule:
    """Shard ``gm`` over ``parallel.tp`` ranks (see the module docstring)."""
    par = parallel
    if par.tp == 1:
        return gm
    _TensorParallel(gm, par.tp, dict(par.tp_plan), par.sequence_parallel, ep=par.ep,
                    expert_tp=par.expert_tp).run()
    return finish(gm)


class _TensorParallel(Propagation, PropagationRules, MoreRules, ChannelRules):
    """The driver configured for tp: values split over tp ranks are ``Shard`` s."""

    axis, title, split_kinds, split_phrase = TP, "tensor-parallel", (Shard,), "over tp ranks"

    def __init__(self, gm, tp, plan, sp, *, ep: int = 1, expert_tp: int = 1):
        super().__init__(gm, tp)
        self.tp, self.sp, self.ep = tp, sp, ep
        for glob, role in plan.items():
            if role not in ROLES:
                raise PassError(f"tp_plan[{glob!r}] = {role!r} is not one of {ROLES}")
        self.plan = plan
        self.specs: dict[str, Shard] = {}  # param -> its split
        self.whole: dict[str, fx.Node] = {}  # param -> a replicated linear reading it
        self.entries: dict[fx.Node, fx.Node] = {}
        self.whole_entries: dict[fx.Node, fx.Node] = {}  # sequence split -> sp_whole (tp_moe)
        self.statistics: list[tuple[fx.Node, fx.Node]] = []  # all-reduced sums (norms)
        self.reductions: list[tuple[fx.Node, fx.Node]] = []  # row-parallel outputs' tp_reduce
        self.routers: list[str] = []  # modules of linears kept whole by kind (tp_moe)
        self.kv_weights: dict[str, str] = {}  # replicated key/value weight -> its heads (tp_heads)
        self.kv_outputs: list[fx.Node] = []
        linears_from_products(gm)  # x @ w.T is a linear (tp_heads)
        self.rejoined: list[str] = []  # ... and of those whose output rejoins their input
        self.latents: list[str] = []  # ... and of down projections shared by heads (tp_latent)
        self.ancestors: dict[fx.Node, set[fx.Node]] = {}
        self.block = find_blocks(gm)
        self.vocab, self.head = self._find_head()
        self.seq_dim = 1
        # grouped experts split over tp (tp_experts), under sp too (their tokens gathered whole)
        self.experts = ExpertBlocks(self) if expert_tp > 1 else None

    def before_rules(self, node: fx.Node, places):
        if self.experts is not None and self.experts.owns(node):
            return self.experts.place(node)
        return UNDECIDED

    # ------------------------------------------------------------------ driver

    def run(self) -> None:
        self.heads = kv_replicas(self)  # key/value heads fewer than tp: replicated (tp_heads)
        self.propagate()
        self._check_statistics()
        check_kv_readers(self)
        self._per_rank_streams()
        self._tag_parameters()
        say_whole_projections(self)  # never silent: tp_heads
        say_what_stays_whole(self.tp, self.routers, {  # never silent: tp_moe
            n.target: val(n) for n in self.g.nodes if isinstance(tag(n, "tp"), Replicate)},
            ep=self.ep)
        self.refresh()

    def _per_rank_streams(self) -> None:
        """Megatron's model-parallel RNG tracker: a random op whose output is split over tp
        ranks (attention heads, a column-parallel output, a sequence-parallel slice of the
        residual stream) draws between ``tp_rng_fork`` and ``tp_rng_join``, from this
        rank's stream, so no two ranks use one mask for different heads or positions; one
        on a replicated value keeps the default stream, the same on every rank."""
        for gm in self.graphs():  # region bodies draw too
            with self.inside(gm):
                self._streams_of_graph()

    def _streams_of_graph(self) -> None:
        for node in list(self.g.nodes):
            if node.op != "call_function":
                continue
            if node.target == aten.scaled_dot_product_attention.default:
                if not full_args(node)[4]:  # dropout_p
                    continue
            elif not in_family(node.target, "random"):
                continue
            elif node.target in (aten.dropout.default, aten.native_dropout.default):
                p, train = full_args(node)[1:3]
                if not p or train is False:  # draws nothing
                    continue
            p = self.place.get(node)
            if isinstance(p, list):
                p = next((q for q in p if q is not None), None)
            if not (isinstance(p, Shard) or p is LOCAL):
                continue
            x = node.args[0]
            with self.g.inserting_before(node):
                fork = call(self.g, fxmeg_ops.tp_rng_fork, (x,), {"group": TP}, like=node)
            node.replace_input_with(x, fork)
            users = list(node.users)
            with self.g.inserting_after(node):
                join = call(self.g, fxmeg_ops.tp_rng_join, (node,), {"group": TP}, like=node)
            for user in users:
                user.replace_input_with(node, join)
            self.place[fork], self.place[join] = self.place.get(x), self.place[node]

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
        x = self.place.get(node.args[LINEAR_SLOTS[node.target].x])
        if isinstance(x, Shard) and not x.seq:
            return "rowwise"
        if scores_features(node):  # a router or a one-feature gate (tp_moe)
            self.routers.append(module)
            return "replicate"
        if self._rejoins_its_input(node):
            self.rejoined.append(module)
            return "replicate"
        if shared_by_heads(node):  # MLA's down projections (tp_latent)
            self.latents.append(module)
            return "replicate"
        return "colwise"

    @rule(TP, "linear", "matmul", always=True)
    def _product(self, node: fx.Node):
        """A product whose weight operand is a parameter is a linear (column-, row- or
        vocab-parallel, or replicated, even on replicated input); any other product of
        split values follows the matmul family's rule."""
        if node in self.heads:  # a key/value replica or the query block of a fused projection
            return kv_linear(self, node)
        slots = LINEAR_SLOTS.get(node.target)
        if (
            slots is not None
            and isinstance(w := node.args[slots.weight], fx.Node)
            and w.op == "get_attr"
        ):
            return self._linear(node)
        if not any(isinstance(self.place.get(a), (Shard, list)) for a in node.all_input_nodes):
            return None
        if slots is not None and self._computed_weight(node, slots):
            bias = (
                node.args[slots.bias]
                if slots.bias is not None and len(node.args) > slots.bias
                else None
            )
            self._slice_weight(node, slots)
            return self._reduce(node, bias=bias)
        if not in_family(node.target, "matmul"):
            split = next(
                (p for p in map(self.place.get, node.all_input_nodes) if isinstance(p, Shard)), None
            )
            inside = " (in a region's body, as here, a parameter is an operand of the region)"
            raise self.refuse(node, "a linear whose weight is not a parameter reads a split value"
                                          + (inside if self.g in self.regions else ""), split)
        return self._matmul(node)

    def _computed_weight(self, node: fx.Node, slots) -> bool:
        """A linear whose weight is a replicated value computed in the graph (one expert's
        matrix picked from a 3-D bank: JetMoE's attention experts), reading an input split
        on its features."""
        x, w = node.args[slots.x], node.args[slots.weight]
        px = self.place.get(x)
        return (isinstance(w, fx.Node) and self.place.get(w) is None and isinstance(px, Shard)
                and px.dim == val(x).dim() - 1 and not px.seq)

    def _slice_weight(self, node: fx.Node, slots) -> None:
        """Cut a ``_computed_weight`` to this rank's input features: the output becomes a
        partial sum (the caller's ``_reduce``, after which the bias goes) and the bank's
        gradient, this rank's columns, is summed over tp (``Replicate(reduce_grad)``)."""
        x, w = node.args[slots.x], node.args[slots.weight]
        w = self._local_slice(node, w, 1 - slots.out_dim, self.place[x])
        node.args = (x, w) if node.target == aten.addmm.default else (*node.args[:slots.weight], w)
        if node.target == aten.addmm.default:
            node.target = aten.mm.default

    def _linear(self, node: fx.Node):
        slots = LINEAR_SLOTS[node.target]
        xi, wi, bi, out_dim = slots.x, slots.weight, slots.bias, slots.out_dim
        x, w = node.args[xi], node.args[wi]
        b = node.args[bi] if bi is not None and len(node.args) > bi else None
        role, px = self._role(node), self.place.get(x)
        if role == "replicate":
            if isinstance(px, Shard) and not px.seq:
                raise self.refuse(
                    node, "a replicated linear reads a value split over its features", px
                )
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
            return Shard(
                val(node).dim() - 1, parts, vocab=role == "vocab", origin=owning_module(node)
            )
        if not (isinstance(px, Shard) and px.dim == val(x).dim() - 1 and not px.seq):
            raise self.refuse(
                node, "a row-parallel linear needs its input split on its last dim", px
            )
        self._spec(w, 1 - out_dim, px.parts, node)
        if node.target == aten.addmm.default:  # the bias goes after the reduction
            node.target, node.args = aten.mm.default, (x, w)
        else:
            node.args = (x, w)
        return self._reduce(node, bias=b)

    def _parts(self, node: fx.Node, out: int) -> tuple[int, ...]:
        """Blocks of a fused output: the runs between the bounds at which splits and
        slices along its last dim cut it, there or downstream (tp_blocks: Mamba's
        in_proj cut into [z, xBC, dt], xBC convolved, then cut into [x, B, C]); else
        equal blocks a view unpacks (after reshapes that keep that dim, as Conv1D's)."""
        edges = split_edges(node, val(node).dim() - 1)
        if edges:
            return tuple(e - b for b, e in zip([0, *edges], [*edges, out]))
        todo = [node]
        while todo:
            n = todo.pop()
            for user in n.users:
                if user.target in SHAPE_ARGUMENT and val(user).shape[-1] == out:
                    todo.append(user)
                elif user.target in SHAPE_ARGUMENT and (count := fused_view(user, out)):
                    return (out // count,) * count  # (..., 3, heads, head_dim), q / k / v unpacked
        return (out,)

    def _entry(self, node: fx.Node, x: fx.Node) -> fx.Node:
        """The replicated input of column-parallel linears, through Megatron's f (or an
        all-gather of the sequence shard); one per input value."""
        if x not in self.entries:
            px = self.place.get(x)
            if isinstance(px, Shard) and px.seq:
                self.entries[x] = self.move(x, "seq", "replicated", dim=px.dim, at=node)
            else:
                self.entries[x] = self.move(x, "replicated", "synced", at=node)
            self.place[self.entries[x]] = None
        return self.entries[x]

    def _reduce(self, node: fx.Node, *, bias: fx.Node | None):
        """Sum a partial output over tp ranks (or reduce-scatter it along the sequence),
        then add the bias; later readers see the result."""
        users = list(node.users)
        if self.sp and not from_whole(self, node):  # tokens gathered whole: all-reduced (tp_moe)
            red = self.move(node, "partial", "seq", dim=self.seq_dim, at=node, after=True)
            place = Shard(
                self.seq_dim, (val(node).shape[self.seq_dim],), seq=True, origin=owning_module(node)
            )
        # Megatron's g; summed backward too where only split values read it (_check_statistics)
        else:
            red, place = self.move(node, "partial", "replicated", at=node, after=True), None
            self.reductions.append((red, node))
        self.place[red] = place
        out = red
        if bias is not None:
            with self.g.inserting_after(red):
                out = call(self.g, aten.add.Tensor, (red, bias), like=node)
            self.place[out] = place
        for user in users:
            user.replace_input_with(node, out)
        return PARTIAL

    # ------------------------------------------------------------------ vocabulary

    def _find_head(self) -> tuple[int | None, fx.Node | None]:
        """Vocabulary size and LM head: the linear whose output feeds the class loss."""
        loss = next((n for n in self.g.nodes if n.target == aten.cross_entropy_loss.default), None)
        if loss is None:
            return None, None
        x = loss.args[0]
        while x.op == "call_function" and (in_family(x.target, "view", "copy") or (
                in_family(x.target, "pointwise") and len(x.all_input_nodes) == 1)):
            x = x.args[0]  # through casts and pointwise ops of the logits alone (softcapping)
        vocab = val(loss.args[0]).shape[1]
        return vocab, (
            x if x.target == aten.linear.default and val(x.args[1]).shape[0] == vocab else None
        )

    @rule(TP, "embedding", always=True)
    def _embedding(self, node: fx.Node):
        w, ids = node.args[0], node.args[1]
        rows = val(w).shape[0]
        role = self._embedding_role(node, rows)
        if role == "replicate":
            return None
        self._check_divides(
            node,
            rows,
            "vocabulary rows of the embedding",
            f"pad the vocabulary to a multiple of {self.tp} (e.g. {-(-rows // self.tp) * self.tp})",
        )
        self._spec(w, 0, (rows,), node)
        _, _, padding_idx, by_freq, sparse = full_args(node)[:5]
        if by_freq or sparse:
            raise self.refuse(
                node,
                "scale_grad_by_freq or sparse gradients over a split vocabulary "
                "are not implemented",
            )
        with self.g.inserting_before(node):
            both = call(
                self.g,
                torch.ops.fxmeg.vocab_shard_ids.default,
                (ids, rows // self.tp, TP),
                like=node,
            )
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
            self._check_divides(
                node, val(node).shape[self.seq_dim], "sequence length (sequence parallelism)"
            )
        self.place[zeroed] = PARTIAL
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

    @rule(TP, "loss")
    def _loss(self, node: fx.Node):
        """Cross-entropy over vocabulary-split logits is vocabulary-parallel; no other
        loss reads a split value."""
        if node.target == aten.cross_entropy_loss.default and isinstance(
            self.place.get(node.args[0]), Shard
        ):
            return self._vocab_loss(node)
        raise self.refuse(node, "a loss reads a value split over tp ranks (only cross_entropy over "
                                      "vocabulary-split logits is split)")

    def _vocab_loss(self, node: fx.Node):
        logits, target = node.args[0], node.args[1]
        args = full_args(node)
        if args[5] != 0.0:
            raise self.refuse(node, "label smoothing over a split vocabulary is not implemented")
        if val(logits).dim() != 2 or self.place[logits].dim != 1:
            raise self.refuse(
                node, "the vocabulary-parallel loss needs (tokens, vocabulary) logits"
            )
        with self.g.inserting_before(node):
            both = call(self.g, torch.ops.fxmeg.vocab_parallel_cross_entropy.default,
                        (logits, target, args[4], TP), like=node)
            per_token = call(self.g, operator.getitem, (both, 0), like=node)
            loss_sum = call(self.g, aten.sum.default, (per_token,), like=node)
        set_tag(loss_sum, "loss", tag(node, "loss", "sum"))
        node.replace_all_uses_with(loss_sum)
        return None

    # ------------------------------------------------------------------ parameters

    def _whole(self, w: fx.Node, node: fx.Node) -> None:
        """``w`` is read whole by ``node`` (a replicated linear): it must not be split."""
        self.whole.setdefault(w.target, node)
        if w.target in self.specs:
            self._tied(w, self.specs[w.target])

    def _tied(self, w: fx.Node, split: Shard) -> None:
        whole = self.whole[w.target]
        raise PassError(
            f"parameter {w.target!r} is split along dim {split.dim} in blocks {split.parts} for "
            f"one use but read whole by node {whole.name!r} (module {owning_module(whole)!r}), a "
            "replicated linear (the LM head is found only when the loss reads its output through "
            f"views, casts and pointwise ops); set tp_plan for {owning_module(whole)!r} to 'vocab' "
            "or 'colwise', or tp=1"
        )

    def _spec(self, w: fx.Node, dim: int, parts: tuple[int, ...], node: fx.Node) -> None:
        if w.op != "get_attr":  # a region's operand inside its body (propagation.enter)
            raise self.refuse(node, f"it would split {w.name!r}, which is not a parameter here "
                                          "(a parameter reaches a region's body as an operand)")
        spec = Shard(dim, parts)
        if w.target in self.whole:
            self._tied(w, spec)
        if self.specs.setdefault(w.target, spec) != spec:
            raise PassError(
                f"parameter {w.target!r} is read by node {node.name!r} (module "
                f"{owning_module(node)!r}) split along dim {dim} in blocks {parts}, but "
                f"elsewhere along dim {self.specs[w.target].dim} in blocks "
                f"{self.specs[w.target].parts}; tie it only between uses split alike, or "
                f"set tp_plan for one of them to 'replicate'"
            )

    def _tag_parameters(self) -> None:
        for node in self.g.nodes:
            if node.op != "get_attr" or not isinstance(val(node), torch.Tensor):
                continue
            if node.target in self.specs:
                split = self.specs[node.target]
                set_tag(node, "tp", split)
                node.meta["val"] = _local_fake(val(node), split, self.tp)
            elif getattr(attr(self.gm, node.target), "requires_grad", False):
                set_tag(node, "tp", Replicate(self._touches_split(node)))

    def _touches_split(self, param: fx.Node) -> bool:
        """True when the parameter's gradient differs per tp rank: it reaches a split or
        sliced value through replicated ops, with no collective in between."""
        return any(kind == "split" for kind, _ in self._gradient_readers(param))

    # ------------------------------------------------------------------ errors

    def _check_divides(self, node: fx.Node, size: int, what: str, fix: str | None = None) -> None:
        if size % self.tp:
            choose = [d for d in divisors(size) if d > 1] or [1]
            raise PassError(
                f"tp={self.tp} does not divide the {size} {what} at node {node.name!r} (module "
                f"{owning_module(node)!r}); {fix or f'choose tp in {choose}'}"
            )

    def where(self, split) -> str:
        return (
            f" (split along dim {split.dim} by module {split.origin!r})"
            if isinstance(split, Shard)
            else ""
        )

    def default_fix(self, node: fx.Node, split) -> str:
        """Keep whole the module that split the value (its parent, when the op is the
        parent's own arithmetic on its projections, as DiffLlama's chunk of heads)."""
        if not isinstance(split, Shard):
            return "use tp=1 or set tp_plan for the linears around it"
        module = owning_module(node)
        if module and split.origin.startswith(module + "."):
            block = re.sub(r"\.\d+(\.|$)", r".*\1", module)
            return (
                f"keep module {block!r} whole with tp_plan={{{block + '.*'!r}: 'replicate'}} (its "
                "other linears compute with the same split values), or use tp=1"
            )
        glob = re.sub(r"\.\d+\.", ".*.", split.origin)
        return f"keep that module whole with tp_plan={{{glob!r}: 'replicate'}}, or use tp=1"


def _reaches_placeholder(node: fx.Node) -> bool:
    todo = [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        todo.extend(n.all_input_nodes)
    return False


def _local_fake(full: torch.Tensor, split: Shard, tp: int) -> torch.Tensor:
    """A fake tensor like ``full`` with its split dim cut to one tp rank's share."""
    with detect_fake_mode([full]):
        return full.new_empty(split.local_shape(full.shape, tp))
