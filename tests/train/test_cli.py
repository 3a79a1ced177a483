"""`fxmeg prepare-data`, `fxmeg train` (its own ranks via torch's elastic launcher, or
two torchrun "nodes"), `fxmeg plot`, and SIGTERM, as a user runs them."""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch

from fxmeg.train.metrics import read

FIELDS = {
    "iteration",
    "consumed_samples",
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "params_norm",
    "skipped",
    "skipped_total",
    "tokens_per_s",
    "tflops_per_rank",
    "iteration_time",
    "batch_size",
}
MODEL = '{"n_layer": 4, "n_embd": 64, "n_head": 4}'


def fxmeg(*args, **kw):
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fxmeg.train.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("corpus") / "text")
    out = fxmeg("prepare-data", "--input", "pydoc:topics", "--output", prefix)
    assert out.returncode == 0, out.stderr
    assert "tokens in" in out.stdout and os.path.exists(prefix + ".bin")
    return prefix


def test_train_on_four_ranks_and_plot(corpus, tmp_path):
    run = str(tmp_path / "run")
    out = fxmeg(
        "train",
        "--data",
        corpus,
        "--model-args",
        MODEL,
        "--pipeline-model-parallel-size",
        "2",
        "--dp",
        "2",
        "--use-distributed-optimizer",
        "--seq-len",
        "64",
        "--global-batch-size",
        "32",
        "--train-iters",
        "30",
        "--lr",
        "3e-3",
        "--lr-warmup-samples",
        "64",
        "--eval-interval",
        "10",
        "--eval-iters",
        "4",
        "--log-interval",
        "5",
        "--run-dir",
        run,
        "--no-progress",
        "--trace",
        str(tmp_path / "trace"),
        "--trace-interval",
        "15",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "layout tp=1 cp=1 ep=1 pp=2 vpp=1 dp=2 zero=1 on 4 rank(s), schedule 1f1b, fp32; run "
        "directory "
        # Megatron's flag names set pp and ZeRO-1
        f"{run}; no checkpoints (--save)"
    ) in out.stdout
    records = read(run)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r["valid_loss"] for r in records if r["kind"] == "eval"]
    assert [r["iteration"] for r in train] == [5, 10, 15, 20, 25, 30]
    assert all(FIELDS <= set(r) for r in train)
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.2  # it learns
    (memory,) = [r for r in records if r["kind"] == "memory"]
    assert [s["stage"] for s in memory["stages"]] == [0, 1]
    png = fxmeg("plot", run)
    assert png.returncode == 0, png.stderr
    with open(png.stdout.strip(), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    check_trace(tmp_path / "trace", records)


def check_trace(trace_dir, records):
    """--trace: one Perfetto-readable file per traced step, one track per rank, every
    micro-batch's forward and backward on it, DP reductions issued and waited for;
    `fxmeg plot-schedule` draws it."""
    assert sorted(os.listdir(trace_dir)) == ["step_15.json", "step_30.json"]
    path = str(trace_dir / "step_30.json")
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {
        0: "pp 0 dp 0 tp 0",
        1: "pp 0 dp 1 tp 0",
        2: "pp 1 dp 0 tp 0",
        3: "pp 1 dp 1 tp 0",
    }
    for rank in range(4):
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        assert all(e["dur"] >= 0 and {"name", "cat", "ts"} <= set(e) for e in spans)
        cats = [e["cat"] for e in spans]
        # global batch 32 / dp 2 / micro-batch 4 (default) = 4 micro-batches
        assert cats.count("forward") == cats.count("backward") == 4, cats
        assert {"p2p", "dp_issue", "dp_wait", "optimizer", "step"} <= set(cats)
    (event,) = [r for r in records if r.get("trace") == path]
    assert 0.0 < event["bubble"] < 1.0 and event["dp_hidden"] is not None
    out = fxmeg("plot-schedule", path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("bubble") == 4
    with open(out.stdout.strip().splitlines()[-1], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_sigterm_finishes_the_step_saves_and_exits_0(corpus, tmp_path):
    run, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fxmeg.train.cli", "train", "--data", corpus, "--model-args", MODEL,
         "--dp", "2", "--seq-len", "64", "--global-batch-size", "16", "--train-iters", "100000",
         "--log-interval", "1", "--run-dir", run, "--save", ckpt, "--no-progress"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(run, "metrics.jsonl")) and len(
                [r for r in read(run) if r["kind"] == "train"]) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    records = read(run)
    (exit_event,) = [r for r in records if r.get("exit")]
    last = max(r["iteration"] for r in records if r["kind"] == "train")
    assert exit_event["exit"] == "sigterm" and exit_event["iteration"] == last
    with open(os.path.join(ckpt, open(os.path.join(ckpt, "latest")).read(), "meta.json")) as f:
        meta = json.load(f)
    assert meta["iteration"] == last and meta["trainer"]["consumed_samples"] == 16 * last


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _ranks(launcher: int) -> list[int]:
    """The ranks of `fxmeg train`: children of the launcher's multiprocessing fork server."""
    return [rank for child in _children(launcher) for rank in _children(child)]


def _train_args(corpus, run, ckpt):
    return [
        "train",
        "--data",
        corpus,
        "--model-args",
        MODEL,
        "--pp",
        "2",
        "--dp",
        "2",
        "--seq-len",
        "64",
        "--global-batch-size",
        "16",
        "--train-iters",
        "20",
        "--lr",
        "3e-3",
        "--lr-decay-samples",
        "400",
        "--save-interval",
        "5",
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--log-interval",
        "1",
        "--eval-iters",
        "1",
        "--run-dir",
        run,
        "--no-progress",
    ]


def test_a_killed_rank_restarts_and_resumes_exactly(corpus, tmp_path):
    whole = fxmeg(*_train_args(corpus, str(tmp_path / "whole"), str(tmp_path / "whole-ckpt")))
    assert whole.returncode == 0, whole.stderr[-2000:]
    run, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fxmeg.train.cli",
            *_train_args(corpus, run, ckpt),
            "--max-restarts",
            "1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        done = (
            [r["iteration"] for r in read(run) if r["kind"] == "train"]
            if os.path.exists(os.path.join(run, "metrics.jsonl"))
            else []
        )
        if done and max(done) >= 12:
            break
        time.sleep(0.1)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 4, ranks
    victim = ranks[-1]  # one of the four ranks, mid-step
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    records = read(run)
    assert any(r.get("resumed") for r in records)  # it did restart, from the checkpoint of step 10
    steps = [r["iteration"] for r in records if r["kind"] == "train"]
    assert steps == list(range(1, 21))  # no step twice, none lost
    losses = {r["iteration"]: r["loss"] for r in records if r["kind"] == "train"}
    reference = {
        r["iteration"]: r["loss"] for r in read(str(tmp_path / "whole")) if r["kind"] == "train"
    }
    # exact, fp32
    assert [losses[i] for i in range(11, 21)] == [reference[i] for i in range(11, 21)]


def _two_nodes(*args: str) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 2`` twice on this machine, each launcher a
    "node" joining the same c10d rendezvous, running ``fxmeg train ARGS``."""
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    run_id = uuid.uuid4().hex
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", run_id,
         "-m", "fxmeg.train.cli", "train", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-3000:]


def test_two_torchrun_nodes_train_save_and_resume_exactly(corpus, tmp_path):
    """tp=2 x pp=2 over two launchers of 2 ranks each: a 6-step run saving at 3 and 6, then
    the same two nodes resume from step 3: steps 4-6 and the evaluation bitwise as before."""
    ckpt = str(tmp_path / "ckpt")
    args = [
        "--data",
        corpus,
        "--model-args",
        MODEL,
        "--tp",
        "2",
        "--pp",
        "2",
        "--seq-len",
        "64",
        "--global-batch-size",
        "16",
        "--train-iters",
        "6",
        "--lr",
        "3e-3",
        "--lr-decay-samples",
        "400",
        "--log-interval",
        "1",
        "--eval-iters",
        "1",
        "--no-progress",
    ]
    _two_nodes(*args, "--save", ckpt, "--save-interval", "3", "--run-dir", str(tmp_path / "whole"))
    shutil.rmtree(os.path.join(ckpt, "iter_0000006"))  # resume from step 3
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("iter_0000003")
    _two_nodes(*args, "--load", ckpt, "--run-dir", str(tmp_path / "resumed"))
    whole, resumed = read(str(tmp_path / "whole")), read(str(tmp_path / "resumed"))
    losses = {r["iteration"]: r["loss"] for r in whole if r["kind"] == "train"}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert {r["iteration"]: r["loss"] for r in resumed if r["kind"] == "train"} == {
        i: losses[i] for i in (4, 5, 6)
    }
    assert [(r["iteration"], r["valid_loss"]) for r in resumed if r["kind"] == "eval"] == [
        (r["iteration"], r["valid_loss"]) for r in whole if r["kind"] == "eval"]  # step 6, bitwise
    (memory,) = [r for r in whole if r["kind"] == "memory"]
    assert [s["stage"] for s in memory["stages"]] == [0, 1]


HF_ARGS = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
HF_RUN = {
    "seq_len": 32,
    "micro_batch_size": 2,
    "global_batch_size": 8,
    "train_iters": 4,
    "lr": 3e-3,
    "lr_decay_samples": 400,
    "eval_iters": 1,
    "eod_mask_loss": True,
    "reset_position_ids": True,
    "reset_attention_mask": True,
}
"""The trainer's settings (flat names) of the Hugging Face run; the rest are defaults: seed
1234, AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.01 (not on 1-D parameters),
cosine decay to 0 with no warmup, gradients clipped at norm 1."""


def _short_documents(directory: str) -> str:
    """A corpus of 400 short documents (sentences of Python's pydoc topics, 10 to 60
    bytes), prepared as Megatron's preprocess_data.py does from JSON lines; its prefix.
    Every window of the Hugging Face run holds ends of documents, so Megatron's masks
    (positions restarting, attention within a document, no loss after an end of
    document) change what it computes: pydoc:topics' documents are thousands of bytes, and
    the 32-byte windows of 4 steps held none of them."""
    from pydoc_data.topics import topics

    from fxmeg.train.cli import main

    text = " ".join(topics[k] for k in sorted(topics)).replace("\n", " ")
    sentences = [s.strip() for s in text.split(". ") if 10 <= len(s.strip()) <= 60][:400]
    lines = os.path.join(directory, "sentences.jsonl")
    with open(lines, "w") as f:
        f.writelines(json.dumps({"text": s}) + "\n" for s in sentences)
    assert main(["prepare-data", "--input", lines, "--json-keys", "text", "--output",
                 os.path.join(directory, "short")]) == 0
    return os.path.join(directory, "short_text_document")


def _hf_flags(corpus: str) -> list[str]:
    flags = [
        "--data",
        corpus,
        "--model",
        "transformers:LlamaForCausalLM",
        "--model-args",
        json.dumps(HF_ARGS),
        "--log-interval",
        "1",
        "--no-progress",
        "--no-tensorboard",
    ]
    for name, value in HF_RUN.items():
        flags += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return flags


def _plain_hugging_face(corpus: str):
    """HF_RUN in plain PyTorch (the oracle): LlamaForCausalLM from its config (the vocabulary
    of PREFIX.json padded to a multiple of 128, as Megatron pads it; positions seq_len)
    seeded with the run's seed; each step the next global batch of the training split (the
    trainer's data: samples 8k..8k+7, their Megatron masks tested against megatron-core
    in tests/data/test_gpt_order.py) as one batch: input_ids, position_ids and the 4-D boolean
    attention mask, the loss the mean cross-entropy of the logits at the labels that count
    (-100 where not); gradients clipped at norm 1; torch's AdamW on Megatron's
    weight-decay groups at the lr of the cosine schedule for the samples consumed before
    the step. Returns (losses, grad norms, lrs, the validation loss after the last step on
    the first global batch of the validation split, the trained model)."""
    import transformers

    from fxmeg.train.trainer import TrainConfig, train_data
    from tests.harness.helpers import reference_groups

    cfg = TrainConfig.from_flat(data=corpus, **HF_RUN)
    data, gbs = train_data(cfg), HF_RUN["global_batch_size"]
    with open(corpus + ".json") as f:
        vocab = -(-json.load(f)["vocab_size"] // 128) * 128
    torch.manual_seed(cfg.seed)
    config = transformers.LlamaConfig(
        **HF_ARGS, vocab_size=vocab, max_position_embeddings=HF_RUN["seq_len"], use_cache=False
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    opt = torch.optim.AdamW(reference_groups(model.named_parameters()), betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)

    def loss(f):
        logits = model(input_ids=f["tokens"], position_ids=f["position_ids"],
                       attention_mask=f["attend"][:, None]).logits  # (rows, s, vocab)
        counted = f["labels"] != -100
        return (
            torch.nn.functional.cross_entropy(
                logits[counted], f["labels"][counted], reduction="sum"
            )
            / counted.sum()
        )

    losses, norms, lrs = [], [], []
    for step in range(HF_RUN["train_iters"]):
        lr = HF_RUN["lr"] * 0.5 * (1 + math.cos(math.pi * step * gbs / HF_RUN["lr_decay_samples"]))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        value = loss(data.fields("train", range(step * gbs, (step + 1) * gbs)))
        value.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        losses.append(value.item())
        lrs.append(lr)
    with torch.no_grad():
        valid = loss(data.fields("valid", range(gbs))).item()
    return losses, norms, lrs, valid, model


def test_a_hugging_face_class_trains_at_tp2_pp2_as_plain_hugging_face_and_resumes_exactly(tmp_path):
    """`--model transformers:LlamaForCausalLM` on 4 ranks (tp=2 x pp=2), fed keyword
    batches with Megatron's masks (--eod-mask-loss --reset-position-ids
    --reset-attention-mask; the end-of-document id from PREFIX.json; the first stage reads
    input_ids, position_ids and the 4-D attention_mask, the last the targets) against
    the same training written in plain Hugging Face and PyTorch (``_plain_hugging_face``):
    every step's loss within 1e-5 relative, grad norm within 1e-4 and lr, the evaluation,
    and the final weights (the step-4 checkpoint exported with `fxmeg export --format hf`,
    loaded with from_pretrained) within 5e-5 relative each; a resume from the step-2
    checkpoint repeats steps 3-4 and the evaluation bitwise."""
    import transformers

    from fxmeg.train.cli import main
    from tests.harness.helpers import assert_losses_close, assert_weights_close

    corpus = _short_documents(str(tmp_path))
    flags = _hf_flags(corpus)
    ckpt, layout = str(tmp_path / "ckpt"), ["--tp", "2", "--pp", "2"]
    out = fxmeg(
        "train",
        *flags,
        *layout,
        "--save",
        ckpt,
        "--save-interval",
        "2",
        "--run-dir",
        str(tmp_path / "whole"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # iteration 4, the latest; --check: from_pretrained gives the checkpoint's tensors and logits
    assert main(["export", ckpt, "--to", str(tmp_path / "hf"), "--format", "hf", "--check"]) == 0
    shutil.rmtree(os.path.join(ckpt, "iter_0000004"))  # resume from step 2
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("iter_0000002")
    out = fxmeg("train", *flags, *layout, "--load", ckpt, "--run-dir", str(tmp_path / "resumed"))
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {name: read(str(tmp_path / name)) for name in ("whole", "resumed")}
    steps = {
        name: {r["iteration"]: r for r in records if r["kind"] == "train"}
        for name, records in runs.items()
    }
    evals = {
        name: [r["valid_loss"] for r in records if r["kind"] == "eval"]
        for name, records in runs.items()
    }
    assert sorted(steps["whole"]) == [1, 2, 3, 4]
    assert {i: r["loss"] for i, r in steps["resumed"].items()} == {
        i: steps["whole"][i]["loss"] for i in (3, 4)
    }
    assert evals["resumed"] == evals["whole"]

    losses, norms, lrs, valid, model = _plain_hugging_face(corpus)
    whole = [steps["whole"][i] for i in (1, 2, 3, 4)]
    assert_losses_close([r["loss"] for r in whole], losses)  # megatron-semantics.md §1.9: 1e-5
    assert_losses_close([r["grad_norm"] for r in whole], norms, rtol=1e-4)
    assert_losses_close([r["lr"] for r in whole], lrs, rtol=1e-12)
    assert_losses_close(evals["whole"], [valid])
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert_weights_close(trained.state_dict(), model.state_dict())


def test_a_users_error_is_one_line_and_debug_shows_its_traceback(corpus):
    flags = ["train", "--data", corpus, "--train-iters", "1", "--schedule", "1f1d"]
    out = fxmeg(*flags)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        (
            "fxmeg: error: schedule='1f1d' is not one of ('auto', 'none', 'gpipe', '1f1b', "
            "'interleaved', 'zbh1', "
            "'zbv', 'dualpipev') (did you mean '1f1b'?)"
        )
    ]
    debug = fxmeg("--debug", *flags)
    assert (
        debug.returncode == 1
        and "Traceback" in debug.stderr
        and "ConfigError: schedule='1f1d'" in debug.stderr
    )
    bad = fxmeg("train", "--tensor-model-paralel-size", "2")
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        "usage: fxmeg train [--FLAG VALUE ...]  (fxmeg train --help lists them)",
        (
            "fxmeg train: error: unrecognized arguments: --tensor-model-paralel-size 2 "
            "(did you mean '--tensor-model-parallel-size'?)"
        ),
    ]


def test_a_launched_layout_error_is_shown_once(corpus, tmp_path):
    """Four ranks refuse a tp that does not divide the heads: one line, no rank's
    traceback, none of torch elastic's report."""
    llama = {"vocab_size": 384, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 3, "num_key_value_heads": 3}
    out = fxmeg(
        "train",
        "--data",
        corpus,
        "--model",
        "transformers:LlamaForCausalLM",
        "--model-args",
        json.dumps(llama),
        "--tp",
        "2",
        "--nproc",
        "4",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fxmeg: error: "), out.stderr[-3000:]
    # from the model's config, before capture (fxmeg/frontend/model_checks.py), not from a
    # traced view node
    assert (
        "tp=2 does not divide 3, the number of heads" in lines[0]
        and "num_attention_heads=3" in lines[0]
    )
    assert "Traceback" not in out.stdout + out.stderr


def test_help_imports_no_torch_and_a_config_error_no_compiler():
    """`fxmeg --help` answers from the argument table alone (bench/cli_startup.py times it)."""
    code = (
        "import sys, contextlib, io\nfrom fxmeg.train.cli import console\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "    console(['--help'])\n"
        "assert 'plan' in out.getvalue() and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    # a config error: no compiler stack either
    code = (
        "import sys\nfrom fxmeg.train.cli import console\n"
        "assert console(['train', '--data', 'x', '--train-iters', '1', '--schedule', '1f1d']) == "
        "1\n"
        "assert not {'torch._dynamo', 'torch._functorch.aot_autograd'} & set(sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr.startswith("fxmeg: error: schedule='1f1d'"), (
        out.stderr[-2000:]
    )
