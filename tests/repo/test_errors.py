"""Every bad input of docs/errors.md is refused with an FxmegError that names the cause,
on real ranks, before any process group or collective (every public function of
torch.distributed that sends or makes a group is counted: COUNTED)."""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

import fxmeg
from fxmeg.runtime.optimizer.optimizer import muon_adamw
from fxmeg.train.cli import _train_parser, config_from
from fxmeg.train.metrics import run_directory
from fxmeg.train.train_config import TrainConfig
from fxmeg.weights.checkpoint import Checkpointer, export
from tests.harness.distributed import run_world
from tests.harness.helpers import make_batch
from tests.harness.models import hf_model, make_model, saved_names
from tests.passes.test_context_parallel import _Window
from tests.passes.test_expert_parallel import BatchedExperts
from tests.passes.test_tp_heads import _KeyReadWhole

SENDS_NOTHING = {
    "supports_complex": "whether a reduce op takes complex tensors",
    "record_comm": "a context manager naming the collectives inside it for the profiler",
}
"""Public functions of torch.distributed that are neither collectives, point-to-point sends
nor group set-up, besides the ``get_*`` and ``is_*`` queries; each with what it does."""
COUNTED = sorted(
    name
    for name in c10d.__all__
    # type(), not inspect: reading the deprecated ``reduce_op`` as an object warns
    if type(getattr(c10d, name)) in (types.FunctionType, types.BuiltinFunctionType)
    and not name.startswith(("get_", "is_"))
    and name not in SENDS_NOTHING
)
"""Every other public function of torch.distributed, as torch lists it (a new one is counted
unless named above): collectives and their object and coalesced forms, sends and receives,
and what makes or ends a process group."""


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


ROWS = {
    "data-indexed": (lambda: _data(truncated=True), "the .bin is truncated or from another run"),
    "data-weights": (
        lambda: _data(data_path="0 a 0 b"),
        "--data-path weights ['0', '0'] must be non-negative",
    ),
    "data-sources": (
        lambda: _data(data_path="a", train_data_path="b"),
        "give either --data-path (cut by --split) or the per-split paths",
    ),
    "data-split-empty": (
        lambda: _data(split="100,0,0"),
        "split '100,0,0' leaves no validation data",
    ),
    "data-vocabulary": (
        lambda: _data(vocab=None),
        "pass --tokenizer-model PATH (the tokenizer.json the data was made with) or --vocab-size N",
    ),
    "data-tokenizer": (
        lambda: _data(tokenizer_model="/nonexistent/tok"),
        "tokenizer '/nonexistent/tok': /nonexistent/tok does not exist",
    ),
    "data-eod": (
        lambda: _data(eod_mask_loss=True, reset_attention_mask=True),
        "--eod-mask-loss --reset-attention-mask needs the end-of-document id",
    ),
    "data-mask-model": (
        lambda: _trainer(reset_position_ids=True, eod_id=0),
        "--reset-position-ids: GPT takes only token ids and labels",
    ),
    "data-sft-line": (
        lambda: _sft(['{"prompt": "a", "response": "b"}', '{"prompt": "c"}']),
        "sft.jsonl:2 has no string fields 'prompt' and 'response' (it has ['prompt'])",
    ),
    "sft-config": (
        lambda: _sft([], sft_layout="padded"),
        "--sft-layout padded pads each global batch to its own length: add --variable-seq-lengths",
    ),
    "data-json-key": (
        lambda: list(_json_lines('{"text": "a"}\n{"body": "b"}\n')),
        "in.jsonl:2 has no text field 'text' (it has ['body'])",
    ),
    "data-token-range": (
        lambda: _data(vocab=10).batch("train", range(4)),
        "which a vocabulary of 10 cannot hold",
    ),
    "size-zero": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=0),
        "pp=0: pipeline-parallel size must be a positive integer (got 0); pass pp=1 or more",
    ),
    "size-type": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), tp="2"),
        "tp='2': tensor-parallel size must be an int, got str '2'; pass tp=2",
    ),
    "megatron-name-conflict": (
        lambda: TrainConfig.from_flat(data="x", train_iters=1, tensor_model_parallel_size=2, tp=4),
        "tensor_model_parallel_size=2 (Megatron's name) and tp=4 disagree",
    ),
    "lr-units": (
        lambda: TrainConfig.from_flat(data="x", train_samples=64, lr_warmup_iters=3),
        "lr_warmup_iters=3 counts steps, but the run is given in samples",
    ),
    "run-dir-taken": (
        lambda: run_directory(_taken_run_dir(), resuming=False),
        "holds the metrics of an earlier run, and this run resumes none",
    ),
    "size-negative": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), global_batch_size=-4),
        (
            "global_batch_size=-4: global batch size (samples per optimizer step) must be a "
            "positive integer (got -4)"
        ),
    ),
    "world-size": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2, dp=2),
        "tp * pp * dp = 1 * 2 * 2 = 4 does not match the world size 2",
    ),
    "global-batch": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), global_batch_size=6),
        "global_batch_size=6 is not divisible by micro_batch_size * dp = 2 * 2 = 4",
    ),
    "pipeline-chunks": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2, vpp=4, global_batch_size=4),
        "pp * vpp = 8 chunks, but the model has only 4 blocks",
    ),
    "interleaved-microbatches": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2, vpp=2, global_batch_size=6),
        "needs the micro-batch count m to be a multiple of pp=2",
    ),
    "v-schedule-vpp": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2, schedule="zbv"),
        "schedule='zbv' runs two chunks per pipeline rank in a V: it needs vpp=2",
    ),
    "dualpipev-microbatches": (
        lambda: fxmeg.parallelize(
            make_model("gpt"), _ex(), pp=2, vpp=2, schedule="dualpipev", global_batch_size=6
        ),
        "the dualpipev schedule needs at least 2 * pp = 4 micro-batches; got m=3",
    ),
    "tp-heads": (
        lambda: fxmeg.parallelize(make_model("gpt", n_embd=48, n_head=3), _ex(), tp=2),
        "tp=2 does not divide 3, the number of heads",
    ),
    "tp-kv-heads": (
        lambda: fxmeg.parallelize(_KeyReadWhole(), _ex(vocab=96), tp=2),
        "cannot replicate the key/value projection 'layers.0.k' over tp=2 ranks",
    ),
    "tp-vocabulary": (
        lambda: fxmeg.parallelize(make_model("gpt", vocab_size=127), _ex(vocab=127), tp=2),
        "pad the vocabulary to a multiple of 2 (e.g. 128)",
    ),
    "tp-unsplittable": (
        lambda: fxmeg.parallelize(_SplitVariance(), _ex(), tp=2),
        "it reduces over dim 2, which is split over tp ranks",
    ),
    "cp-sequence-length": (
        lambda: fxmeg.parallelize(make_model("gpt", seq_len=18), _ex(seq=18), cp=2),
        "sequence length 18 (dim 1 of input 'input_ids') is not divisible by 2 * cp = 4",
    ),
    "cp-position-mixing": (
        lambda: fxmeg.parallelize(_CumulativeMix(), _ex(), cp=2),
        (
            "cannot split node 'cumsum' (cumsum.default, module '') along the sequence "
            "over cp=2 ranks: it mixes positions outside attention"
        ),
    ),
    "cp-attention-mask": (
        lambda: fxmeg.parallelize(_MaskedAttention(), _ex(), cp=2),
        (
            "a mask that depends on the split inputs (padding): mask 'unsqueeze_2' is computed "
            "from input(s) ['ids'], which are cut along the sequence"
        ),
    ),
    "cp-comm-type": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), cp=2, cp_comm_type="ring"),
        "cp_comm_type='ring' is not one of ['all_gather', 'p2p', 'a2a', 'a2a+p2p']",
    ),
    "cp-a2a-size": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), cp=2, cp_comm_type="a2a+p2p",
                                  cp_a2a_size=3),
        "cp_a2a_size=3 does not divide cp=2",
    ),
    "cp-a2a-heads": (
        lambda: fxmeg.parallelize(_Window(), _ex(), cp=2, cp_comm_type="a2a"),
        "cp_comm_type='a2a' splits its 1 query and 1 key/value heads over cp=2 ranks",
    ),
    "cp-comm-eager": (
        lambda: fxmeg.parallelize(hf_model("llama", attn_implementation="eager"), _ex(), cp=2,
                                  cp_comm_type="p2p"),
        "it is eager attention (q @ k^T, softmax, @ v), which only cp_comm_type='all_gather'",
    ),
    "example-batch-size": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), micro_batch_size=4),
        "batch dimension is 2, but micro_batch_size=4",
    ),
    "example-batch-dims": (
        lambda: fxmeg.parallelize(make_model("gpt"), (_ex()[0], _ex(3)[1])),
        "every example input needs the same batch dimension",
    ),
    "example-kind": (
        lambda: fxmeg.parallelize(make_model("gpt"), list(_ex())),
        "example_inputs must be one micro-batch: a non-empty tuple of tensors",
    ),
    "no-scalar-loss": (lambda: fxmeg.parallelize(_Logits(), _ex()), "not a scalar loss"),
    "uncapturable": (
        lambda: fxmeg.parallelize(_DataDependent(), _ex()),
        "torch.export could not capture _DataDependent",
    ),
    "unrecognised-loss": (
        lambda: fxmeg.parallelize(_Squared(), _ex()),
        "cannot recognise the loss",
    ),
    "buffer-update": (
        lambda: fxmeg.parallelize(_BatchNorm(), _ex()),
        "updates bn.num_batches_tracked in place",
    ),
    "split-point": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2, split_points=["layers.9"]),
        "split point 'layers.9' names no block",
    ),
    "schedule-name": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2, schedule="1f1f"),
        "did you mean '1f1b'",
    ),
    "precision": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), precision="fp8"),
        "precision='fp8' is not one of ('fp32', 'bf16', 'fp16')",
    ),
    "unknown-option": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), on_nonfinit="raise"),
        "unknown option 'on_nonfinit' (did you mean 'on_nonfinite'?)",
    ),
    "sequence-parallel-without-tp": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), sequence_parallel=True),
        "sequence_parallel=True needs tp > 1",
    ),
    "optimizer-sharding": (
        lambda: fxmeg.parallelize(
            make_model("gpt"),
            _ex(),
            distributed_optimizer=True,
            optimizer_sharding="elementwise",
            optimizer=muon_adamw(),
        ),
        "the inner optimizer Muon needs whole parameters; use optimizer_sharding='layerwise'",
    ),
    "zero-stage": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), zero=4),
        "zero=4 must be one of (0, 1, 2, 3)",
    ),
    "zero-distributed-optimizer": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), zero=0, distributed_optimizer=True),
        "distributed_optimizer=True is zero=1, but zero=0 was given",
    ),
    "zero-layerwise": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), zero=3, optimizer=muon_adamw()),
        (
            "zero=3 keeps each data-parallel rank's flat slice of every gradient bucket and "
            "parameter, "
            "but the distributed optimizer runs layer-wise here (Muon needs whole parameters); use "
            "zero=1"
        ),
    ),
    "zero3-unsupported": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), zero=3, compile=True),
        "zero=3 does not run with compile=True",
    ),
    "reshard-without-zero3": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), zero=1, reshard_after_forward=False),
        "reshard_after_forward=False needs zero=3 (zero=1 keeps whole parameters anyway)",
    ),
    "backward-prefetch": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), zero=2, backward_prefetch="post"),
        "backward_prefetch='post' needs zero=3 (zero=2 gathers no parameters in backward)",
    ),
    "config-file-key": (
        lambda: _config_file('data = "x"\ntrain_iters = 1\nglobal_bach_size = 8\n'),
        "unknown config key 'global_bach_size'",
    ),
    "model-arg-unknown": (
        lambda: _hugging_face(hiden_size=32),
        (
            "'hiden_size' is not a field of LlamaConfig (the config of LlamaForCausalLM) "
            "(did you mean 'hidden_size'?)"
        ),
    ),
    "model-arg-rejected": (
        lambda: _hugging_face(hidden_size=30),
        "The hidden size (30) is not a multiple of the number of attention heads (4)",
    ),
    "model-positions": (
        lambda: _hugging_face(max_position_embeddings=16),
        (
            "--seq-len 32 is longer than LlamaForCausalLM's position table "
            "(max_position_embeddings=16 in --model-args)"
        ),
    ),
    "model-attention": (
        lambda: _hugging_face(attn_implementation="flash_attention_2"),
        "fxmeg captures 'sdpa' and 'eager' attention",
    ),
    "batch-size-schedule": (
        lambda: _config_file(
            'data = "x"\ntrain_iters = 1\nstep_batch_size_schedule = "64:16 '
            '128:8"\nglobal_batch_size = 8\n'
        ),
        "would shrink the global batch from 16 to 8",
    ),
    "weights-missing": (
        lambda: fxmeg.parallelize(
            _meta("gpt"),
            _ex(),
            weights=_weights(
                lambda sd: {k: v for k, v in sd.items() if k != "layers.1.mlp.fc.weight"}
            ),
        ),
        "'layers.1.mlp.fc.weight'",
    ),
    "weights-shape": (
        lambda: fxmeg.parallelize(
            _meta("gpt"),
            _ex(),
            weights=_weights(lambda sd: {**sd, "layers.0.mlp.fc.bias": torch.zeros(64)}),
        ),
        "(64,)",
    ),
    "weights-other-model": (
        lambda: fxmeg.parallelize(_meta("gpt"), _ex(), weights=make_model("llama").state_dict()),
        "another model",
    ),
    "init-missing": (
        lambda: fxmeg.parallelize(_meta("llama"), _ex()),
        (
            "cannot initialise module '<root>' (Llama) of a model built on meta: Llama has no "
            "reset_parameters()"
        ),
    ),
    "init-unwritten": (
        lambda: fxmeg.parallelize(_meta("gpt"), _ex(), init_fn=lambda m: None),
        "init_fn left weight unwritten",
    ),
    "meta-mixed": (lambda: fxmeg.parallelize(_half_meta(), _ex()), "build the whole model under"),
    "ep-size": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), ep=4),
        (
            "ep=4 does not divide dp = 2: experts are split over ep ranks carved out of the "
            "data-parallel "
            "ranks; choose ep among [1, 2]"
        ),
    ),
    "ep-layerwise": (
        lambda: fxmeg.parallelize(
            make_model("gpt"),
            _ex(),
            ep=2,
            distributed_optimizer=True,
            optimizer_sharding="layerwise",
        ),
        "ep=2 does not run with optimizer_sharding='layerwise' yet",
    ),
    "ep-experts": (
        lambda: fxmeg.parallelize(_three_experts(), _moe_batch(), ep=2),
        (
            "ep=2 does not divide the 3 experts of MixtralForCausalLM "
            "(MixtralConfig.num_local_experts=3)"
        ),
    ),
    "weights-conversion": (
        lambda: _unknown_conversion(),
        "transformers makes 'model.layers.0.mlp.experts.down_proj' from ['.experts.*.w2.weight'] "
        "with MergeModulelist(dim=0), Transpose, which fxmeg does not apply",
    ),
    "expert-tp-size": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), tp=2, expert_tensor_parallel_size=4),
        "expert_tensor_parallel_size=4 with tp=2: fxmeg splits the experts over all tp ranks or "
        "none",
    ),
    "global-aux-loss-zero-bubble": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2, schedule="zbh1",
                                  moe_router_load_balancing_type="global_aux_loss"),
        "moe_router_load_balancing_type='global_aux_loss' does not run with schedule='zbh1'",
    ),
    "router-bias-zero-bubble": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2, schedule="zbh1",
                                  moe_router_bias_update_rate=1e-3),
        "moe_router_bias_update_rate=0.001 does not run with schedule='zbh1': a zero-bubble "
        "schedule runs forward as a traced graph that does not count the tokens per expert",
    ),
    "router-bias-compile": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), compile=True,
                                  moe_router_bias_update_rate=1e-3),
        "moe_router_bias_update_rate=0.001 does not run with compile=True: the tokens per expert "
        "are counted outside the compiled graphs",
    ),
    "max-pending-w": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2, max_pending_w=1),
        "max_pending_w=1 caps the weight gradients a zero-bubble schedule defers, and "
        "schedule='1f1b' defers none: use schedule='zbh1', 'zbv' or 'dualpipev', or drop "
        "max_pending_w",
    ),
    "overlap-ep-comm": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), pp=2,
                                  overlap_moe_expert_parallel_comm=True),
        "overlap_moe_expert_parallel_comm=True overlaps the expert all-to-alls of DualPipeV's "
        "paired forward and backward: it needs ep > 1 and schedule='dualpipev'; got ep=1, "
        "schedule='1f1b'",
    ),
    "overlap-ep-comm-with": (
        lambda: TrainConfig.from_flat(data="x", train_iters=1, pp=2, vpp=2, schedule="dualpipev",
                                      ep=2, compile=True, overlap_moe_expert_parallel_comm=True),
        "overlap_moe_expert_parallel_comm=True does not run with compile=True: the second lane "
        "runs eager graphs; set compile=False",
    ),
    "ep-no-experts": (
        lambda: fxmeg.parallelize(make_model("gpt"), _ex(), ep=2),
        "ep=2, but fxmeg finds no routed experts in this model",
    ),
    "ep-unfound-experts": (
        lambda: fxmeg.parallelize(_Bank(), _ex(), ep=2),
        "ep > 1, but fxmeg cannot find the routed experts that read 'bank' (shape [2, 16, 128]",
    ),
    "ep-batched-experts": (
        lambda: fxmeg.parallelize(BatchedExperts(scores="softmax"), _ex(), ep=2),
        (
            "expert_parallel: fxmeg cannot show that the routing scores 'softmax' (node 'bmm', "
            "module '') are zero outside each token's top-k experts"
        ),
    ),
}
SET_UP = {  # rows whose failing call needs a working engine first: counted from the call on
    "batch-shape": (
        lambda: (
            lambda e=_engine(): lambda: e.train_step(_bad_batch(lambda i, l: (i[:, :15], l)))
        )(),
        "'input_ids' has shape (4, 15)",
    ),
    "seq-above-positions": (
        lambda: (
            lambda e=fxmeg.parallelize(
                make_model("gpt"), _ex(), global_batch_size=4, variable_seq_lengths=True
            ): (
                lambda: e.train_step(make_batch(4, seed=1, seq=24))
            )
        )(),
        (
            "input 'input_ids' has sequence length 24 (dimension 1), but the model's position "
            "embedding 'wpe' has 16 rows"
        ),
    ),
    "batch-dtype": (
        lambda: (
            lambda e=_engine(): lambda: e.train_step(_bad_batch(lambda i, l: (i, l.float())))
        )(),
        "'labels' has shape (4, 16) and dtype torch.float32",
    ),
    "batch-keys": (
        lambda: (
            lambda e=_keyword_engine(): (
                lambda: e.train_step(_bad_batch(lambda i, l: {"input_ids": i, "label": l}))
            )
        )(),
        "has keys 'input_ids', 'label' (missing 'labels'; unknown 'label')",
    ),
    "batch-kind": (
        lambda: (
            lambda e=_keyword_engine(): lambda: e.train_step(_bad_batch(lambda i, l: (i, l)))
        )(),
        "a global batch must be a dict with the example's keys ('input_ids', 'labels')",
    ),
    "labels-out-of-range": (
        lambda: (
            lambda e=_engine(): (
                lambda: e.train_step(
                    _bad_batch(lambda i, l: (i, l.index_fill(1, torch.tensor([3]), 300)))
                )
            )
        )(),
        "'labels' holds 300 at (0, 3): labels (classes of the loss) must be in 0..127 or -100",
    ),
    "token-ids-out-of-range": (
        lambda: (
            lambda e=_engine(): (
                lambda: e.train_step(
                    _bad_batch(lambda i, l: (i.index_fill(1, torch.tensor([2]), 128), l))
                )
            )
        )(),
        "'input_ids' holds 128 at (0, 2): token ids (rows of embedding 'wte') must be in 0..127",
    ),
    "incompatible-checkpoint": (_checkpoint_of_another_model, "is from an incompatible model"),
    "no-checkpoint": (
        lambda: (lambda e=_SAVED["engine"], d=tempfile.mkdtemp(): lambda: e.load(d))(),
        "): no checkpoint there (no iter_* directory); pass the directory engine.save",
    ),
    "export-format": (
        lambda: _export(format="onnx"),
        "export format='onnx': choose one of 'pt', 'hf'",
    ),
    "export-hf-no-config": (
        lambda: _export(format="hf"),
        "with format 'hf': the checkpoint records no Hugging Face config",
    ),
    "export-to-a-file": (
        lambda: _export(format="safetensors", out=tempfile.mkstemp()[1]),
        ": it is a file, and this format writes a directory",
    ),
    "shard-size": (
        lambda: _export(format="safetensors", max_shard_size="5 gigs"),
        "max_shard_size='5 gigs' is not a size",
    ),
    "export-names": (
        lambda: _export(format="hf", names="fused"),
        "export names='fused': choose one of 'saved', 'model'",
    ),
    "export-saved-names": (
        _export_of_an_unknown_class,
        "export in transformers' saved names: the checkpoint's model class 'NoSuchForCausalLM' "
        "is not in transformers",
    ),
}


def run(rank: int) -> dict:
    counts = {name: 0 for name in COUNTED}
    for name in COUNTED:
        original = getattr(c10d, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        # torch.distributed re-exports c10d's functions: a call through either is counted
        setattr(dist, name, counted)
        setattr(c10d, name, counted)
    out = {}
    for row, (make, _) in {**ROWS, **SET_UP}.items():
        call = make() if row in SET_UP else make
        for name in counts:
            counts[name] = 0
        try:
            call()
            out[row] = ("no error", {})
        except fxmeg.FxmegError as err:
            out[row] = (str(err), {k: v for k, v in counts.items() if v})
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(2, run)


@pytest.mark.parametrize("row", list(ROWS) + list(SET_UP))
def test_refused_with_its_cause_before_any_collective(results, row):
    expected = {**ROWS, **SET_UP}[row][1]
    for rank in results:
        message, calls = rank[row]
        assert expected in message, message
        assert calls == {}, f"{row}: {calls} before failing"


def test_every_collective_is_counted():
    """COUNTED is read from torch: it holds the collectives this test counted by hand before
    (and those it missed: all_to_all_single, reduce, gather_object, ...), and each name is
    torch.distributed's own function."""
    by_hand = {"new_group", "all_reduce", "broadcast", "barrier", "all_gather",
               "all_gather_object", "batch_isend_irecv", "isend", "irecv", "send", "recv",
               "reduce_scatter_tensor", "all_gather_into_tensor", "gather", "scatter",
               "broadcast_object_list", "all_to_all", "all_to_all_single", "reduce",
               "reduce_scatter", "gather_object", "scatter_object_list", "send_object_list",
               "recv_object_list", "monitored_barrier", "all_reduce_coalesced"}
    assert by_hand <= set(COUNTED), f"COUNTED lacks {sorted(by_hand - set(COUNTED))}"
    assert all(getattr(dist, name) is getattr(c10d, name) for name in COUNTED)
    assert set(SENDS_NOTHING) <= set(c10d.__all__), "a name torch no longer has: drop it"


def test_the_table_in_docs_lists_every_row():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "errors.md")
    # the first table; later sections' rows are collective checks, tested elsewhere
    with open(path) as f:
        first = f.read().split("\n## ")[0]
    documented = re.findall(r"^\| `([a-z0-9-]+)` \|", first, flags=re.M)
    assert sorted(documented) == sorted(list(ROWS) + list(SET_UP))
    assert len(documented) >= 15


