"""``collectives.bind`` in one process: each op is rewritten by its one entry of
``BINDERS`` (no process group is touched: binding only changes targets and arguments)."""

import torch
from torch import fx

from fxmeg.ir import ops
from fxmeg.runtime import collectives


def _graph() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_function(ops.wait_param_gather, (x,), {"bucket": (0, 1)})
    g.call_function(ops.expert_load, (x,), {"layer": "l", "experts": 2})
    y = g.call_function(ops.tp_rng_fork, (x,), {"group": "tp"})
    g.output(g.call_function(ops.global_tokens, (y,), {"group": "dp"}))
    return fx.GraphModule(torch.nn.Module(), g)


def test_each_op_is_bound_by_its_entry_and_a_missing_binding_leaves_it_alone():
    calls = []

    def wait(param, *, bucket):
        calls.append(("wait", bucket))

    def tokens(fraction, *, group):
        calls.append(("tokens", group))
        return fraction

    gm = _graph()
    binding = collectives.Binding(
        {"tp": "tp_real", "dp": "dp_real"}, wait_param_gather=wait, global_tokens=tokens
    )
    collectives.bind(gm, binding)
    targets = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    # expert_load: no recorder
    assert set(targets) == {wait, ops.expert_load, binding.rng.tp_rng_fork, tokens}
    assert targets[binding.rng.tp_rng_fork].kwargs["group"] == "tp_real"
    assert targets[tokens].kwargs["group"] == "dp_real"
    assert set(collectives.BINDERS) >= {
        ops.routed_experts,
        ops.zero_gather,
        ops.zero_release,
        ops.early_linear,
        ops.tp_rng_join,
        *ops.COLLECTIVES,
    }
