"""The trainer in one process: batch-size schedule, exits, resume, reports, config."""

import argparse
import json
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from fxmeg.diagnostics.layout_plan import memory_report
from fxmeg.errors import CheckpointError, ConfigError
from fxmeg.lr_schedule import LRSchedule
from fxmeg.train.cli import _train_parser, config_from
from fxmeg.train.metrics import read
from fxmeg.train.trainer import TrainConfig, Trainer, batch_size_schedule

MODEL = json.dumps({"n_layer": 2, "n_embd": 32, "n_head": 4})


def _config(corpus, tmp_path, **kw):
    base = dict(data=corpus, model_args=MODEL, seq_len=32, micro_batch_size=4, global_batch_size=8,
                train_iters=6, log_interval=1, eval_iters=2, lr=1e-3, run_dir=str(tmp_path / "run"),
                progress=False, tensorboard=False)
    return TrainConfig.from_flat(**(base | kw))


def test_batch_size_schedule_is_validated():
    ok = TrainConfig.from_flat(
        data="x", train_iters=1, global_batch_size=8, step_batch_size_schedule="64:16 128:32"
    )
    assert batch_size_schedule(ok) == [(0, 8), (64, 16), (128, 32)]
    with pytest.raises(
        ConfigError, match="would shrink the global batch from 16 to 8 at 128 samples"
    ):
        TrainConfig.from_flat(
            data="x", train_iters=1, global_batch_size=8, step_batch_size_schedule="64:16 128:8"
        )
    with pytest.raises(ConfigError, match="'64-16' is not THRESHOLD:BATCH_SIZE"):
        TrainConfig.from_flat(data="x", train_iters=1, step_batch_size_schedule="64-16")


def test_batch_size_switch_saves_first_and_keeps_the_lr_schedule_continuous(corpus, tmp_path):
    cfg = _config(corpus, tmp_path, train_iters=8, step_batch_size_schedule="32:16",
                  save=str(tmp_path / "ckpt"), lr_warmup_samples=16, lr_decay_samples=200)
    out = Trainer(cfg).run()
    records = read(cfg.run_dir)
    switch = [r for r in records if "batch_size_switch" in r]
    assert [(r["consumed_samples"], r["iteration"], r["batch_size_switch"]) for r in switch] == [
        (32, 4, [8, 16])
    ]
    saved = [r["saved"] for r in records if "saved" in r]
    assert saved[0].endswith("iter_0000004")  # just before the switch
    with open(os.path.join(saved[0], "meta.json")) as f:
        assert json.load(f)["trainer"]["consumed_samples"] == 32
    train = [r for r in records if r["kind"] == "train"]
    assert [r["batch_size"] for r in train] == [8] * 4 + [16] * 4
    schedule = LRSchedule(1e-3, 0.0, 16, decay_samples=200, style="cosine")
    for r in train:  # the lr of each step is the schedule at the samples consumed before it
        assert r["lr"] == pytest.approx(schedule.lr(r["consumed_samples"] - r["batch_size"]))
    assert out["consumed_samples"] == 4 * 8 + 4 * 16


def test_exit_interval_saves_and_stops(corpus, tmp_path):
    cfg = _config(corpus, tmp_path, train_iters=10, exit_interval=3, save=str(tmp_path / "ckpt"))
    out = Trainer(cfg).run()
    assert out["exit"] == "exit_interval" and out["iteration"] == 3
    assert open(tmp_path / "ckpt" / "latest").read() == "iter_0000003"


def test_resume_continues_exactly(corpus, tmp_path, capsys):
    same = dict(lr_decay_samples=200, lr_warmup_samples=8)  # not derived from train_iters
    whole = Trainer(_config(corpus, tmp_path / "a", train_iters=8, **same))
    whole.run()
    first = Trainer(
        _config(corpus, tmp_path / "b", train_iters=5, save=str(tmp_path / "ckpt"), **same)
    )
    first.run()
    assert (
        "layout tp=1 cp=1 ep=1 pp=1 vpp=1 dp=1 zero=0 on 1 rank(s), schedule none, fp32; run "
        "directory "
        f"{tmp_path / 'b' / 'run'}; checkpoints to {tmp_path / 'ckpt'} at the end"
    ) in capsys.readouterr().out
    first.engine.save(str(tmp_path / "python"))  # no data position: the trainer cannot resume it
    with pytest.raises(CheckpointError, match=r"saved by engine.save .* --init-from .*python"):
        Trainer(
            _config(corpus, tmp_path / "d", train_iters=8, load=str(tmp_path / "python"), **same)
        )
    with pytest.raises(ConfigError, match=r"--run-dir .*a/run holds the metrics of an earlier run"):
        # it would mix two runs' curves
        Trainer(_config(corpus, tmp_path / "a", train_iters=8, **same))
    # without --run-dir, the resumed run continues the directory its checkpoint names
    second = Trainer(
        _config(corpus, tmp_path, train_iters=8, load=str(tmp_path / "ckpt"), run_dir="", **same)
    )
    assert (second.iteration, second.consumed, second.run_dir) == (
        5,
        40,
        str(tmp_path / "b" / "run"),
    )
    second.run()
    losses = [r["loss"] for r in read(str(tmp_path / "a" / "run")) if r["kind"] == "train"]
    resumed = [r["loss"] for r in read(str(tmp_path / "b" / "run")) if r["kind"] == "train"]
    assert resumed == losses  # 5 steps, then 3 resumed: bitwise in fp32 on one process
    sd_a, sd_c = whole.engine.full_state_dict(), second.engine.full_state_dict()
    assert all(torch.equal(sd_a[k], sd_c[k]) for k in sd_a)


def test_flops_match_the_closed_form(corpus, tmp_path, capsys):
    t = Trainer(_config(corpus, tmp_path))
    # said at start: the run's 6 x 8 samples against the train split's sample index, whose
    # epochs are Megatron's num_epochs (the document index lists every document once per epoch)
    order = t.data.train.order
    assert (
        order.epochs
        == len(order.document_index) // len(set(order.document_index.tolist()))
        == t.data.epochs
    )
    passes = 48 * order.epochs / len(t.data.train)
    assert (
        f"pretraining: 6 steps x 8 samples = 48 samples is {passes:.2f} passes over the train "
        "split "
        f"(Megatron's sample index: {order.epochs} epoch"
    ) in capsys.readouterr().out
    b, s, h, heads, layers, vocab = 4, 32, 32, 4, 2, 128  # vocab: 257 padded to 128 * tp... = 384
    vocab = 384
    per_layer = 2 * b * s * (h * 3 * h + h * h + h * 4 * h + 4 * h * h) + 4 * b * heads * s * s * (
        h // heads
    )
    forward = layers * per_layer + 2 * b * s * h * vocab
    assert t.engine.program.flops_per_microbatch == forward
    assert t.engine.model_flops_per_step == 3 * forward * 2  # m = 8 / 4


def test_memory_report_matches_hand_computed_bytes(corpus, tmp_path):
    t = Trainer(_config(corpus, tmp_path))
    (stage,) = memory_report(t.engine.program, t.engine.context)
    params = sum(p.numel() for p in t.engine.named_parameters.values())
    assert stage["parameters"] == 4 * params
    assert stage["gradient_buffers"] == 4 * params  # one fp32 buffer, dp = 1: no padding
    assert stage["optimizer_state"] == 8 * params  # Adam's two fp32 states; fp32 has no master copy
    assert stage["microbatches_in_flight"] == 1
    # activations: an upper bound of what autograd really saves for one micro-batch
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        ids, labels = t.data.batch("train", range(4))
        t.engine.context.chunks[0](ids, labels)
    params_ptrs = {p.data_ptr() for p in t.engine.named_parameters.values()}
    measured = sum(
        x.numel() * x.element_size()
        for x in {x.data_ptr(): x for x in saved if x.data_ptr() not in params_ptrs}.values()
    )
    assert measured <= stage["activations_per_microbatch"] <= 4 * measured


def test_config_file_and_flags(corpus, tmp_path):
    parser = argparse.ArgumentParser()
    _train_parser(parser)
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'data = "{corpus}"\ntrain-iters = 7\nmodel_args = {{ n_layer = 2 }}\nlr = 0.01\n'
    )
    cfg = config_from(parser.parse_args(["--config", str(toml), "--lr", "0.02"]))
    assert (cfg.train_iters, cfg.lr, json.loads(cfg.model_args)) == (7, 0.02, {"n_layer": 2})
    yaml = tmp_path / "run.yaml"
    yaml.write_text(f"data: {corpus}\ntrain_iters: 3\nglobal_batch_size: 16\n")
    assert config_from(parser.parse_args(["--config", str(yaml)])).engine.global_batch_size == 16
    bad = tmp_path / "bad.toml"
    bad.write_text(f'data = "{corpus}"\ntrain_iters = 3\nglobal_bach_size = 16\n')
    with pytest.raises(
        ConfigError, match="unknown config key 'global_bach_size'.*did you mean 'global_batch_size'"
    ):
        config_from(parser.parse_args(["--config", str(bad)]))


def test_perplexity_is_exp_of_the_validation_loss(corpus, tmp_path):
    out = Trainer(_config(corpus, tmp_path, train_iters=2)).run()
    assert out["valid_ppl"] == pytest.approx(math.exp(out["valid_loss"]))


def test_exit_duration_stops_after_the_step_in_progress(corpus, tmp_path):
    cfg = _config(
        corpus, tmp_path, train_iters=50, exit_duration_in_mins=1e-9, save=str(tmp_path / "ckpt")
    )
    out = Trainer(cfg).run()
    assert out["exit"] == "exit_duration_in_mins" and out["iteration"] == 1
    assert open(tmp_path / "ckpt" / "latest").read() == "iter_0000001"


class _Clock:
    """fxmeg.train.trainer's clock in a test: it moves only by the seconds the wrapped calls take.
    """

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def taking(self, seconds, fn):
        def timed(*args, **kw):
            self.now += seconds
            return fn(*args, **kw)

        return timed


def test_throughput_excludes_evaluation_and_saving(corpus, tmp_path, monkeypatch):
    # log intervals 1-4, 5-8, 9-12; an evaluation and a save after step 6, inside the second
    cfg = _config(corpus, tmp_path, train_iters=12, log_interval=4, eval_interval=6, eval_iters=1,
                  save=str(tmp_path / "ckpt"), save_interval=6)
    t = Trainer(cfg)
    clock = _Clock()  # fake: on a shared CPU the real step time varies 100x
    monkeypatch.setattr(
        "fxmeg.train.trainer.time", SimpleNamespace(perf_counter=clock, monotonic=clock)
    )
    monkeypatch.setattr(t.engine, "train_step", clock.taking(0.01, t.engine.train_step))
    monkeypatch.setattr(t.engine, "eval_step", clock.taking(1.0, t.engine.eval_step))
    monkeypatch.setattr(t.checkpointer, "save", clock.taking(2.0, t.checkpointer.save))
    t.run()
    records = read(cfg.run_dir)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [4, 8, 12]
    flops = t.engine.model_flops_per_step / 0.01 / 1e12
    for r in train:  # the second interval as the others: the steps' 0.04 s alone
        assert r["iteration_time"] == pytest.approx(0.01)
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / 0.01)
        assert r["tflops_per_rank"] == pytest.approx(flops)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["iteration"], r["eval_time"]) for r in evals] == [
        (6, pytest.approx(1.0)),
        (12, pytest.approx(1.0)),
    ]
    saves = [r for r in records if "save_started" in r]
    assert [r["iteration"] for r in saves] == [6, 12]  # the exit does not save iteration 12 again
    assert all(r["save_time"] == pytest.approx(2.0) for r in saves)


HF = "transformers:LlamaForCausalLM"
HF_ARGS = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_a_hugging_face_class_learns_the_next_token_of_each_window_and_resumes_exactly(
    corpus, tmp_path, capsys
):
    """`--model transformers:LlamaForCausalLM`: built from its config (the position table
    sized to seq_len), fed keyword batches whose targets are the window's next tokens,
    every one of them (not HF's own shift of labels, which would skip one); the first
    step's loss is the model's own loss in plain PyTorch; resume continues bitwise;
    `fxmeg verify` and `fxmeg plan` take the same model."""
    import transformers as T

    from fxmeg.interop.hugging_face import keyword_batch
    from fxmeg.train.cli import main

    hf = {"model": HF, "model_args": json.dumps(HF_ARGS), "lr_decay_samples": 200, "train_iters": 4}
    t = Trainer(_config(corpus, tmp_path / "a", **hf))
    ref = T.LlamaForCausalLM._from_config(
        T.LlamaConfig(vocab_size=384, max_position_embeddings=32, **HF_ARGS)
    )
    ref.load_state_dict(t.engine.full_state_dict())
    ids, labels = t.data.batch("train", range(8))
    batch = t.batch("train", range(8))
    with torch.no_grad():
        own = ref(**batch).loss.item()
        logits = ref(input_ids=ids).logits
    window = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert own == pytest.approx(window, rel=1e-6)
    first = t.engine.eval_step(batch)
    assert first.num_tokens == 8 * 32  # every position has its target: the window's next token
    assert first.loss == pytest.approx(own, rel=1e-5)
    t.run()
    whole = [r["loss"] for r in read(str(tmp_path / "a" / "run")) if r["kind"] == "train"]
    assert whole[0] == pytest.approx(own, rel=1e-5) and all(math.isfinite(x) for x in whole)
    ckpt = str(tmp_path / "ckpt")
    saver = Trainer(_config(corpus, tmp_path / "b", **hf | {"train_iters": 2, "save": ckpt}))
    saver.run()
    # `fxmeg export --format hf`: from_pretrained gives the trained model's logits
    out = str(tmp_path / "hf")
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["export", ckpt, "--to", out, "--format", "hf", "--check"]) == 0
    printed = capsys.readouterr().out
    assert "eos_token_id 256: the data's end of document (the model config said 2)" in printed
    assert (
        "vocabulary 384 rows as trained (tokenizer 257, padded" in printed
        and "check: logits" in printed
    )
    trained = saver.engine.full_state_dict()
    ref.load_state_dict(trained)
    back = T.AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is T.LlamaForCausalLM and back.config.vocab_size == 384
    assert back.config.use_cache and back.generation_config.use_cache
    # the byte tokenizer's
    assert back.config.eos_token_id == back.generation_config.eos_token_id == 256
    assert back.generation_config.suppress_tokens == list(range(257, 384))  # the padding rows
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, ref(input_ids=ids).logits)
        prompt = {"input_ids": ids[:2, :6], "attention_mask": torch.ones_like(ids[:2, :6])}
        cached = back.generate(
            **prompt, max_new_tokens=3, do_sample=False, return_dict_in_generate=True
        )
        # the KV cache kept
        assert cached.get("cache" if "cache" in cached else "past_key_values") is not None
        assert torch.equal(
            cached.sequences,
            back.generate(**prompt, max_new_tokens=3, do_sample=False, use_cache=False),
        )
    # and back in
    again = Trainer(_config(corpus, tmp_path / "d", **hf | {"init_from": out, "save": ""}))
    assert all(torch.equal(v, trained[k]) for k, v in again.engine.full_state_dict().items())
    with warnings.catch_warnings(record=True) as loading:
        warnings.simplefilter("always")
        resumed = Trainer(_config(corpus, tmp_path / "c", **hf | {"load": ckpt}))
    assert resumed.iteration == 2
    # DCP's "torch.distributed is disabled ..." on each single-process read: fxmeg asked for it
    assert not [w for w in caught + loading if "torch.distributed" in str(w.message)]
    resumed.run()
    assert [r["loss"] for r in read(str(tmp_path / "c" / "run")) if r["kind"] == "train"] == whole[
        2:
    ]
    assert set(batch) == {"input_ids", "attention_mask", "labels", "shift_labels"}
    # HF's convention: still the next token if ignored
    assert keyword_batch(ids, labels)["labels"] is ids
    flags = [
        "--data",
        corpus,
        "--model",
        HF,
        "--model-args",
        json.dumps(HF_ARGS),
        "--seq-len",
        "32",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
    ]
    assert main(["verify", *flags]) == 0
    assert "loss" in capsys.readouterr().out
    plan_args = json.dumps(HF_ARGS | {"vocab_size": 384})  # plan has no corpus to size it
    assert main(["plan", *flags[2:4], "--model-args", plan_args, *flags[6:], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_parameters"] == sum(
        p.numel() for p in ref.parameters()
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            {"hiden_size": 32},
            "'hiden_size' is not a field of LlamaConfig.*did you mean 'hidden_size'",
        ),
        (
            {"hidden_size": 30},
            r"rejected by LlamaConfig.*hidden size \(30\) is not a multiple of the number",
        ),
        ({"num_hidden_layers": "two"}, "rejected by LlamaConfig.*'num_hidden_layers' expected int"),
        (
            {"max_position_embeddings": 16},
            r"--seq-len 32 is longer than .* \(max_position_embeddings=16",
        ),
        ({"attn_implementation": "flash_attention_2"}, "'flash_attention_2'.*'sdpa' and 'eager'"),
    ],
)
def test_a_hugging_face_config_that_rejects_a_model_arg_names_it(corpus, tmp_path, args, message):
    cfg = _config(corpus, tmp_path, model=HF, model_args=json.dumps(HF_ARGS | args))
    with pytest.raises(ConfigError, match=message):
        Trainer(cfg)


def test_the_optimizer_is_chosen_by_name(corpus, tmp_path):
    """--optimizer muon: Muon on the hidden matrices, AdamW on the rest, from the same first
    loss as AdamW; a misspelt name is refused with the nearest one."""
    runs = {
        name: Trainer(_config(corpus, tmp_path / name, train_iters=2, optimizer=name))
        for name in ("adamw", "muon")
    }
    kinds = {
        name: tuple(type(o).__name__ for o in t.engine.context.optimizer.optimizers)
        for name, t in runs.items()
    }
    assert kinds == {"adamw": ("AdamW",), "muon": ("Muon", "AdamW")}
    for t in runs.values():
        t.run()
    losses = {
        name: [r["loss"] for r in read(t.cfg.run_dir) if r["kind"] == "train"]
        for name, t in runs.items()
    }
    assert losses["muon"][0] == losses["adamw"][0] and losses["muon"][1] != losses["adamw"][1]
    with pytest.raises(
        ConfigError, match=r"optimizer='muonn' is not one of .*\(did you mean 'muon'\?\)"
    ):
        _config(corpus, tmp_path, optimizer="muonn")


def test_the_wsd_anneal_is_set_by_its_flags(corpus, tmp_path):
    cfg = _config(
        corpus,
        tmp_path,
        lr_decay_style="WSD",
        lr_decay_samples=48,
        lr_wsd_decay_samples=16,
        lr_wsd_decay_style="linear",
    )
    schedule = Trainer(cfg).engine_config.lr_schedule
    assert (schedule.wsd_decay_samples, schedule.wsd_style) == (16, "linear")
    # halfway down the anneal
    assert schedule.lr(32) == cfg.lr and schedule.lr(40) == pytest.approx(cfg.lr / 2)
    default = Trainer(
        _config(corpus, tmp_path, lr_decay_style="WSD", lr_decay_samples=40)
    ).engine_config.lr_schedule
    assert (default.wsd_decay_samples, default.wsd_style) == (4, "exponential")  # the last tenth


def test_a_model_arg_the_config_dataclass_lacks_is_refused():
    """A typo such as n_layr was dropped, and the default depth trained without a word."""
    from fxmeg.train.build import build_model

    with pytest.raises(
        ConfigError,
        match=r"'n_layr' is not a field of GPTConfig \(the config of GPT\) "
        r"\(did you mean 'n_layer'\?\)",
    ):
        build_model("models.gpt:GPT", {"n_layr": 2, "vocab_size": 128, "seq_len": 16})
    assert (
        len(
            build_model(
                "models.llama:Llama", {"n_layer": 1, "vocab_size": 128, "seq_len": 16}
            ).layers
        )
        == 1
    )


def test_each_run_takes_its_own_directory_by_default(tmp_path, monkeypatch):
    from fxmeg.train.metrics import run_directory

    monkeypatch.chdir(tmp_path)
    assert run_directory("", resuming=False) == "runs/run"
    for taken in ("runs/run", "runs/run-2"):
        os.makedirs(taken)
        open(os.path.join(taken, "metrics.jsonl"), "w").close()
    assert run_directory("", resuming=False) == "runs/run-3"  # never appended to another run
    assert run_directory("", resuming=True, resumed="runs/run") == "runs/run"
    # a restart, or --load: continue it
    assert run_directory("runs/run", resuming=True) == "runs/run"
    with pytest.raises(
        ConfigError, match="--run-dir runs/run-2 holds the metrics of an earlier run"
    ):
        run_directory("runs/run-2", resuming=False)
