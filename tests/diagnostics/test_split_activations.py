"""What one micro-batch of a split chunk holds under a zero-bubble schedule
(fxmeg.diagnostics.split_activations), read from the graphs torch's partitioner made,
against fxmeg's own table of what each op saves."""

from __future__ import annotations

import pytest

from fxmeg.diagnostics.saved_activations import activation_bytes
from fxmeg.diagnostics.split_activations import RECEIVED, SENT_GRADIENT, split_held
from fxmeg.frontend.pass_driver import transform
from fxmeg.frontend.variable_shapes import meta_twin
from tests.harness.helpers import make_batch
from tests.harness.models import make_model


def _chunks(recompute: str, **options) -> list:
    """The bench-like GPT, built on meta as a plan builds it, split for zbh1 at pp=2."""
    model = make_model("gpt", n_layer=4)
    ids, labels = make_batch(1, seed=0, seq=32)
    program = transform(meta_twin(model), (ids.to("meta"), labels.to("meta")), pp=2,
                        schedule="zbh1", global_batch_size=2, recompute=recompute, **options)
    return [(gm, split_held(gm)) for gm in program.chunks]


def _total(held: dict, i: int, skip=()) -> int:
    return sum(kept[i] for name, kept in held.items() if name not in skip)


def test_the_split_saves_what_the_table_says_and_the_loss_chunk_keeps_its_backward():
    """Without recompute, forward saves for I and W what fxmeg's table says each op saves
    (torch's partitioner and fxmeg's table agree within 3%), the chunk holding the loss
    included: a planned (meta) model is split on CPU fakes, on which the loss has a
    backward (on meta fakes nll_loss has none, and the last chunk saved nothing)."""
    for gm, held in _chunks("none"):
        assert _total(held, 0) == pytest.approx(activation_bytes(gm), rel=0.03)
        assert _total(held, 0) > 0


def test_under_full_recompute_a_receiving_chunk_carries_what_its_w_reads():
    """Full recompute keeps only each block's input from F until I, but a chunk that
    receives recomputes its blocks in I, and what W reads of them (the weight matmuls'
    inputs, the output gradients) waits for W: the carry is many times what forward
    saved. The first chunk receives nothing: its I is nearly empty and its carry is its
    saved tensors and the gradient of what it sent."""
    (first, held0), (last, held1) = _chunks("full")
    blocks = [m for m in held1 if m.startswith("layers.")]
    assert blocks and sum(held1[m][1] for m in blocks) > 4 * sum(held1[m][0] for m in blocks)
    sent = held0[SENT_GRADIENT][1]
    assert sent > 0 and _total(held0, 1) <= _total(held0, 0) + sent
    assert held1[RECEIVED][0] > 0  # the received input, saved for the first block's norm


def test_the_passes_own_nodes_are_told_by_module():
    """Under sequence parallelism the gathers before the linear maps are the passes' own
    nodes; the split's graphs name the module they work for, so what W keeps of them is a
    block's and not top-level code's (the search attributes it to the block it repeats)."""
    for _, held in _chunks("none", tp=2, sequence_parallel=True):
        block = sum(v[1] for m, v in held.items() if m.startswith("layers."))
        assert held.get("", (0, 0))[1] < block / 4, held


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_hugging_face_split_is_told_by_its_blocks_and_counts_the_experts_state(recompute):
    """A Hugging Face model is captured through a wrapper, whose path export's module stacks
    keep (``model.model.layers.1`` for Mixtral's ``model.layers.1``): the split names every
    node by fxmeg's own module tag, so what a chunk holds is its blocks' (read by block,
    the search counted it as the head's). A split routed-experts block keeps its forward's
    autograd graph, no tensor: it holds what ``routed_experts`` saves besides its output,
    from F until W; in a recompute region only from I (run again there) until W."""
    from fxmeg.diagnostics.saved_activations import routed_experts_bytes
    from fxmeg.interop.hugging_face import keyword_batch
    from fxmeg.ir import ops

    model = make_model("moe-mixtral")
    ids, _ = make_batch(1, seed=0, seq=32)
    program = transform(meta_twin(model), keyword_batch(ids.to("meta"), ids.to("meta")),
                        pp=2, dp=2, ep=2, schedule="zbh1", global_batch_size=2,
                        recompute=recompute)
    modules = dict(model.named_modules())
    for gm in program.chunks:
        held = split_held(gm)
        assert set(held) - {RECEIVED, SENT_GRADIENT} <= set(modules)
        states = [n for n in gm.zb_forward.graph.nodes if n.target is ops.routed_experts_split]
        assert states and all(s.kwargs.get("again", False) == (recompute == "full")
                              for s in states)
        experts = [held.get(list(s.meta["nn_module_stack"])[-1], (0, 0)) for s in states]
        kept = sum(map(routed_experts_bytes, states))
        assert sum(e[0] for e in experts) == (0 if recompute == "full" else kept)
        if gm is program.chunks[-1]:  # a chunk that receives hands the state from I to W
            assert sum(e[1] for e in experts) == kept
