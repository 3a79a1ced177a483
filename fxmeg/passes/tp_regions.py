"""Tensor parallelism inside higher-order regions: export keeps ``torch.autocast``,
``torch.no_grad()`` and ``wrap`` regions as one node (``wrap_with_autocast``,
``wrap_with_set_grad_enabled``, ``wrap``, ``tag_activation_checkpoint``) that calls a body
GraphModule on its operands (``graph_utils.body_call``). One mechanism serves every such
kind; the region's context (autocast, grad mode) does not change how a split travels.

``RegionRules`` is mixed into the tensor-parallel pass's ``_TensorParallel``, as
``tp_rules.PropagationRules`` is. A region that reads a split value is entered:
  * each body placeholder takes the place of the operand bound to it;
  * the pass's own rules run over the body's nodes with the body as the pass's graph
    (``_inside``), so collectives, ``tp_slice`` and rewritten shape arguments land in the
    body, and regions nested in it are entered the same way;
  * the region's outputs (its ``getitem`` users) take the places of the body's results;
  * after the pass, each entered body's placeholders get their operands' local fake
    values, its nodes are re-evaluated on them and it is recompiled, then the region node
    itself is re-evaluated (``_refresh_region``).
A region whose operands are all replicated is not entered: it stays as it is. What a body
cannot do is refused by the rule that meets it, naming the body's node and its module:
a linear inside a region reading a split value (its weight reaches the body as an
operand, not as a parameter), a region whose body another region also calls, and a
higher-order op that is not wrap-style (``cond``, ``map``: their bodies run on other
arguments).
"""

from __future__ import annotations

import contextlib
import operator

from torch import fx

from fxmeg.layouts import Shard
from fxmeg.passes.graph_utils import body_call, fake_eval, finish, is_subgraph, without_grad


class RegionRules:
    def _region(self, node: fx.Node) -> list:
        """Enter region ``node`` (it reads a split value): its outputs' places, a list
        (one per body result) that its ``getitem`` users pick from."""
        split = next((p for p in map(self.place.get, node.all_input_nodes) if isinstance(p, Shard)), None)
        found = body_call(node)
        if found is None:
            raise self._unsupported(
                node, f"it is a higher-order op ({node.target.name()}) that reads a value split over tp "
                      "ranks, and only wrap-style regions (autocast, no-grad, wrap) are split inside", split)
        body, operands = found
        getter = next(a for a in node.args if isinstance(a, fx.Node) and is_subgraph(a))
        callers = [n for n in self.g.nodes if n.op == "get_attr" and n.target == getter.target]
        if len(callers) > 1 or len(getter.users) > 1:
            raise self._unsupported(node, f"its body {getter.target!r} is also called by another region, "
                                          "which may read values split differently", split)
        placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
        for p, a in zip(placeholders, operands):
            self.place[p] = self.place.get(a) if isinstance(a, fx.Node) else None
        self.regions[body.graph] = node
        with self._inside(body):
            for n in list(body.graph.nodes):
                if n.op == "call_function":
                    self.place[n] = self._visit(n)
        return [self.place.get(r) if isinstance(r, fx.Node) else None for r in _results(body)]

    @contextlib.contextmanager
    def _inside(self, gm: fx.GraphModule):
        """Rules and helpers read and write ``gm``'s graph meanwhile (a region's body)."""
        saved = self.gm, self.g
        self.gm, self.g = gm, gm.graph
        try:
            yield
        finally:
            self.gm, self.g = saved

    def _graphs(self) -> list[fx.GraphModule]:
        """The pass's graph module and every region body it entered."""
        return [self.gm, *(g.owning_module for g in self.regions)]

    def _through(self, n: fx.Node, seen: set[fx.Node]) -> list[fx.Node] | None:
        """Readers of values in ``seen`` beyond a region boundary at ``n``, for the
        traversals that follow a gradient back: for an entered region, the body nodes
        reading placeholders bound to them (none for a ``torch.no_grad()`` region, which
        passes no gradient); for the output of an entered body, the region's ``getitem``
        users of those results. None when ``n`` is no such boundary (a traversal goes on
        through ``n.users`` itself). A traversal asks again on each arrival at a boundary,
        since a later arrival may bring another operand or result into ``seen``."""
        if n in self.regions.values():
            if without_grad(n):
                return []
            body, operands = body_call(n)
            places = [p for p in body.graph.nodes if p.op == "placeholder"]
            return [u for p, a in zip(places, operands) if a in seen for u in p.users]
        if n.op == "output" and n.graph in self.regions:
            region = self.regions[n.graph]
            picked = {i for i, r in enumerate(_results(n.graph.owning_module)) if r in seen}
            return [u for u in region.users if u.target is operator.getitem and u.args[1] in picked]
        return None

    def _refresh_region(self, node: fx.Node) -> bool:
        """Re-evaluate the body of entered region ``node`` on its operands' local fake
        values and recompile it; False when ``node`` is not one."""
        found = body_call(node)
        if found is None or found[0].graph not in self.regions:
            return False
        body, operands = found
        placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
        for p, a in zip(placeholders, operands):
            p.meta["val"] = a.meta.get("val") if isinstance(a, fx.Node) else a
        with self._inside(body):
            self._refresh_values()
        finish(body)
        node.meta["val"] = fake_eval(node)
        return True


def _results(body: fx.GraphModule) -> tuple:
    results = body.graph.output_node().args[0]
    return tuple(results) if isinstance(results, (tuple, list)) else (results,)
