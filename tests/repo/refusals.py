"""The refusals docs/errors.md lists, as rows: each row's failing call and an excerpt of
the error it must raise (ROWS), or, for SET_UP, a builder of a working engine that returns
the failing call. tests/repo/test_errors.py runs every row on real ranks."""

from __future__ import annotations

import tempfile

import torch

import fxmeg
from fxmeg.runtime.optimizer.optimizer import muon_adamw
from fxmeg.train.metrics import run_directory
from fxmeg.train.train_config import TrainConfig
from tests.harness.helpers import make_batch
from tests.harness.models import hf_model, make_model
from tests.passes.test_context_parallel import _Window
from tests.passes.test_expert_parallel import BatchedExperts
from tests.passes.test_tp_heads import _KeyReadWhole
from tests.repo.refusal_cases import (
    _SAVED,
    _bad_batch,
    _Bank,
    _BatchNorm,
    _checkpoint_of_another_model,
    _config_file,
    _CumulativeMix,
    _data,
    _DataDependent,
    _engine,
    _ex,
    _export,
    _export_of_an_unknown_class,
    _half_meta,
    _hugging_face,
    _json_lines,
    _keyword_engine,
    _Logits,
    _MaskedAttention,
    _meta,
    _moe_batch,
    _sft,
    _SplitVariance,
    _Squared,
    _taken_run_dir,
    _three_experts,
    _trainer,
    _unknown_conversion,
    _weights,
)

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
