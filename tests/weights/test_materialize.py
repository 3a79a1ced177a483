"""A model built on the meta device (issue 17), on one process: captured and transformed
on shapes, its values made module by module independently of the layout, the same as
``fxmeg.materialize`` makes on one device; Hugging Face models initialised by their own
``_init_weights`` (rotary tables recomputed); half precision starting from fp32 masters.
The expected values are the seeding rule written out in the test (``seeded_init``,
applied to a real model), not ``fxmeg.materialize``."""

from __future__ import annotations

import pytest
import torch

import fxmeg
from fxmeg.errors import InitError
from fxmeg.frontend.pass_driver import transform
from tests.harness.helpers import assert_bitwise, make_batch, seeded_init
from tests.harness.models import hf_model, make_model


def _meta(name, **cfg):
    with torch.device("meta"):
        return make_model(name, **cfg)


def _twin(name, **cfg):
    model = _meta(name, **cfg)
    return fxmeg.materialize(model, init_fn=model.init_weights, seed=0)


def _oracle(name, seed=0, **cfg):
    """A real model of ``name`` (its own init drawn from another seed), re-initialised by
    the test's statement of the rule."""
    model = make_model(name, seed=7, **cfg)
    return seeded_init(model, model.init_weights, seed)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_materialize_follows_the_per_module_seeding_rule(name):
    assert_bitwise(_twin(name).state_dict(), _oracle(name).state_dict())


def test_values_depend_on_the_module_name_not_on_the_rest_of_the_model():
    small, large = _twin("llama", n_layer=2), _twin("llama", n_layer=4)
    for name, t in small.state_dict().items():
        assert torch.equal(t, large.state_dict()[name]), name
    other = _meta("llama", n_layer=2)
    other = fxmeg.materialize(other, init_fn=other.init_weights, seed=1)
    assert not torch.equal(other.layers[0].mlp.up_proj.weight, small.layers[0].mlp.up_proj.weight)
    assert torch.equal(small.rope_cos, make_model("llama", n_layer=2).rope_cos), (
        "buffers recomputed"
    )


def test_tied_weights_stay_tied():
    twin = _twin("gpt")
    assert twin.lm_head.weight is twin.wte.weight
    assert not any(t.is_meta for t in twin.state_dict().values())


def test_meta_capture_computes_on_the_example_device():
    ids, labels = make_batch(2, seed=0)
    program = transform(_meta("gpt"), (ids, labels), pp=2, global_batch_size=4)
    assert program.device == torch.device("cpu")
    for gm in (*program.chunks, program.reference):
        for node in gm.graph.nodes:  # GPT's torch.arange(s, device=ids.device) was captured on meta
            assert torch.device("meta") not in [*node.args, *node.kwargs.values()], (
                node.format_node()
            )


def test_parallelize_makes_the_twin_and_the_users_module_holds_it():
    ids, labels = make_batch(2, seed=0)
    model = _meta("llama")
    engine = fxmeg.parallelize(model, (ids, labels), init_fn=model.init_weights, seed=0)
    assert_bitwise(engine.full_state_dict(), _oracle("llama").state_dict())
    for name, p in model.named_parameters():
        assert p is engine.named_parameters[name]
    assert not model.rope_cos.is_meta


def test_half_precision_masters_are_the_fp32_initial_values():
    ids, labels = make_batch(2, seed=0)
    model = _meta("gpt")
    engine = fxmeg.parallelize(
        model, (ids, labels), init_fn=model.init_weights, seed=0, precision="bf16"
    )
    twin = _oracle("gpt")
    masters = {piece.name: piece.master for piece in engine.context.optimizer.pieces}
    for name, p in twin.named_parameters():
        assert masters[name].dtype == torch.float32
        assert torch.equal(masters[name], p.detach()), name
        assert torch.equal(engine.named_parameters[name].detach(), p.detach().bfloat16()), name


def test_hugging_face_model_on_meta_uses_its_own_init():
    ids, _ = make_batch(2, seed=0)
    with torch.device("meta"):
        model = hf_model("llama")
    engine = fxmeg.parallelize(model, (ids, ids), seed=0)
    twin = hf_model("llama", seed=7)
    seeded_init(twin, twin._init_weights, 0)  # the model's own init, per module, seeded by the rule
    assert_bitwise(engine.full_state_dict(), twin.state_dict())
    real = hf_model("llama")
    assert torch.equal(model.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    std = twin.model.layers[0].mlp.up_proj.weight.std().item()
    assert abs(std - real.config.initializer_range) < 0.2 * real.config.initializer_range


def test_a_buffer_init_fn_cannot_rebuild_is_named():
    """The rotary tables are non-persistent buffers of the Llama itself: an init_fn that
    fills every parameter but not them is refused, naming the module and both buffers."""
    ids, labels = make_batch(2, seed=0)
    model = _meta("llama")

    def weights_only(module):
        if module is not model:
            model.init_weights(module)

    with pytest.raises(
        InitError, match=r"module '<root>' \(Llama\).*init_fn left rope_cos, rope_sin unwritten"
    ):
        fxmeg.parallelize(model, (ids, labels), init_fn=weights_only)
