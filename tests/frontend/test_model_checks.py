"""fxmeg/frontend/model_checks.py: a layout the model's config cannot take is refused before
capture, in one process, naming the field, the numbers and the fix; the escapes of today pass."""

from __future__ import annotations

import pytest
import torch

import fxmeg
from fxmeg.config import make_config
from fxmeg.errors import ConfigError
from fxmeg.frontend import pass_driver
from fxmeg.frontend.model_checks import check_model
from tests.harness.helpers import make_batch
from tests.harness.models import make_model

pytest.importorskip("transformers")


@pytest.fixture
def no_capture(monkeypatch):
    """Fail the test if fxmeg captures the model: every refusal here comes before."""
    def capture(*args, **kwargs):
        raise AssertionError("captured: the check came after capture")

    monkeypatch.setattr(pass_driver, "capture", capture)


def _llama(heads: int, kv_heads: int, layers: int = 2) -> torch.nn.Module:
    """A tiny Hugging Face Llama on meta (shapes only: nothing is allocated)."""
    import transformers as T

    cfg = T.LlamaConfig(
        vocab_size=96,
        hidden_size=8 * heads,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
    )
    with torch.device("meta"):
        return T.LlamaForCausalLM(cfg)


def _mixtral(experts: int) -> torch.nn.Module:
    import transformers as T

    cfg = T.MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=experts,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        return T.MixtralForCausalLM(cfg)


EXAMPLE = make_batch(2, seed=0, vocab=96)


def test_heads_tp_refused_before_capture(no_capture):
    with pytest.raises(ConfigError) as err:
        fxmeg.plan(_llama(3, 3), EXAMPLE, tp=2)
    assert str(err.value) == (
        "tp=2 does not divide 3, the number of heads of LlamaForCausalLM's attention "
        "(LlamaConfig.num_attention_heads=3): tensor parallelism gives each tp rank whole heads; "
        "choose tp in "
        "[1, 3], or keep the attention whole on every tp rank with "
        "tp_plan={'model.layers.*.self_attn.*': 'replicate'}"
    )
    with pytest.raises(ConfigError, match="tp=2 does not divide 3, the number of heads"):
        fxmeg.transform(_llama(3, 3), EXAMPLE, tp=2)


def test_fxmeg_models_config_refused_before_capture(no_capture):
    with pytest.raises(
        ConfigError,
        match=r"3, the number of heads of GPT's attention \(GPTConfig.n_head=3\).*"
        r"tp_plan=\{'layers.\*.attn.\*': 'replicate'\}",
    ):
        fxmeg.transform(make_model("gpt", n_embd=48, n_head=3), make_batch(2, seed=0), tp=2)
    with pytest.raises(ConfigError, match=r"pp \* vpp = 8 chunks, but the model has only 4 blocks "
                                          r"\(layers.0 .. layers.3\); choose pp \* vpp <= 4"):
        fxmeg.transform(make_model("gpt"), make_batch(2, seed=0), pp=2, vpp=4, global_batch_size=16)


def test_experts_ep_refused_before_capture(no_capture):
    with pytest.raises(ConfigError) as err:
        fxmeg.plan(_mixtral(3), EXAMPLE, ep=2, dp=2, global_batch_size=4)
    assert str(err.value) == (
        "ep=2 does not divide the 3 experts of MixtralForCausalLM "
        "(MixtralConfig.num_local_experts=3): expert "
        "parallelism gives each ep rank 3 / ep whole experts of every layer; choose ep among [1, 3]"
    )


@pytest.mark.parametrize(
    "heads, kv_heads, options",
    [
        # the escape the message names
        (3, 3, {"tp_plan": {"model.layers.*.self_attn.*": "replicate"}}),
        (6, 3, {}),  # key/value heads tp does not divide: replicated (fxmeg/passes/tp/heads.py)
        (4, 1, {}),  # multi-query
    ],
)
def test_what_the_passes_take_passes(heads, kv_heads, options):
    model = _llama(heads, kv_heads)
    check_model(model, make_config(EXAMPLE, world=None, tp=2, **options))
    check_model(_mixtral(4), make_config(EXAMPLE, world=None, ep=2, dp=2, global_batch_size=4))
    # 2 layers, 2 chunks
    check_model(model, make_config(EXAMPLE, world=None, pp=2, global_batch_size=4))


def test_the_escape_transforms():
    """The replicated attention of 3 heads at tp=2 is what the tensor-parallel pass takes too."""
    plan = fxmeg.plan(
        _llama(3, 3), EXAMPLE, tp=2, tp_plan={"model.layers.*.self_attn.*": "replicate"}
    )
    assert any("self_attn" in module for module, _ in plan.tp_whole)
