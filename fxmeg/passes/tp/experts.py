"""Expert tensor parallelism: each routed expert's MLP split over tp ranks as a dense MLP
is (Megatron-Core's ``expert_tensor_parallel_size`` = tp, its default).

Batched experts (Llama 4's) split alike, the hidden states and scores entering through f
(docs/parallelism.md, "Expert parallelism").

A Hugging Face grouped-experts block (recognised as the expert-parallel pass recognises it:
fxmeg/passes/expert_parallel.py ``routed_blocks``) runs ``rows @ W_up[e]``, the model's
activation, then ``@ W_down[e]`` with one grouped matmul each. Under expert tp:

- the up bank is split along its output features, in the blocks the activation cuts it
  into (gate and up of a fused ``gate_up_proj``: this rank's tp-th of each), its bias bank
  alike: the first grouped matmul is column-parallel, its rows entering through
  Megatron's f (identity forward, gradients summed over tp backward), placed on the
  tokens the rows are gathered from, so that only the experts' share of their gradient is
  summed; the routing weights, which multiply the rows while they are partial sums, enter
  through f as well (each rank's part of their gradient is its experts' share);
- the activation runs per feature on this rank's share;
- the down bank is split along its input features: the second grouped matmul is
  row-parallel, its output a partial sum over tp ranks. Every op from there to the
  block's result (the sum of each token's k weighted rows) is linear in it, so the one
  all-reduce (Megatron's g) goes after the result, on [tokens, hidden], where Megatron's
  expert-tp reduces too. A down bias (GPT-OSS) must be added once: the sum then goes right
  after the grouped matmul, before the bias, on every routed row (at ep > 1 the
  expert-parallel pass folds that sum into the routed-experts op: its ``down_sum``).

The banks' splits are the ``Shard`` s of their get_attr nodes (dim 1 or 2 of [E, ., .]);
dim 0 stays whole for expert parallelism (``ExpertShard``), which composes with it. The
expert-parallel pass, which runs later on each chunk, takes the block as it is: the f is
on its input, the g after its result.
"""

from __future__ import annotations

import torch
from torch import fx

from fxmeg.frontend.capture import owning_module
from fxmeg.ir.layouts import Shard
from fxmeg.passes.expert_parallel import CASTS, is_grouped_mm, routed_blocks
from fxmeg.passes.graph_utils import source, val

aten = torch.ops.aten
_LINEAR_IN_ROWS = {
    aten.mul.Tensor, aten.index.Tensor, aten.view.default, aten.reshape.default,
    aten.unsqueeze.default, aten.sum.dim_IntList, aten.index_add.default, aten.index_add_.default,
    aten.scatter_add.default, aten.scatter_add_.default, aten.clone.default,
    aten.contiguous.default, *CASTS,
}
"""Ops from the down grouped matmul to the block's result that may carry a partial sum:
each is linear in it (a product with a routing weight, a gather, a view, a sum)."""


class ExpertBlocks:
    """The grouped-experts blocks of the graph ``tp`` walks, by their two grouped matmuls."""

    def __init__(self, tp) -> None:
        self.tp = tp
        blocks = [b for b in routed_blocks(tp.gm, strict=False)
                  if is_grouped_mm(b.up) or b.scores is not None]  # grouped or batched
        self.ups = {b.up: b for b in blocks}
        self.downs = {b.down: b for b in blocks}

    def owns(self, node: fx.Node) -> bool:
        return node in self.ups or node in self.downs

    def place(self, node: fx.Node):
        """The placement of a block's grouped matmul (module docstring)."""
        return self._up(node, self.ups[node]) if node in self.ups else self._down(
            node, self.downs[node])

    def _up(self, node: fx.Node, block) -> Shard:
        tp = self.tp
        out = val(node).shape[-1]
        parts = tp._parts(node, out)
        for p in parts:
            tp._check_divides(node, p, "output features of the experts' first matmul",
                              fix="choose tp among the divisors of the experts' intermediate "
                              "size, or expert_tensor_parallel_size=1 (experts whole on every "
                              "tp rank)")
        bank, dim = _bank_dim(node.args[1], view_dim=2)
        tp._spec(bank, dim, parts, node)
        split = Shard(val(node).dim() - 1, parts, origin=owning_module(node))
        if block.b_up is not None:  # its rows, gathered before this matmul, are split alike
            tp._spec(block.b_up, 1, parts, node)
            tp.place[next(a for a in block.up_out.args if a is not node)] = split
        inside = block.inner()
        if block.scores is not None:  # batched: every expert's slot of every token, scaled
            for value in (block.hidden, block.scores):  # before the matmul by the scores
                _synced(tp, value, [u for u in value.users if u in inside])
            return split
        rows = source(node.args[0], CASTS)  # hidden[tokens of the sorted (token, slot) pairs]
        _synced(tp, block.hidden, [rows])
        if block.b_down is None:  # the weights multiply the partial rows (_down)
            _synced(tp, block.top_k_weights, [u for u in block.top_k_weights.users if u in inside])
        return split

    def _down(self, node: fx.Node, block):
        tp = self.tp
        px = tp.place.get(node.args[0])
        if not (isinstance(px, Shard) and px.dim == val(node.args[0]).dim() - 1):
            raise tp.refuse(node, "the experts' second matmul reads rows not split on their "
                            "features (the activation between the experts' matmuls mixes them)",
                            px, fix="expert_tensor_parallel_size=1")
        bank, dim = _bank_dim(node.args[1], view_dim=1)
        tp._spec(bank, dim, px.parts, node)
        if block.b_down is not None:  # added once: sum before it
            return tp._reduce(node, bias=None)
        _check_linear(tp, node, block.result)
        red = tp.move(block.result, "partial", "replicated", at=block.result, after=True)
        for user in list(block.result.users):
            if user is not red:
                user.replace_input_with(block.result, red)
        tp.place[red] = None
        tp.reductions.append((red, block.result))
        return None  # a partial sum until ``red``: every op up to the result is linear in it


def _synced(tp, value: fx.Node, readers: list[fx.Node]) -> None:
    """``readers`` read ``value`` through Megatron's f: their gradients, each rank's share of
    the experts', are summed over tp."""
    f = tp.move(value, "replicated", "synced", at=value, after=True)
    for reader in readers:
        reader.replace_input_with(value, f)
    tp.place[f] = None


def _bank_dim(w: fx.Node, *, view_dim: int) -> tuple[fx.Node, int]:
    """(the bank's get_attr, the dim of the bank that is ``view_dim`` of ``w``, a view of it
    through a transpose of its last two dims or none)."""
    if w.op == "call_function" and w.target is aten.transpose.int:
        bank = w.args[0]
        dims = sorted(d % 3 for d in w.args[1:3])
        return bank, ({dims[0]: dims[1], dims[1]: dims[0]}.get(view_dim, view_dim))
    return w, view_dim


def _check_linear(tp, down: fx.Node, result: fx.Node) -> None:
    """Every op from ``down`` to ``result`` reading the partial sum is linear in it
    (``_LINEAR_IN_ROWS``; a product's other factor computed without it)."""
    reached, todo = set(), [down]
    while todo:
        n = todo.pop()
        if n in reached or n is result:
            continue
        reached.add(n)
        todo.extend(n.users)
    for n in reached - {down}:
        linear = n.target in _LINEAR_IN_ROWS and not (
            n.target is aten.mul.Tensor and all(a in reached for a in n.all_input_nodes))
        if not linear:
            raise tp.refuse(n, "the experts' partial output (row-parallel over tp) reaches an op "
                            "that is not linear in it before the tokens' sum",
                            fix="expert_tensor_parallel_size=1")
