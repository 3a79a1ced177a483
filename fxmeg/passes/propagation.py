"""One sharding propagation for every axis that splits the graph's values: tp (with sp)
and cp are configurations of ``Propagation``, not passes with machinery of their own
(docs/extending.md, "An axis").

An axis names itself (``axis``, the key of its rules in ``op_rules``), says which
placements are split on it (``split_kinds``) and registers one rule per op family. The
driver visits every node once, in order, regions' bodies included; a rule receives a node
whose operands have placements and returns the node's ``Placement``, asking
``move`` (fxmeg/passes/redistribute.py) for every collective or local cut it needs; a node that
reads no split value stays replicated unless its rule starts a split. ``refuse`` builds every
refusal (node, op, module, axis, fix); ``refresh`` re-evaluates every value on local shapes.
"""

from __future__ import annotations

import contextlib
import operator
from typing import ClassVar

import torch
from torch import fx

from fxmeg.errors import PassError
from fxmeg.frontend.capture import owning_module
from fxmeg.ir.layouts import Places
from fxmeg.passes.graph_utils import body_call, fake_eval, finish, is_hop, is_subgraph, without_grad
from fxmeg.passes.op_rules import describe, rule_for
from fxmeg.passes.redistribute import insert_move

UNDECIDED = object()
"""``before_rules``' answer when the family's rule decides."""


class Propagation:
    """The driver, configured by a subclass per axis (the class attributes below)."""

    axis: ClassVar[str]
    """The axis's name in the op-rule registry and the runtime's group ("tp", "cp")."""
    title: ClassVar[str]
    """The axis in messages ("tensor-parallel")."""
    split_kinds: ClassVar[tuple[type, ...]]
    """Placements that are split on this axis (a list of them: an unpacked value)."""
    split_phrase: ClassVar[str]
    """How a split value is split, in messages ("over tp ranks")."""

    def __init__(self, gm: fx.GraphModule, size: int) -> None:
        self.gm, self.g, self.root, self.size = gm, gm.graph, gm, size
        self.place: dict[fx.Node, Places] = {}
        self.regions: dict[fx.Graph, fx.Node] = {}  # entered region bodies -> their region

    # ------------------------------------------------------------------ driver

    def propagate(self) -> None:
        """Place every node of the graph, in order (``visit``); check the outputs."""
        for node in list(self.g.nodes):
            if node.op == "call_function":
                self.place[node] = self.visit(node)
            elif node.op == "output":
                self.check_outputs(node)

    def visit(self, node: fx.Node) -> Places:
        """The node's placement, by the rule of its op's family (``op_rules``)."""
        places = [self.place.get(a) for a in node.all_input_nodes]
        early = self.before_rules(node, places)
        if early is not UNDECIDED:
            return early
        found = rule_for(self.axis, node.target)
        if not (found is not None and found.always) and not any(map(self.is_split, places)):
            return None
        if is_hop(node):
            return self.enter(node)
        if node.target is operator.getitem:
            parts = self.place[node.args[0]]
            return parts[node.args[1]] if isinstance(parts, list) else parts
        if found is None:
            raise self.refuse(
                node,
                f"fxmeg has no {self.title} rule for it ({describe(node.target)})",
                self.first_split(node),
            )
        return found.fn(self, node)

    def is_split(self, place: Places) -> bool:
        return isinstance(place, (*self.split_kinds, list))

    def first_split(self, node: fx.Node):
        """The first operand placement that is split (not a list), for messages."""
        return next((p for p in map(self.place.get, node.all_input_nodes)
                     if isinstance(p, self.split_kinds)), None)

    def move(self, value: fx.Node, src: str, dst: str, *, at: fx.Node, dim: int | None = None,
             after: bool = False, like: fx.Node | None = None) -> fx.Node:
        """``insert_move`` on this axis, in the graph being walked."""
        return insert_move(
            self.g,
            self.axis,
            value,
            src,
            dst,
            size=self.size,
            dim=dim,
            at=at,
            after=after,
            like=like,
        )

    # ------------------------------------------------------------------ hooks

    def before_rules(self, node: fx.Node, places: list[Places]):
        """An axis's placement of a node that no family rule decides, or ``UNDECIDED``."""
        return UNDECIDED

    def check_outputs(self, node: fx.Node) -> None:
        """Refuse outputs that this axis cannot return (none by default)."""

    def local_input(self, node: fx.Node):
        """The local fake value of graph input ``node``, or None when it is whole."""
        return None

    def where(self, split) -> str:
        """Where ``split`` came from, for a refusal (empty by default)."""
        return ""

    def hint(self, node: fx.Node) -> str:
        """More about ``node`` for a refusal (empty by default)."""
        return ""

    def default_fix(self, node: fx.Node, split) -> str:
        return f"use {self.axis}=1"

    # ------------------------------------------------------------------ refusal

    def refuse(self, node: fx.Node, why: str, split=None, *, fix: str | None = None) -> PassError:
        """The one refusal: the node, its op and module, the axis and its size, why, and a fix."""
        op = getattr(node.target, "__name__", str(node.target))
        return PassError(
            f"cannot split node {node.name!r} ({op}, module {owning_module(node)!r}) "
            f"{self.phrase}{self.where(split)}: {why}{self.hint(node)}. Fix: "
            f"{fix or self.default_fix(node, split)}"
        )

    @property
    def phrase(self) -> str:
        return f"over {self.axis}={self.size} ranks"

    # ------------------------------------------------------------------ regions

    def enter(self, node: fx.Node) -> list[Places]:
        """Enter region ``node`` (an autocast, no-grad or wrap region reading a split
        value): its placeholders take their operands' placements, the rules run over its
        body (``inside``), and its outputs' placements are the body's results', a list its
        ``getitem`` users pick from. A body another region also calls and a region of
        another kind (``cond``, ``map``: their bodies run on other arguments) are refused."""
        split, found = self.first_split(node), body_call(node)
        if found is None:
            raise self.refuse(
                node,
                f"it is a higher-order op ({node.target.name()}) that reads a value split "
                f"{self.split_phrase}, and only wrap-style regions (autocast, no-grad, "
                "wrap) are split inside",
                split,
            )
        body, operands = found
        getter = next(a for a in node.args if isinstance(a, fx.Node) and is_subgraph(a))
        callers = [n for n in self.g.nodes if n.op == "get_attr" and n.target == getter.target]
        if len(callers) > 1 or len(getter.users) > 1:
            raise self.refuse(node, f"its body {getter.target!r} is also called by another region, "
                                    "which may read values split differently", split)
        placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
        for p, a in zip(placeholders, operands):
            self.place[p] = self.place.get(a) if isinstance(a, fx.Node) else None
        self.regions[body.graph] = node
        with self.inside(body):
            for n in list(body.graph.nodes):
                if n.op == "call_function":
                    self.place[n] = self.visit(n)
        return [self.place.get(r) if isinstance(r, fx.Node) else None for r in results(body)]

    @contextlib.contextmanager
    def inside(self, gm: fx.GraphModule):
        """Rules and helpers read and write ``gm``'s graph meanwhile (a region's body)."""
        saved = self.gm, self.g
        self.gm, self.g = gm, gm.graph
        try:
            yield
        finally:
            self.gm, self.g = saved

    def graphs(self) -> list[fx.GraphModule]:
        """The graph module and every region body entered."""
        return [self.gm, *(g.owning_module for g in self.regions)]

    def through(self, n: fx.Node, seen: set[fx.Node]) -> list[fx.Node] | None:
        """Readers of values in ``seen`` beyond a region boundary at ``n``, for traversals
        that follow a gradient back: for an entered region, the body nodes reading
        placeholders bound to them (none for a no-grad region); for the output of an
        entered body, the region's ``getitem`` users of those results. None when ``n`` is
        no such boundary. A traversal asks again on each arrival at a boundary, since a
        later arrival may bring another operand or result into ``seen``."""
        if n in self.regions.values():
            if without_grad(n):
                return []
            body, operands = body_call(n)
            places = [p for p in body.graph.nodes if p.op == "placeholder"]
            return [u for p, a in zip(places, operands) if a in seen for u in p.users]
        if n.op == "output" and n.graph in self.regions:
            region = self.regions[n.graph]
            picked = {i for i, r in enumerate(results(n.graph.owning_module)) if r in seen}
            return [u for u in region.users if u.target is operator.getitem and u.args[1] in picked]
        return None

    # ------------------------------------------------------------------ values

    def refresh(self) -> None:
        """Every value anew on the local shapes: graph inputs by ``local_input``, then
        each node in order (an entered region's body first). Nodes of no tensor (a size
        read with ``.item()``: the tokens JetMoE sends to an expert) stay: they count data,
        which no axis cuts, and a new symbol would not be the one later nodes were traced
        with."""
        for node in self.g.nodes:
            v = node.meta.get("val")
            if node.op == "placeholder" and self.gm is self.root:
                local = self.local_input(node)
                if local is not None:
                    node.meta["val"] = local
            elif node.op == "call_function" and (is_hop(node) or _holds_tensor(v)):
                try:
                    if not self._refresh_region(node):
                        node.meta["val"] = fake_eval(node)
                except PassError:
                    raise
                except Exception as exc:
                    raise PassError(
                        f"after {self.title} rewriting, node {node.name!r} (module "
                        f"{owning_module(node)!r}, {node.target}) no longer type-checks: {exc}"
                    ) from exc

    def _refresh_region(self, node: fx.Node) -> bool:
        """Re-evaluate the body of entered region ``node`` on its operands' local values
        and recompile it; False when ``node`` is not one."""
        found = body_call(node)
        if found is None or found[0].graph not in self.regions:
            return False
        body, operands = found
        for p, a in zip([p for p in body.graph.nodes if p.op == "placeholder"], operands):
            p.meta["val"] = a.meta.get("val") if isinstance(a, fx.Node) else a
        with self.inside(body):
            self.refresh()
        finish(body)
        node.meta["val"] = fake_eval(node)
        return True


def _holds_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) or (
        isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v)
    )


def results(body: fx.GraphModule) -> tuple:
    """A region body's results, one per output."""
    out = body.graph.output_node().args[0]
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
