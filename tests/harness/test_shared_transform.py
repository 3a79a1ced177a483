"""The spawns' shared transform (tests/harness/shared_transform.py) hands every rank the Program its
own transform would have made, bound to that rank's own model: else the suite's ranks
would test the cache instead of fxmeg. Its key tells apart two models that differ only in
a non-persistent buffer, the code a module runs, the attention or experts implementation,
FXMEG_SKIP_PASSES, or the loss function (instance or the one a Hugging Face model calls).
Ranks that each transform by themselves make the same Program: tests/parity/test_replicas.py's
4-rank spawn."""

from __future__ import annotations

import os

import pytest
import torch
from torch import fx

from fxmeg.errors import ConfigError
from fxmeg.ir.program import split_spec
from tests.harness import shared_transform
from tests.harness.helpers import make_batch
from tests.harness.models import hf_model, make_model, tiny_moe

LAYOUTS = {"tp2-pp2": dict(tp=2, pp=2), "zbh1-bf16": dict(pp=2, schedule="zbh1", precision="bf16")}


def _graphs(program) -> dict[str, fx.GraphModule]:
    """Every graph of a Program by a name: the parent, its chunks and their submodules
    (zero-bubble splits, region bodies), the reference."""
    found = {"reference": program.reference}
    for name, gm in program.graph.named_modules():
        if isinstance(gm, fx.GraphModule):
            found[f"parent.{name}"] = gm
    return found


def _first_transform(monkeypatch) -> None:
    """What follows runs as another rank would, from its first transform."""
    monkeypatch.setattr(shared_transform, "_calls", 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_loaded_program_is_the_transformed_one(layout, tmp_path, monkeypatch):
    ids, labels = make_batch(4, seed=0)
    mine, theirs = make_model("gpt"), make_model("gpt")
    _first_transform(monkeypatch)
    made = shared_transform._shared_transform(str(tmp_path), mine, (ids, labels), **LAYOUTS[layout])
    _first_transform(monkeypatch)
    loaded = shared_transform._shared_transform(
        str(tmp_path), theirs, (ids, labels), **LAYOUTS[layout]
    )
    assert os.path.exists(
        next(str(p)[: -len(".program")] for p in tmp_path.glob("*.program")) + ".lock"
    )

    ours, copies = _graphs(made), _graphs(loaded)
    assert ours.keys() == copies.keys() and len(ours) > len(made.chunks)
    assert all(split_spec(c) is not None for c in loaded.chunks) == (layout == "zbh1-bf16")
    for name, gm in ours.items():
        copy = copies[name]
        assert copy.code == gm.code, name
        assert [(n.name, n.meta.get("fxmeg")) for n in copy.graph.nodes] == \
            [(n.name, n.meta.get("fxmeg")) for n in gm.graph.nodes], name
        assert {k for k in copy.meta} == {k for k in gm.meta}, name
    for field in ("config", "specs", "buffers", "placement", "tp_specs", "holders", "full_shapes",
                  "aliases", "inputs", "value_checks", "flops_per_microbatch", "init_dtypes"):
        assert getattr(loaded, field) == getattr(made, field), field

    # bound to the loading model's own tensors, cast as the transform casts them
    own = dict(theirs.named_parameters())
    assert made.parameters.keys() == loaded.parameters.keys()
    assert all(p is own[name] for name, p in loaded.parameters.items())
    assert not any(p is q for p in loaded.parameters.values() for q in mine.parameters())
    assert {p.dtype for p in own.values()} == {next(iter(made.parameters.values())).dtype}
    assert loaded.master_values.keys() == made.master_values.keys()
    for name, master in loaded.master_values.items():
        assert master.dtype == torch.float32 and torch.equal(master, made.master_values[name])
    # and it computes what the transformed one does
    want, got = made.reference(ids, labels), loaded.reference(ids, labels)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_each_transform_of_a_spawn_is_made_once_and_a_failure_by_every_rank(tmp_path, monkeypatch):
    calls = []
    original = shared_transform._ORIGINAL

    def counted(model, example, config=None, **kw):
        calls.append(kw.get("tp", 1))
        return original(model, example, config, **kw)

    monkeypatch.setattr(shared_transform, "_ORIGINAL", counted)
    ids, labels = make_batch(2, seed=0)

    def rank(*transforms):  # one rank's transforms, in order: (seed, tp)
        _first_transform(monkeypatch)
        for seed, tp in transforms:
            shared_transform._shared_transform(
                str(tmp_path), make_model("gpt", seed=seed), (ids, labels), tp=tp
            )

    # the same model twice in one rank is transformed twice: to the code it may be another
    # model (a pass patched in between), and only the n-th transforms of two ranks are one
    rank((0, 2), (0, 2))
    assert calls == [2, 2]
    rank((0, 2), (0, 2))  # another rank loads both
    assert calls == [2, 2]
    rank((1, 2), (0, 1))  # other values, other options
    assert calls == [2, 2, 2, 1]

    for _ in range(2):  # the second rank finds the failure and fails by itself, the same way
        _first_transform(monkeypatch)
        with pytest.raises(ConfigError, match="tp=3 does not divide 4"):  # refused before capture
            shared_transform._shared_transform(
                str(tmp_path), make_model("gpt"), (ids, labels), tp=3
            )
    assert calls == [2, 2, 2, 1, 3, 3] and len(list(tmp_path.glob("*.failed"))) == 1


# ---------------------------------------------------------------------------- the key

EXAMPLE = make_batch(2, seed=0, vocab=96)


def _key(model, loss_fn=None) -> str:
    return shared_transform._key(model, EXAMPLE, None, loss_fn, None, {"tp": 2})


def _differ(a, same, b, *, loss_fns=(None, None, None)) -> None:
    """``a`` and ``same`` (built alike) share a key; ``b`` gets another."""
    ka, ks, kb = (_key(m, f) for m, f in zip((a, same, b), loss_fns))
    assert ka == ks, "two models built alike must share the transform"
    assert ka != kb, "two models that transform differently share a key"


def test_the_key_sees_non_persistent_buffers():
    """A rotary table (non-persistent: no state-dict entry) is read by the forward."""
    a, same, b = (hf_model("llama", vocab_size=96) for _ in range(3))
    with torch.no_grad():
        b.model.rotary_emb.inv_freq.mul_(2)
    assert all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    _differ(a, same, b)


def _mlp_without_gate(self, x):
    return self.down_proj(self.up_proj(x))


def _rotary_swapped(q, k, cos, sin, *args, **kwargs):
    from transformers.models.llama import modeling_llama

    return modeling_llama.rotate_half(q) * cos, k * cos


@pytest.mark.parametrize("where", ["forward", "helper"])
def test_the_key_sees_the_code_a_module_runs(where, monkeypatch):
    """A forward set on one module (a test that patches a model), or a function a forward
    calls by global name (a test that patches transformers), changed; nothing else."""
    from transformers.models.llama import modeling_llama

    a, same, b = (hf_model("llama", vocab_size=96) for _ in range(3))
    if where == "forward":
        mlp = b.model.layers[1].mlp
        mlp.forward = _mlp_without_gate.__get__(mlp)
        _differ(a, same, b)
    else:
        before = _key(a)
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _rotary_swapped)
        assert _key(same) != before


@pytest.mark.parametrize("which", ["attention", "experts"])
def test_the_key_sees_the_implementation_transformers_runs(which):
    """The same weights and config values, other attention (sdpa / eager) or experts
    (grouped_mm / batched_mm) code: a config's repr does not show which."""
    if which == "attention":
        a, same, b = (
            hf_model("llama", vocab_size=96, attn_implementation=i)
            for i in ("sdpa", "sdpa", "eager")
        )
    else:
        a, same, b = (
            tiny_moe("mixtral", experts_implementation=i)
            for i in ("grouped_mm", "grouped_mm", "batched_mm")
        )
    assert repr(a.config) == repr(b.config)
    _differ(a, same, b)


def test_the_key_sees_fxmeg_skip_passes(monkeypatch):
    model = make_model("gpt")
    before = _key(model)
    monkeypatch.setenv("FXMEG_SKIP_PASSES", "recompute")
    assert _key(model) != before


class _ScaledLoss:
    """A loss_fn object: instances of one class (one stable name) with other settings."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, model, ids, labels):
        loss = model(ids, labels)
        return loss * self.scale, torch.ones(())


def _other_causal_loss(logits, labels, vocab_size, **kwargs):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return 2 * ForCausalLMLoss(logits, labels, vocab_size, **kwargs)


@pytest.mark.parametrize("whose", ["loss_fn", "model"])
def test_the_key_sees_which_loss_function(whose):
    """Two loss_fn instances of one class (same name, other state), or a Hugging Face model
    given another ``loss_function``."""
    if whose == "loss_fn":
        models = [make_model("gpt") for _ in range(3)]
        losses = (_ScaledLoss(1.0), _ScaledLoss(1.0), _ScaledLoss(2.0))
        assert len({shared_transform._stable_name(f) for f in losses}) == 1
        _differ(*models, loss_fns=losses)
    else:
        a, same, b = (hf_model("llama", vocab_size=96) for _ in range(3))
        b.loss_function = _other_causal_loss
        _differ(a, same, b)
