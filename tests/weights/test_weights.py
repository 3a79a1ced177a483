"""Weights sources read exactly the boxes asked for, from every kind of source, and
check() refuses weights that do not fit the model with messages naming the cause."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from fxmeg.errors import WeightsError
from fxmeg.weights.sharding import Pieces, dcp_save
from fxmeg.weights.sources import DcpWeights, SafetensorsWeights, check, open_weights


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "qkv.weight": torch.randn(12, 6, generator=g),  # a fused (q, k, v) of 4 rows each
        "norm.bias": torch.randn(10, generator=g),
        "emb.weight": torch.randn(8, 4, generator=g).bfloat16(),
        "unused": torch.randn(5, generator=g),
    }


def _dict(tmp_path, tensors):
    return tensors


def _torch_file(tmp_path, tensors):
    path = str(tmp_path / "weights.pt")
    torch.save(tensors, path)
    return path


def _safetensors_file(tmp_path, tensors):
    from safetensors.torch import save_file

    path = str(tmp_path / "weights.safetensors")
    save_file(tensors, path)
    return path


def _fxmeg_checkpoint(tmp_path, tensors):
    """The layout fxmeg.weights.checkpoint writes: DIR/iter_N/ (DCP files, meta.json), DIR/latest;
    qkv.weight stored as two row chunks, as two tensor-parallel ranks save it."""
    root, name = tmp_path / "ckpt", "iter_0000003"
    state = {f"model/{k}": v for k, v in tensors.items()} | {"trainer": {"consumed": 7}}
    qkv = tensors["qkv.weight"]
    state["model/qkv.weight"] = Pieces(qkv.shape, [((0, 0), qkv[:6]), ((6, 0), qkv[6:])])
    dcp_save(state, FileSystemWriter(str(root / name)))  # as a single-process save writes it
    meta = {
        "iteration": 3,
        "model": {k: list(v.shape) for k, v in tensors.items()},
        "aliases": {k: [k] for k in tensors},
    }
    (root / name / "meta.json").write_text(json.dumps(meta))
    (root / "latest").write_text(name)
    return str(root)


SOURCES = [_dict, _torch_file, _safetensors_file, _fxmeg_checkpoint]


@pytest.mark.parametrize("make", SOURCES, ids=lambda f: f.__name__.strip("_"))
def test_fill_reads_exactly_the_boxes(make, tmp_path):
    tensors = _tensors()
    weights = open_weights(make(tmp_path, tensors))
    assert weights.names() == set(tensors)
    assert {n: weights.shape(n) for n in tensors} == {
        n: (tuple(t.shape), t.dtype) for n, t in tensors.items()
    }
    assert sum(weights.reads.values()) == 0  # metadata only so far

    qkv = torch.empty(6, 6)  # rank 1 of tp=2: rows 2:4 of q, then 10:12 of v (k skipped)
    norm = torch.zeros(4)  # a column block of a 1-D tensor at local offset 1
    emb = torch.empty(8, 2)  # a column block of a 2-D bf16 tensor, read into fp32
    weights.fill(
        [
            (
                "qkv.weight",
                qkv,
                [
                    (((2, 0), (2, 6)), ((0, 0), (2, 6))),
                    (((6, 0), (2, 6)), ((2, 0), (2, 6))),
                    (((10, 0), (2, 6)), ((4, 0), (2, 6))),
                ],
            ),
            ("norm.bias", norm, [(((3,), (3,)), ((1,), (3,)))]),
            ("emb.weight", emb, [(((0, 2), (8, 2)), ((0, 0), (8, 2)))]),
        ]
    )
    full = tensors["qkv.weight"]
    assert torch.equal(qkv, torch.cat([full[2:4], full[6:8], full[10:12]]))
    assert torch.equal(norm, torch.cat([torch.zeros(1), tensors["norm.bias"][3:6]]))
    assert torch.equal(emb, tensors["emb.weight"][:, 2:4].float())
    assert weights.reads == {"qkv.weight": 1, "norm.bias": 1, "emb.weight": 1}


@pytest.mark.parametrize("make", SOURCES, ids=lambda f: f.__name__.strip("_"))
def test_one_box_into_two_outputs(make, tmp_path):
    tensors = _tensors()
    weights = open_weights(make(tmp_path, tensors))
    a, b = torch.empty(2, 6), torch.empty(2, 6, dtype=torch.float64)
    box = (((4, 0), (2, 6)), ((0, 0), (2, 6)))
    weights.fill([("qkv.weight", a, [box]), ("qkv.weight", b, [box])])
    assert torch.equal(a, tensors["qkv.weight"][4:6]) and torch.equal(
        b, tensors["qkv.weight"][4:6].double()
    )
    assert weights.reads == {"qkv.weight": 2}


@pytest.mark.parametrize("make", SOURCES, ids=lambda f: f.__name__.strip("_"))
def test_a_box_outside_the_tensor_is_refused(make, tmp_path):
    weights = open_weights(make(tmp_path, _tensors()))
    with pytest.raises(
        WeightsError, match=r"box \(\(0, 4\), \(12, 4\)\) of 'qkv.weight' \(shape \(12, 6\)"
    ):
        weights.fill([("qkv.weight", torch.empty(12, 4), [(((0, 4), (12, 4)), ((0, 0), (12, 4)))])])
    with pytest.raises(WeightsError, match="no tensor 'qkv.weigth'.*did you mean 'qkv.weight'"):
        weights.shape("qkv.weigth")
    assert not weights.reads


def test_dcp_shape_reads_metadata_only(tmp_path):
    """The checkpoint's data files can be gone: names and shapes come from .metadata."""
    tensors = _tensors()
    root = _fxmeg_checkpoint(tmp_path, tensors)
    weights = open_weights(root)
    assert isinstance(weights, DcpWeights) and weights.where.endswith("iter_0000003")
    assert open_weights(weights.where).names() == set(tensors)  # an iteration directory itself
    for file in os.listdir(weights.where):
        if file.endswith(".distcp"):
            os.remove(os.path.join(weights.where, file))
    assert weights.shape("emb.weight") == ((8, 4), torch.bfloat16)
    assert weights.shape("qkv.weight") == ((12, 6), torch.float32)
    assert len(weights.entries["qkv.weight"].chunks) == 2  # two chunks, one tensor
    assert "trainer" not in weights.names()  # only model/ entries


def test_safetensors_shape_reads_no_data(tmp_path):
    """A safetensors header answers shape(); its data are not opened."""
    weights = open_weights(_safetensors_file(tmp_path, _tensors()))
    assert weights.shape("norm.bias") == ((10,), torch.float32)
    assert weights.opened_files == []


def _hf_model(tmp_path, *, tie: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    model = AutoModelForCausalLM.from_config(config)
    path = str(tmp_path / f"hf_tie{int(tie)}")
    model.save_pretrained(path, max_shard_size="20KB")
    return model, path


def _wanted(model) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """canonical -> (aliases, shape), tied parameters under every name they have."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), ([], p))[0].append(name)
    return {names[0]: (tuple(names), tuple(p.shape)) for names, p in groups.values()}


def test_hugging_face_shards_open_only_when_read(tmp_path):
    model, path = _hf_model(tmp_path, tie=False)
    weights = open_weights(path)
    assert isinstance(weights, SafetensorsWeights)
    shards = sorted(set(weights.files.values()))
    assert len(shards) > 2 and weights.headers == {}  # opening read the index only
    assert weights.names() == set(model.state_dict())

    name = "model.layers.1.self_attn.q_proj.weight"  # (32, 32): rank 0 of tp=2 holds rows 0:16
    out = torch.empty(16, 32)
    weights.fill([(name, out, [(((0, 0), (16, 32)), ((0, 0), (16, 32)))])])
    assert torch.equal(out, model.state_dict()[name][:16])
    assert weights.opened_files == [weights.files[name]]
    assert set(weights.headers) == {weights.files[name]}  # other shards: not even their header
    assert weights.reads == {name: 1}

    found = check(weights, _wanted(model))  # every header, still no other shard's data
    assert found == {n: n for n in model.state_dict()}
    assert set(weights.headers) == set(shards) and weights.opened_files == [weights.files[name]]


def test_check_accepts_a_tied_alias(tmp_path):
    model, path = _hf_model(tmp_path, tie=True)
    weights = open_weights(path)
    assert "lm_head.weight" in model.state_dict() and "lm_head.weight" not in weights.names()
    found = check(weights, _wanted(model))
    assert found["model.embed_tokens.weight"] == "model.embed_tokens.weight"
    wanted = {"lm_head.weight": (("lm_head.weight", "model.embed_tokens.weight"), (64, 32))}
    assert check(weights, wanted) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert not weights.reads and weights.opened_files == []


def _wanted_of(tensors, **changes):
    wanted = {n: ((n,), tuple(t.shape)) for n, t in tensors.items() if n != "unused"}
    return wanted | changes


def test_check_names_a_missing_parameter():
    tensors = _tensors()
    wanted = _wanted_of(tensors, **{"out.weight": (("out.weight", "head.weight"), (4, 4))})
    with pytest.raises(WeightsError) as err:
        check(open_weights(tensors), wanted)
    message = str(err.value)
    assert "1 of 4 parameters are not in <state_dict>: 'out.weight' (or 'head.weight')" in message
    assert "must match model.state_dict()" in message


def test_check_names_both_shapes_and_the_file(tmp_path):
    tensors = _tensors()
    path = _safetensors_file(tmp_path, tensors)
    wanted = _wanted_of(tensors, **{"qkv.weight": (("qkv.weight",), (6, 12))})
    with pytest.raises(
        WeightsError,
        match=rf"'qkv.weight' has shape \(6, 12\) in the model but \(12, 6\) in {path}",
    ):
        check(open_weights(path), wanted)


def test_check_says_the_weights_belong_to_another_model(tmp_path):
    _, path = _hf_model(tmp_path, tie=False)
    with pytest.raises(WeightsError) as err:
        check(open_weights(path), _wanted_of(_tensors()))
    message = str(err.value)
    assert (
        f"the weights in {path} seem to belong to another model: 3 of 3 parameters are missing"
        in message
    )
    assert (
        "the model wants e.g. 'qkv.weight'" in message
        and "the weights hold e.g. 'lm_head.weight'" in message
    )


def test_open_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(WeightsError, match="do not exist"):
        open_weights(str(tmp_path / "nothing.pt"))
    with pytest.raises(WeightsError, match="holds no weights fxmeg can read"):
        open_weights(str(tmp_path))
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "nested.pt")
    with pytest.raises(WeightsError, match=r"no tensors at the top level \(keys \['model'\]\)"):
        open_weights(str(tmp_path / "nested.pt"))


def test_transformers_saved_experts_read_as_the_models_banks():
    """A Mixtral checkpoint in transformers' saved names (each expert's w1, w2, w3 apart)
    answers under the model's names with the model's shapes; a box of the fused
    gate_up_proj bank that crosses from w1's rows into w3's and covers experts 1 and 2
    equals the model's, and reads only those experts' w1 and w3."""
    from fxmeg.weights.converted import converted
    from tests.harness.models import make_model, saved_names

    model = make_model("moe-mixtral", n_layer=1)
    weights = open_weights(saved_names(model))
    view = converted(weights, model)
    state = model.state_dict()
    assert view.names() == set(state)
    assert all(view.shape(n)[0] == tuple(t.shape) for n, t in state.items())
    bank = "model.layers.0.mlp.experts.gate_up_proj"  # [4, 96, 32]: w1 rows 0..47, w3 48..95
    out = torch.zeros(2, 20, 4)
    view.fill([(bank, out, [(((1, 40, 5), (2, 20, 4)), ((0, 0, 0), (2, 20, 4)))])])
    assert torch.equal(out, state[bank][1:3, 40:60, 5:9])
    assert sorted(weights.reads) == [
        f"model.layers.0.mlp.experts.{e}.{w}.weight" for e in (1, 2) for w in ("w1", "w3")
    ]
