"""The failing calls of tests/repo/refusals.py's rows: tiny models, batches, configs and
engines, each built to trip one refusal of docs/errors.md."""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch import nn

import fxmeg
from fxmeg.train.cli import _train_parser, config_from
from fxmeg.weights.checkpoint import Checkpointer, export
from tests.harness.helpers import make_batch
from tests.harness.models import make_model, saved_names


def _ex(rows=2, **kw):
    return make_batch(rows, seed=0, **kw)


class _Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 8)])

    def forward(self, ids, labels):
        return self.layers[0](ids)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 8)])

    def forward(self, ids, labels):
        h = self.layers[0](ids)
        return h.sum() if h.sum() > 0 else h.mean()


class _Squared(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 128)])

    def forward(self, ids, labels):
        return nn.functional.cross_entropy(self.layers[0](ids).flatten(0, 1), labels.flatten()) ** 2


class _BatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.bn = nn.Embedding(128, 8), nn.BatchNorm1d(16)

    def forward(self, ids, labels):
        return self.bn(self.emb(ids)).mean()


class _SplitVariance(nn.Module):
    """The variance over a column-parallel linear's split output: not a sum, not all-reduced."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(128, 16), nn.Linear(16, 128)
        self.layers = nn.ModuleList(
            [nn.ModuleDict({"up": nn.Linear(16, 32), "down": nn.Linear(32, 16)})]
        )

    def forward(self, ids, labels):
        x = self.emb(ids)
        h = self.layers[0]["up"](x)
        x = x + self.layers[0]["down"](h - h.var(-1, keepdim=True))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _engine():
    return fxmeg.parallelize(make_model("gpt"), _ex(), global_batch_size=4)  # dp=2


def _bad_batch(change):
    ids, labels = make_batch(4, seed=1)
    return change(ids, labels)


def _keyword_engine():
    ids, labels = _ex()
    return fxmeg.parallelize(
        make_model("gpt"), {"input_ids": ids, "labels": labels}, global_batch_size=4
    )


def _config_file(text: str):
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    parser = argparse.ArgumentParser()
    _train_parser(parser)
    return config_from(parser.parse_args(["--config", f.name]))


_SAVED: dict = {}
"""The GPT checkpoint and the engine of the ``incompatible-checkpoint`` row, for the
rows after it (SET_UP runs in order)."""


def _checkpoint_of_another_model():
    directory = os.path.join(tempfile.gettempdir(), f"fxmeg-errors-{os.getppid()}")
    big = fxmeg.parallelize(make_model("gpt", n_layer=2), _ex(), global_batch_size=4)
    Checkpointer(big.program, big.context).save(directory, 1, {})
    engine = fxmeg.parallelize(make_model("gpt", n_layer=1), _ex(), global_batch_size=4)
    small = Checkpointer(engine.program, engine.context)
    _SAVED.update(directory=directory, engine=engine)
    return lambda: small.load(directory)


def _export(**kw):
    """An export of the GPT checkpoint ``_checkpoint_of_another_model`` saved (no
    Hugging Face config), into this rank's own directory unless ``out`` is given."""
    out = kw.pop("out", None) or tempfile.mkdtemp()
    return lambda: export(_SAVED["directory"], out, **kw)


def _export_of_an_unknown_class():
    """An export in saved names of the GPT checkpoint, its meta.json made to record a
    transformers class this transformers does not have."""
    import json
    import shutil

    from fxmeg.weights.checkpoint import META, find_complete

    copy = os.path.join(tempfile.mkdtemp(), "iter")
    shutil.copytree(find_complete(_SAVED["directory"]), copy)
    with open(os.path.join(copy, META)) as f:
        meta = json.load(f)
    meta["hugging_face"] = {"config": {"architectures": ["NoSuchForCausalLM"]}, "tied": []}
    with open(os.path.join(copy, META), "w") as f:
        json.dump(meta, f)
    return lambda: export(copy, tempfile.mkdtemp(), format="safetensors")


def _meta(name, **cfg):
    with torch.device("meta"):
        return make_model(name, **cfg)


class _CumulativeMix(nn.Module):
    """A running mean over the sequence: positions mix outside attention."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 128)])

    def forward(self, ids, labels):
        h = self.layers[0](ids).cumsum(dim=1)
        return nn.functional.cross_entropy(h.flatten(0, 1), labels.flatten())


class _MaskedAttention(nn.Module):
    """Attention under a padding mask built from the token ids: it depends on a split input
    (a mask built from positions only is cut to each rank's rows)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 128)])

    def forward(self, ids, labels):
        h = self.layers[0](ids).unsqueeze(1)  # (b, 1, s, 128)
        mask = (ids != 0)[:, None, None, :]  # (b, 1, 1, s): keys that are not padding
        h = nn.functional.scaled_dot_product_attention(h, h, h, attn_mask=mask).squeeze(1)
        return nn.functional.cross_entropy(h.flatten(0, 1), labels.flatten())


def _weights(change):
    state = change(make_model("gpt").state_dict())
    path = os.path.join(tempfile.gettempdir(), f"fxmeg-errors-weights-{os.getpid()}.safetensors")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, path)
    return path


def _half_meta():
    model = make_model("gpt")
    model.lm_head = nn.Linear(32, 128, bias=False, device="meta")
    return model


def _hugging_face(**args):
    """What `fxmeg train --model transformers:LlamaForCausalLM --seq-len 32` builds (on meta)."""
    from fxmeg.train.build import build_model

    small = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    with torch.device("meta"):
        return build_model("transformers:LlamaForCausalLM", {"seq_len": 32} | small | args)


def _moe_batch():
    ids, labels = _ex()
    return {"input_ids": ids, "labels": labels}


def _unknown_conversion():
    """A meta Mixtral loading its weights in transformers' saved names (one tensor per expert
    and projection) whose conversion, as transformers is made to state it here, transposes a
    bank after merging the experts: an operation fxmeg does not apply while reading."""
    from unittest import mock

    import transformers.conversion_mapping as conversion

    saved = saved_names(make_model("moe-mixtral", n_layer=1))
    real = conversion.get_model_conversion_mapping

    def transposing(hf):
        out = real(hf)
        for t in out:
            if getattr(t, "target_patterns", None) == [".experts.down_proj"]:
                t.operations.append(conversion.Transpose(1, 2))
        return out

    with torch.device("meta"):
        meta = make_model("moe-mixtral", n_layer=1)
    with mock.patch.object(conversion, "get_model_conversion_mapping", transposing):
        fxmeg.parallelize(meta, _moe_batch(), weights=saved, ep=2, global_batch_size=4)


def _three_experts():
    """A one-layer Hugging Face Mixtral with 3 experts (top-2): ep=2 cannot split them."""
    import transformers as T

    cfg = T.AutoConfig.for_model(
        "mixtral",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        num_local_experts=3,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg)


class _Bank(nn.Module):
    """A 3-D trainable parameter read by plain matmuls, not by a grouped-experts block."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(128, 16)])
        self.bank = nn.Parameter(torch.randn(2, 16, 128) * 0.1)

    def forward(self, ids, labels):
        h = self.layers[0](ids)
        return nn.functional.cross_entropy(
            (h @ self.bank[0] + h @ self.bank[1]).flatten(0, 1), labels.flatten()
        )


# row id -> (set-up returning the failing call, or the failing call itself; message)
def _data(**kw):
    """The trainer's data (``train_data``) of ``_config(**kw)``."""
    from fxmeg.train.trainer import train_data

    return train_data(_config(**kw))


def _config(*, truncated: bool = False, vocab: int | None = 300, split: str = "90,10,0", **flags):
    """The TrainConfig reading a small indexed dataset written here (with a PREFIX.json
    naming ``vocab``, unless None), with ``flags``."""
    import numpy as np

    from fxmeg.data.indexed import write_indexed
    from fxmeg.train.trainer import TrainConfig

    prefix = os.path.join(tempfile.mkdtemp(prefix="fxmeg-errors-data-"), "data")
    write_indexed(prefix, (np.arange(40, dtype=np.uint16) % 250 + k for k in range(30)), np.uint16)
    if truncated:
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(os.path.getsize(prefix + ".bin") - 6)
    if vocab is not None:
        with open(prefix + ".json", "w") as f:
            f.write(f'{{"vocab_size": {vocab}}}')
    where = {} if "data_path" in flags else {"data": prefix}
    return TrainConfig.from_flat(**(where | {"split": split} | flags), seq_len=16, train_iters=2,
                                 global_batch_size=4, micro_batch_size=2, eval_iters=1)


def _sft(lines: list[str], **flags):
    """The trainer's --sft data of a JSON-lines file holding ``lines``
    (tests/harness/sft_data.py's tokenizer)."""
    from fxmeg.train.trainer import TrainConfig, train_data
    from tests.harness import sft_data

    root = tempfile.mkdtemp(prefix="fxmeg-errors-data-")
    path = os.path.join(root, "sft.jsonl")
    with open(path, "w") as f:
        f.writelines(line + "\n" for line in lines)
    return train_data(
        TrainConfig.from_flat(
            sft=True,
            data_path=path,
            tokenizer_model=sft_data.write_tokenizer(root),
            seq_len=16,
            train_iters=2,
            global_batch_size=4,
            micro_batch_size=2,
            eval_iters=1,
            **flags,
        )
    )


def _trainer(**kw):
    from fxmeg.train.trainer import Trainer

    return Trainer(_config(**kw))


def _json_lines(text: str):
    """`fxmeg prepare-data --json-keys text` reading a JSON-lines file holding ``text``."""
    from fxmeg.data.corpus import read_json_lines

    path = os.path.join(tempfile.mkdtemp(prefix="fxmeg-errors-data-"), "in.jsonl")
    with open(path, "w") as f:
        f.write(text)
    return read_json_lines([path], "text")


def _taken_run_dir() -> str:
    path = tempfile.mkdtemp()
    open(os.path.join(path, "metrics.jsonl"), "w").close()
    return path
