"""Hugging Face models in one process: the adapter, the pipeline split's boundaries and
a mixture of experts captured whatever experts implementation its config names."""

import logging
import warnings

import pytest
import torch
import transformers as T
from expecttest import TestCase

import fxmeg
import fxmeg.interop.hugging_face
from fxmeg.frontend.capture import capture
from fxmeg.ir.program import chunk_spec, chunks
from tests.harness.helpers import chunk_boundaries, graph_after
from tests.harness.models import hf_model, make_model


def _batch():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return ids, ids.clone()


class LlamaPipeline(TestCase):
    def test_mask_and_rotary_tables_are_sent_along(self):
        """HF computes the causal mask and the rotary cos / sin once before the layers;
        they cross every cut (no gradient, never freed) next to the hidden state."""
        parent = graph_after(hf_model("llama", n_layer=2), _batch(), "pipeline", num_chunks=2)
        spec = chunk_spec(chunks(parent)[0])
        assert [(b.dtype, b.grad) for b in spec.send] == [
            (torch.bool, False),
            (torch.float32, False),
            (torch.float32, False),
            (torch.float32, True),
        ]
        assert spec.deallocate == (False, False, False, True)
        self.assertExpectedInline(
            chunk_boundaries(parent),
            """\
# chunk 0
def forward(self, input_ids):
    send_expand_2 = fxmeg_ir_ops_send(expand_2, dst_chunk = 1, shape = [2, 1, 16, 16], dtype = torch.bool, grad = False);  expand_2 = None
    send_to_4 = fxmeg_ir_ops_send(to_4, dst_chunk = 1, shape = [1, 16, 8], dtype = torch.float32, grad = False);  to_4 = None
    send_to_5 = fxmeg_ir_ops_send(to_5, dst_chunk = 1, shape = [1, 16, 8], dtype = torch.float32, grad = False);  to_5 = None
    send_add_8 = fxmeg_ir_ops_send(add_8, dst_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_8 = None
    deallocate_add_8 = fxmeg_ir_ops_deallocate(send_add_8);  deallocate_add_8 = None
    return (send_expand_2, send_to_4, send_to_5, send_add_8)

# chunk 1
def forward(self, labels, expand_2, to_4, to_5, add_8):
    recv_expand_2 = fxmeg_ir_ops_recv(expand_2, src_chunk = 0, shape = [2, 1, 16, 16], dtype = torch.bool, grad = False);  expand_2 = None
    recv_to_4 = fxmeg_ir_ops_recv(to_4, src_chunk = 0, shape = [1, 16, 8], dtype = torch.float32, grad = False);  to_4 = None
    recv_to_5 = fxmeg_ir_ops_recv(to_5, src_chunk = 0, shape = [1, 16, 8], dtype = torch.float32, grad = False);  to_5 = None
    recv_add_8 = fxmeg_ir_ops_recv(add_8, src_chunk = 0, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_8 = None
    return (cross_entropy_loss, num_tokens)""",  # noqa: E501 (expected text, compared whole)
        )


def test_parallelize_takes_the_model_as_it_comes():
    model = hf_model("qwen2")
    ids, labels = _batch()
    want = model(input_ids=ids, labels=labels, use_cache=False).loss.item()
    engine = fxmeg.parallelize(model, (ids, labels))
    assert abs(engine.eval_step((ids, labels)).loss - want) <= 1e-6 * want
    assert "model.layers.0.self_attn.q_proj.weight" in engine.named_parameters  # HF's names


def test_eager_experts_are_captured_exportably_with_eager_values(caplog):
    """A mixture of experts whose config names "eager" experts (a loop over the experts
    that received tokens: torch.export cannot trace it) is captured as it comes: fxmeg runs
    its experts with grouped_mm while capturing, says so, and leaves the user's model
    eager. A dense model (transformers reports "eager" for it too) is not touched."""
    cfg = T.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64)
    model = T.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    ids, labels = _batch()
    want = model(input_ids=ids, labels=labels, use_cache=False).loss.item()
    with caplog.at_level(logging.INFO, logger="fxmeg.frontend.capture"):
        engine = fxmeg.parallelize(model, (ids, labels))
    assert (
        "MixtralForCausalLM runs its experts with experts_implementation='grouped_mm', not 'eager'"
        in caplog.text
    )
    assert model.config._experts_implementation == "eager"  # as the user built it
    assert abs(engine.eval_step((ids, labels)).loss - want) <= 1e-6 * want
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fxmeg.frontend.capture"):
        capture(hf_model("llama", n_layer=1), _batch())
    assert not caplog.records


def _padded():
    """A right- and a left-padded row: pad token 0, mask 0 and label -100 at the pads."""
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, 11:] = mask[1, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_padded_dict_batch_is_passed_by_keyword(attn):
    """``model(**batch, use_cache=False).loss``: the mask reaches the model; the first chunk
    reads it and sends the 4-D mask it builds; tensor parallelism keeps that mask whole
    (it broadcasts over the split heads)."""
    model, batch = hf_model("llama", pad_token_id=0, attn_implementation=attn), _padded()
    want = model(**batch, use_cache=False).loss.item()
    assert (
        want != model(**{**batch, "attention_mask": torch.ones(2, 16)}, use_cache=False).loss.item()
    )
    assert abs(fxmeg.parallelize(model, batch).eval_step(batch).loss - want) <= 1e-6 * want
    first, last = (
        chunk_spec(c)
        for c in chunks(
            graph_after(
                hf_model("llama", attn_implementation=attn), batch, "pipeline", num_chunks=2
            )
        )
    )
    assert (first.data_inputs, last.data_inputs) == ((0, 1), (2,))
    assert first.send[0].shape == (2, 1, 16, 16) and not first.send[0].grad
    gm = graph_after(hf_model("llama", attn_implementation=attn), batch, "tensor_parallel", tp=2)
    attention = [
        n
        for n in gm.graph.nodes
        if n.target
        in (torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.softmax.int)
    ]
    # 2 of 4 heads
    assert len(attention) == 2 and all(n.meta["val"].shape[1] == 2 for n in attention)
    masks = {
        n
        for n in gm.graph.nodes
        if n.meta.get("val") is not None and getattr(n.meta["val"], "shape", None) == (2, 1, 16, 16)
    }
    assert masks and not any("tp_slice" in str(u.target) for m in masks for u in m.users)


def test_a_trained_model_saved_by_the_engine_loads_back_with_from_pretrained(tmp_path):
    """engine.save, then ``fxmeg.weights.checkpoint.export(..., format="hf")`` (what `fxmeg export
    --format hf` runs): a tied Llama (lm_head tied to the embedding) loads back with
    AutoModelForCausalLM.from_pretrained with fxmeg's trained weights and gives the logits
    of those weights in the original class; one file, and sharded with an index under a
    small max_shard_size; the tied name written once, as save_pretrained writes it."""
    import json
    import os

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import safe_open

    from fxmeg.weights.checkpoint import export

    config = T.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=True)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 96, (4, 16), generator=g) for _ in range(2)]
    engine = fxmeg.parallelize(model, (batches[0][:2], batches[0][:2]), global_batch_size=4)
    for ids in batches:
        engine.train_step((ids, ids))
    trained = engine.full_state_dict()
    saving = engine.save(str(tmp_path / "ckpt"))
    saving.wait()
    assert saving.path.endswith("iter_0000002")
    ref = T.LlamaForCausalLM(config)
    ref.load_state_dict(trained)
    ids = batches[0]
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    # as save_pretrained keeps them
    untied = {k: v for k, v in trained.items() if k != "lm_head.weight"}
    for name, size in [("one", "50GB"), ("sharded", "20KB")]:
        out = str(tmp_path / name)
        export(str(tmp_path / "ckpt"), out, format="hf", max_shard_size=size)
        # save_pretrained's own split
        hub = split_torch_state_dict_into_shards(untied, max_shard_size=size)
        assert hub.is_sharded == (name == "sharded")
        weights = {f for f in os.listdir(out) if f.endswith(".safetensors")}
        assert weights == set(hub.filename_to_tensors)  # model.safetensors, or model-0000i-of-0000N
        got = {}
        for f in weights:
            with safe_open(os.path.join(out, f), "pt") as st:
                assert st.metadata() == {"format": "pt"}
                got |= {k: f for k in st.keys()}
        assert got == hub.tensor_to_filename  # the tied head once, under the embedding's name
        if hub.is_sharded:
            with open(os.path.join(out, "model.safetensors.index.json")) as f:
                index = json.load(f)
            assert index["weight_map"] == got
            assert index["metadata"]["total_size"] == hub.metadata["total_size"]
        back = T.AutoModelForCausalLM.from_pretrained(out)
        assert type(back) is T.LlamaForCausalLM and back.config.tie_word_embeddings
        for k, v in back.state_dict().items():
            assert torch.equal(v, trained[k]), k
        with torch.no_grad():
            assert torch.equal(back(input_ids=ids).logits, want)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_trained_moe_exports_what_save_pretrained_writes(tmp_path, kind):
    """A tiny Mixtral / Qwen3-MoE trained one step, saved by the engine and exported
    (format hf): the files are what ``save_pretrained`` of a model holding the trained
    state writes, each expert's projections apart under transformers' names, key for key
    and bit for bit, sharded the same way under a small max_shard_size (index included);
    from_pretrained gives that model's logits exactly. ``names="model"`` writes the fused
    banks, which from_pretrained loads too."""
    import json
    import os

    from safetensors.torch import load_file

    from fxmeg.weights.checkpoint import export

    def tensors(directory: str) -> dict:
        files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
        return {k: v for f in files for k, v in load_file(os.path.join(directory, f)).items()}

    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    engine = fxmeg.parallelize(make_model(f"moe-{kind}"), (ids[:2], ids[:2]), global_batch_size=4)
    engine.train_step((ids, ids))
    engine.save(str(tmp_path / "ckpt")).wait()
    model = make_model(f"moe-{kind}")
    model.load_state_dict(engine.full_state_dict())
    for size in ("50GB", "20KB"):
        want, got = str(tmp_path / f"saved-{size}"), str(tmp_path / f"hf-{size}")
        model.save_pretrained(want, max_shard_size=size)
        export(str(tmp_path / "ckpt"), got, format="hf", max_shard_size=size)
        saved = tensors(want)
        assert any(".experts.3." in k for k in saved)  # transformers' saved names
        assert sorted(tensors(got)) == sorted(saved)
        for k, v in tensors(got).items():
            assert v.dtype == saved[k].dtype and torch.equal(v, saved[k]), k
        if size == "20KB":
            index = "model.safetensors.index.json"
            with open(os.path.join(want, index)) as a, open(os.path.join(got, index)) as b:
                assert json.load(a)["weight_map"] == json.load(b)["weight_map"]
        back = T.AutoModelForCausalLM.from_pretrained(got)
        with torch.no_grad():
            assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)
    fused = str(tmp_path / "fused")
    export(str(tmp_path / "ckpt"), fused, format="hf", names="model")
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors(fused)
    with torch.no_grad():
        assert torch.equal(T.AutoModelForCausalLM.from_pretrained(fused)(input_ids=ids).logits,
                           model(input_ids=ids).logits)


def test_an_export_fxmeg_cannot_undo_is_refused_naming_the_tensor(monkeypatch):
    """A conversion whose operations fxmeg does not undo (here a Transpose after the
    experts' merge) is a CheckpointError naming the tensor, the operations and
    names='model'."""
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    import fxmeg.weights.converted
    from fxmeg.errors import CheckpointError
    from fxmeg.interop.hf_export import as_saved, hugging_face_info

    model = make_model("moe-mixtral", n_layer=1)
    converter = WeightConverter(".experts.*.w2.weight", ".experts.down_proj",
                                operations=[MergeModulelist(dim=0), Transpose(1, 2)])
    monkeypatch.setattr(fxmeg.weights.converted, "_conversions", lambda model, _: [converter])
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.experts.down_proj'.*"
                       r"Transpose.*names='model'"):
        as_saved(dict(model.state_dict()), hugging_face_info(model)["config"])


def _shifted(rows: int = 2, seq: int = 16):
    """(input_ids, labels) pre-shifted as for a model that does not shift (the README's
    plain GPT), the first labels of row 1 ignored."""
    tokens = torch.randint(0, 128, (rows, seq + 1), generator=torch.Generator().manual_seed(1))
    ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[1, :3] = -100
    return ids, labels


def test_pre_shifted_labels_warn_for_a_causal_lm():
    """A Hugging Face causal LM shifts labels itself: given pre-shifted ones it would learn
    the token two ahead. parallelize / transform warn (before capture); labels = input_ids,
    a plain model or the user's own loss_fn do not."""
    ids, labels = _shifted()
    with pytest.warns(
        UserWarning,
        match=r"LlamaForCausalLM got labels equal to its input_ids shifted by one "
        r".*Hugging Face causal LMs shift labels themselves: pass "
        r"labels=input_ids .*see docs/hugging-face.md",
    ):
        graph_after(hf_model("llama", n_layer=1), (ids, labels), "loss")
    with pytest.warns(UserWarning, match="shift labels themselves"):  # a dict batch too
        graph_after(hf_model("llama", n_layer=1), {"input_ids": ids, "labels": labels}, "loss")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        # Hugging Face's own convention
        graph_after(hf_model("llama", n_layer=1), (ids, ids), "loss")
        graph_after(
            hf_model("llama", n_layer=1),
            {"input_ids": ids, "labels": ids, "shift_labels": labels},
            "loss",
        )
        graph_after(make_model("gpt"), (ids, labels), "loss")  # the README's GPT: it does not shift
        fxmeg.interop.hugging_face.warn_shifted_labels(
            hf_model("llama", n_layer=1),
            (ids, labels),
            # the user's loss reads them
            loss_fn=lambda model, i, l: None,
        )
