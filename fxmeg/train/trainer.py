"""The training loop (docs/megatron-semantics.md §2.1, §2.3, §2.9, §2.10): Megatron's
pretrain() on fxmeg's engine.

setup (data, model, engine, optional resume) -> loop while iteration < train_iters (or
consumed samples < train_samples): pick the global batch size for the consumed samples,
train_step, then log / evaluate / save on their intervals. It stops after train_iters,
at exit_interval, after exit_duration_in_mins, or on SIGTERM (finishing the step and
saving first); every rank takes that decision together (the flag is all-reduced each
step), so no rank leaves a collective half-done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import fxmeg
from fxmeg.data.megatron import TrainData, sample_counts, vocabulary
from fxmeg.data.sft import SFTData
from fxmeg.data.tokenizer import HFTokenizer
from fxmeg.diagnostics.layout_plan import memory_report
from fxmeg.errors import CheckpointError, ConfigError, FxmegError
from fxmeg.interop import hugging_face
from fxmeg.lr_schedule import LRSchedule
from fxmeg.runtime import timelines
from fxmeg.runtime.optimizer.optimizer import adamw, muon_adamw
from fxmeg.train.build import build_model
from fxmeg.train.metrics import Metrics, perplexity, run_directory
from fxmeg.train.train_config import (  # noqa: F401  (the trainer's options, imported from here too)
    OPTIMIZERS,
    TrainConfig,
    batch_size_schedule,
    engine_from_flat,
    flat_defaults,
    flat_fields,
)
from fxmeg.weights import checkpoint


def train_data(cfg: TrainConfig) -> TrainData | SFTData:
    """The run's data as Megatron builds it (fxmeg/data/megatron.py), each split for the
    samples Megatron's pretrain_gpt.py asks from the run's settings: train_iters (or
    train_samples / the final global batch) x the final global batch; eval_iters batches
    at each evaluation. With --sft, the JSON lines as fxmeg/data/sft.py lays them out."""
    final = batch_size_schedule(cfg)[-1][1]
    iters = cfg.train_iters or cfg.train_samples // final
    sizes = sample_counts(
        cfg.train_samples or iters * final, final, cfg.eval_interval, cfg.eval_iters, iters
    )
    paths = cfg.data_paths()
    if cfg.sft:
        tokenizer = HFTokenizer(cfg.tokenizer_model, eos_id=cfg.eod_id if cfg.eod_id >= 0 else None)
        return SFTData(
            paths,
            sizes,
            seq_len=cfg.seq_len,
            seed=cfg.seed,
            tokenizer=tokenizer,
            fmt=cfg.sft_format(),
        )
    vocab = vocabulary(
        paths.prefixes, size=cfg.vocab_size, eod=cfg.eod_id, tokenizer=cfg.tokenizer_model
    )
    return TrainData(
        paths,
        sizes,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        vocab=vocab,
        masks=cfg.masks(),
        cache_path=cfg.data_cache_path,
    )


def passes_report(cfg: TrainConfig, data: TrainData | SFTData, final: int) -> str:
    """How many passes over its training data the run makes, said at start: the run's
    samples (as ``train_data`` asks them) against the train split's rows; for SFT, a warning
    past one pass (an SFT run's data is small: 100 steps repeat it silently)."""
    samples = cfg.train_samples or cfg.train_iters * final
    steps = f"{cfg.train_iters} step{'s' * (cfg.train_iters > 1)}"
    run = (f"{steps} x {final} samples = {samples} samples" if cfg.train_iters
           else f"--train-samples {samples}")
    if isinstance(data, SFTData):
        line = f"SFT: {run} is {data.passes:.1f} passes over {data.rows}"
        if data.passes <= 1:
            return line
        one = max(1, round(samples / data.passes) // final)  # the steps of one pass
        return (
            f"WARNING: {line}: each example is trained on about {data.passes:.0f} times; for one "
            f"pass, --train-iters {one}, or give more examples (each pass reads them in a new "
            "order)"
        )
    epochs = f"Megatron's sample index: {data.epochs} epoch{'s' * (data.epochs > 1)}"
    if data.passes is None:
        return f"pretraining: {run}; {epochs} (the most of the blend's datasets)"
    return f"pretraining: {run} is {data.passes:.2f} passes over the train split ({epochs})"


def model_batch(fields: dict[str, torch.Tensor], *, keywords: bool):
    """A batch of ``TrainData.fields`` (tokens, labels with -100 where no loss counts, and
    the masks' position_ids and attend) as the model takes it: (input_ids, labels), or for
    a Hugging Face model the keyword batch (``hugging_face.keyword_batch``)."""
    if keywords:
        return hugging_face.keyword_batch(
            fields["tokens"],
            fields["labels"],
            position_ids=fields.get("position_ids"),
            attend=fields.get("attend"),
        )
    return fields["tokens"], fields["labels"]


def _check_model_takes(cfg: TrainConfig, model: nn.Module, *, keywords: bool) -> None:
    """Refuse data the model cannot take as it should: position ids and a 4-D attention mask
    (the reset switches, packed SFT) need a Hugging Face model in sdpa attention (eager adds
    a boolean mask to the scores instead of masking with it; flash attention takes no 4-D
    mask); -100 targets (the loss mask, SFT) need one whose loss reads shift_labels."""
    name = type(model).__name__
    resets = [f for f in cfg.masks().flags() if f != "--eod-mask-loss"]
    resets += ["--sft-layout packed"] if cfg.sft and cfg.sft_layout == "packed" else []
    if resets and not keywords:
        raise ConfigError(
            f"{' and '.join(resets)}: {name} takes only token ids and labels; a model that takes "
            "position_ids and attention_mask by keyword (a Hugging Face one, e.g. --model "
            "transformers:LlamaForCausalLM) can use them"
        )
    attention = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    if resets and attention != "sdpa":
        raise ConfigError(
            f"{' and '.join(resets)}: {name} runs {attention!r} attention, which does not take a "
            "boolean 4-D attention mask as given; use --model-args attn_implementation=sdpa"
        )
    masked = ["--eod-mask-loss"] * cfg.eod_mask_loss + ["--sft"] * cfg.sft
    if masked and keywords and not hugging_face.takes_shift_labels(model):
        raise ConfigError(
            f"{' and '.join(masked)}: {name}'s loss ignores shift_labels, where the -100 targets "
            "are; it would train on every position"
        )


def _vocabulary(data: TrainData | SFTData) -> dict:
    """What a checkpoint records of the data for `fxmeg export --format hf`: the tokenizer's
    ids (before the model's padding) and the end of document (SFT: the eos that ends each
    response; None where the data does not say)."""
    eod = data.vocab.eod if isinstance(data, TrainData) else data.pad
    return {"vocab_size": data.vocab_size, "eod": eod}


class Trainer:
    def __init__(self, cfg: TrainConfig, model: nn.Module | None = None) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        # dp=None: world // (tp * cp * pp); every batch rule with dp
        engine = cfg.engine.resolve(world)
        self.world, self.dp = world, engine.parallel.dp
        self.sizes = batch_size_schedule(cfg, engine)
        self.engine_config = dataclasses.replace(
            engine, global_batch_size=self._size_at(0), lr_schedule=self._lr_schedule())
        self.data = train_data(cfg)
        torch.manual_seed(cfg.seed)
        if model is None:
            # Megatron pads the vocabulary to a multiple of 128 (x tp there); without the tp
            # factor the model's shapes do not depend on the layout, so checkpoints reshard
            vocab = -(-self.data.vocab_size // 128) * 128
            args = {"vocab_size": vocab, "seq_len": cfg.seq_len} | json.loads(cfg.model_args)
            # --init-from: built on meta, each rank reads only its slices of the weights
            with torch.device("meta") if cfg.init_from else contextlib.nullcontext():
                model = build_model(cfg.model, args)
        self.keywords = hugging_face.is_hugging_face(model)
        """Batches are keyword dicts (a Hugging Face model: fxmeg.interop.hugging_face), else
        tuples."""
        _check_model_takes(cfg, model, keywords=self.keywords)
        self.run_dir = self._run_dir()  # before the capture: a refused directory costs none
        self.engine = self._engine(model)
        self.checkpointer = checkpoint.Checkpointer(
            self.engine.program,
            self.engine.context,
            keep=cfg.keep_last or None,
            async_save=cfg.async_save,
            hugging_face=self.engine.hugging_face,  # config.json for `fxmeg export --format hf`
            data=_vocabulary(self.data),  # and its eos
        )
        total = cfg.train_iters or None
        self.metrics = Metrics(self.run_dir, enabled=self.rank == 0, total=total,
                               progress=cfg.progress, tensorboard=cfg.tensorboard)
        self.metrics.say(self._start_line())
        self.checkpointer.on_saved = lambda path: self.metrics.record("event", {"saved": path})
        self.metrics.say(self.data.summary)
        self.metrics.say(passes_report(cfg, self.data, self.sizes[-1][1]))
        if self.keywords and not hugging_face.takes_shift_labels(model):
            self.metrics.say(
                f"{type(model).__name__}'s loss ignores shift_labels: it shifts labels "
                "itself, so the last token of each window is never a target"
            )
        self.iteration = self.consumed = self.valid_consumed = self.skipped = 0
        self._saved: tuple[int, int] | None = None
        """(iteration, validation samples consumed) of the last checkpoint."""
        self.last_train: dict = {}
        self.last_eval: dict = {}
        if cfg.load:
            self._resume()
        self._signal = False

    def _lr_schedule(self) -> LRSchedule:
        """The lr / weight-decay schedule in samples from the lr fields; decay over the
        whole run unless lr_decay_samples says otherwise."""
        cfg = self.cfg
        warmup, decay, anneal = cfg.lr_samples(self.sizes[-1][1])
        decay = decay or cfg.train_samples or cfg.train_iters * self.sizes[-1][1]
        style = cfg.lr_decay_style
        return LRSchedule(
            max_lr=cfg.lr, min_lr=cfg.min_lr, warmup_samples=warmup,
            decay_samples=max(decay, warmup + 1), style=style,
            wsd_decay_samples=(anneal or max(1, decay // 10)) if style == "WSD" else None,
            wsd_style=cfg.lr_wsd_decay_style,
        )

    def _engine(self, model: nn.Module) -> fxmeg.Engine:
        cfg = self.cfg
        example = self.batch("train", range(self.engine_config.micro_batch_size))
        betas, eps, wd = (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps, cfg.weight_decay
        return fxmeg.parallelize(
            model,
            example,
            config=self.engine_config,
            weights=cfg.init_from or None,
            optimizer=muon_adamw(lr=cfg.lr, weight_decay=wd, betas=betas, eps=eps)
            if cfg.optimizer == "muon"
            else lambda groups: adamw(groups, betas=betas, eps=eps, weight_decay=wd),
        )

    # ------------------------------------------------------------------ loop

    def run(self) -> dict:
        """Train until an exit condition; the last train log and evaluation numbers."""
        cfg = self.cfg
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if _main_thread() else None
        start = time.monotonic()
        window: list = []  # (result, global batch size, seconds) of each step since the last log
        reason = "done"
        try:
            while not self._finished():
                self._switch_batch_size()
                size = self.engine.config.global_batch_size
                traced = bool(cfg.trace) and (self.iteration + 1) % cfg.trace_interval == 0
                tick = time.perf_counter()
                result = self.engine.train_step(
                    self._train_batch(size), check_determinism=cfg.check_determinism, trace=traced
                )
                # throughput counts the steps alone: evaluation, saving, logging, traces and
                # the exit vote stay out (Megatron stops 'interval-time' around eval and save)
                seconds = time.perf_counter() - tick
                self.iteration += 1
                if traced:
                    self._write_trace()
                self.consumed += size
                self.skipped += result.skipped
                self._report_step(result)
                window.append((result, size, seconds))
                if self.iteration % cfg.log_interval == 0:
                    self._log(window)
                    window = []
                if cfg.eval_interval and self.iteration % cfg.eval_interval == 0:
                    self.evaluate()
                if cfg.save and cfg.save_interval and self.iteration % cfg.save_interval == 0:
                    self.save()
                reason = self._exit_reason(start)
                if reason:
                    break
            reason = reason or "done"
            if self.last_eval.get("iteration") != self.iteration:
                self.evaluate()
            if cfg.save and self._saved != (self.iteration, self.valid_consumed):
                self.save()  # unless this very state was just saved (Megatron skips it too)
            self.checkpointer.wait()
            self.metrics.record("event", {"iteration": self.iteration, "exit": reason,
                                          "consumed_samples": self.consumed})
            self.metrics.say(
                f"exit ({reason}) at iteration {self.iteration}, {self.consumed} samples; "
                f"validation loss {self.last_eval['valid_loss']:.4f}"
            )
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self.checkpointer.wait()  # never leave a background save behind
        return {**self.last_train, **self.last_eval, "iteration": self.iteration,
                "consumed_samples": self.consumed, "exit": reason}

    def _report_step(self, result) -> None:
        """Events worth a line of their own: skipped and non-deterministic steps."""
        if result.skipped:
            self.metrics.record(
                "event",
                {
                    "iteration": self.iteration,
                    "skipped": result.skip_reason,
                    "grad_norm": result.grad_norm,
                },
            )
            self.metrics.say(f"step {self.iteration} skipped ({result.skip_reason})")
        if result.rerun_mismatch:
            self.metrics.record("event", {"iteration": self.iteration, "nondeterministic": True})
            self.metrics.say(
                f"step {self.iteration} is not deterministic: its rerun gave a different "
                "loss or gradients (same batch, same parameters)"
            )

    def _write_trace(self) -> None:
        """All ranks' spans of the step just taken, as DIR/step_N.json (rank 0 writes)."""
        groups = self.engine.context.groups
        tp, dp, pp = groups.topo.coords(groups.rank)
        cp = f" cp {groups.cp_rank}" if groups.topo.cp > 1 else ""
        gathered = timelines.gather(
            self.engine.context.tracer.events, f"pp {pp} dp {dp}{cp} tp {tp}"
        )
        if gathered is not None:
            os.makedirs(self.cfg.trace, exist_ok=True)
            path = os.path.join(self.cfg.trace, f"step_{self.iteration}.json")
            timelines.write(path, *gathered)
            self.metrics.record("event", {"iteration": self.iteration, "trace": path,
                                          **_summary(timelines.analyze(gathered[0]))})

    def _finished(self) -> bool:
        cfg = self.cfg
        return (cfg.train_iters and self.iteration >= cfg.train_iters) or (
            cfg.train_samples and self.consumed >= cfg.train_samples
        )

    def _exit_reason(self, start: float) -> str:
        """Why to stop now, decided by all ranks together."""
        cfg = self.cfg
        local = self._signal or (
            cfg.exit_duration_in_mins and time.monotonic() - start > 60 * cfg.exit_duration_in_mins
        )
        flags = torch.tensor([1 if self._signal else 0, 1 if local else 0])
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0]:
            return "sigterm"
        if flags[1]:
            return "exit_duration_in_mins"
        if cfg.exit_interval and self.iteration % cfg.exit_interval == 0:
            return "exit_interval"
        return ""

    def _on_sigterm(self, signum, frame) -> None:
        self._signal = True  # finish the step, save, exit 0

    # ------------------------------------------------------------------ batches

    def _size_at(self, consumed: int) -> int:
        return [size for threshold, size in self.sizes if consumed >= threshold][-1]

    def _switch_batch_size(self) -> None:
        size = self._size_at(self.consumed)
        old = self.engine.config.global_batch_size
        if size == old:
            return
        if self.cfg.save:
            self.save()  # docs/megatron-semantics.md §2.3.3: a checkpoint just before the switch
        self.engine.set_global_batch_size(size)
        self.metrics.record(
            "event",
            {
                "iteration": self.iteration,
                "consumed_samples": self.consumed,
                "batch_size_switch": [old, size],
            },
        )
        self.metrics.say(f"global batch size {old} -> {size} at {self.consumed} samples")

    def _train_batch(self, size: int):
        if not self.engine.needs_data:
            return None  # a middle pipeline stage reads no data
        return self.batch("train", range(self.consumed, self.consumed + size))

    def batch(
        self, split: str, positions
    ) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        """The samples at stream ``positions`` of the "train" or "valid" split as the model
        takes them (``model_batch``)."""
        return model_batch(self.data.fields(split, positions), keywords=self.keywords)

    # ------------------------------------------------------------------ eval, log, save

    def evaluate(self) -> dict:
        """eval_iters batches of the persistent sequential validation stream
        (docs/megatron-semantics.md §2.9); its seconds as eval_time."""
        tick = time.perf_counter()
        size = self.engine.config.global_batch_size
        m = size // (self.engine_config.micro_batch_size * self.dp)
        loss_sum = tokens = 0.0
        for _ in range(self.cfg.eval_iters):
            batch = None
            if self.engine.needs_data:
                batch = self.batch("valid", range(self.valid_consumed, self.valid_consumed + size))
            r = self.engine.eval_step(batch, num_microbatches=m)
            self.valid_consumed += size
            loss_sum += r.loss * r.num_tokens
            tokens += r.num_tokens
        loss = loss_sum / max(tokens, 1.0)
        out = {"iteration": self.iteration, "valid_loss": loss, "valid_ppl": perplexity(loss),
               "eval_time": time.perf_counter() - tick}
        self.last_eval = out
        self.metrics.record("eval", out)
        self.metrics.say(
            f"validation at iteration {self.iteration}: loss {loss:.4f}, perplexity "
            f"{out['valid_ppl']:.2f}"
        )
        return out

    def _log(self, window: list) -> dict:
        """The train record of the steps in ``window``; time, tokens/s and FLOP/s from the
        steps' own seconds."""
        ok = [r for r, _, _ in window if not r.skipped]
        samples = sum(size for _, size, _ in window)
        elapsed = sum(seconds for _, _, seconds in window)
        per_sample = self.engine.model_flops_per_step / self.engine.config.global_batch_size
        flops = sum(per_sample * size for _, size, _ in window)
        norms = [r.grad_norm for r in ok]
        values = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed,
            "loss": sum(r.loss for r in ok) / len(ok) if ok else float("nan"),
            "lr": window[-1][0].lr,
            "grad_norm": norms[-1] if norms else float("nan"),
            "loss_scale": self.engine.context.scaler.scale if self.engine.context.scaler else 1.0,
            "params_norm": self.engine.params_norm(),
            "skipped": len(window) - len(ok),
            "skipped_total": self.skipped,
            "batch_size": window[-1][1],
            "iteration_time": elapsed / len(window),
            "tokens_per_s": samples * self.cfg.seq_len / elapsed,
            "tflops_per_rank": flops / elapsed / self.world / 1e12,
            **_expert_load([r for r, _, _ in window]),
        }
        if self.iteration == self.cfg.log_interval:  # the first log: the memory report
            report = memory_report(self.engine.program, self.engine.context)
            self.metrics.record("memory", {"iteration": self.iteration, "stages": report})
            for s in report:
                self.metrics.say(
                    f"memory, pipeline stage {s['stage']}: parameters {_mib(s['parameters'])}, "
                    f"gradients {_mib(s['gradient_buffers'])}, optimizer "
                    f"{_mib(s['optimizer_state'])}, activations {_mib(s['activations'])} "
                    f"({s['microbatches_in_flight']} micro-batches in flight), total "
                    f"{_mib(s['total'])}"
                )
        predicted = self.cfg.predicted_step_s
        shown = predicted and self.iteration <= 3 * self.cfg.log_interval  # the first 3 logs
        if shown:
            values["predicted_step_s"] = predicted
        self.last_train = values
        self.metrics.record("train", values)
        self.metrics.show(
            f"loss {values['loss']:.4f} lr {values['lr']:.2e} grad_norm {values['grad_norm']:.3f} "
            f"{values['tokens_per_s']:,.0f} tok/s {values['tflops_per_rank'] * 1e3:.2f} "
            "GFLOP/s/rank"
            + (
                f" load imbalance {values['load_imbalance_max']:.2f}"
                if "load_imbalance_max" in values
                else ""
            )
            + (
                f" step {values['iteration_time']:.3f} s (predicted {predicted:.3f} s)"
                if shown
                else ""
            ),
            iteration=self.iteration,
        )
        return values

    def save(self) -> None:
        """Checkpoint this iteration (collective; in the background with async_save). The
        seconds the loop waited, as save_time: the whole save, or with async_save the wait
        for the previous one and the snapshot."""
        tick = time.perf_counter()
        state = {
            "consumed_samples": self.consumed,
            "valid_consumed": self.valid_consumed,
            "skipped": self.skipped,
            "config": dataclasses.asdict(self.cfg),
            "run_dir": self.run_dir,
        }
        path = self.checkpointer.save(self.cfg.save, self.iteration, state)
        self._saved = (self.iteration, self.valid_consumed)
        self.metrics.record("event", {"iteration": self.iteration, "save_started": path,
                                      "save_time": time.perf_counter() - tick})

    def _run_dir(self) -> str:
        """Where this run's metrics go (``metrics.run_directory``), decided by rank 0 (the
        one that writes there) and told to every rank, so all take the same path or raise
        the same error. It resumes when --load holds a checkpoint (whose trainer state
        names its directory) or the launcher restarted it (--max-restarts)."""
        decided: str | Exception | None = None
        if self.rank == 0:
            saved = checkpoint.saved_trainer_state(self.cfg.load) if self.cfg.load else None
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            try:
                decided = run_directory(self.cfg.run_dir, resumed=(saved or {}).get("run_dir"),
                                        resuming=saved is not None or restarted)
            except FxmegError as exc:  # every rank raises it
                decided = exc
        if self.world > 1:
            box = [decided]
            dist.broadcast_object_list(box, src=0)
            decided = box[0]
        if isinstance(decided, Exception):
            raise decided
        return decided

    def _start_line(self) -> str:
        """The resolved layout, the run directory and where checkpoints go."""
        cfg, par, engine = self.cfg, self.engine.config.parallel, self.engine.config
        layout = " ".join(
            f"{name}={getattr(par, name)}" for name in ("tp", "cp", "ep", "pp", "vpp", "dp")
        )
        saving = (
            f"checkpoints to {cfg.save}"
            + (f" every {cfg.save_interval} steps" if cfg.save_interval else " at the end")
            if cfg.save
            else "no checkpoints (--save)"
        )
        zero = engine.data_parallel.zero_stage
        return (
            f"layout {layout} zero={zero} on {self.world} rank(s), schedule "
            f"{par.resolved_schedule}, {engine.precision}; run directory {self.run_dir}; {saving}"
        )

    def _resume(self) -> None:
        state = self.checkpointer.load(self.cfg.load)
        if state is None:
            self.metrics.say(f"no checkpoint in {self.cfg.load}: starting from scratch")
            return
        if "consumed_samples" not in state:  # engine.save's: the caller fed its own batches
            raise CheckpointError(
                f"--load {self.cfg.load}: its checkpoint was saved by engine.save (the Python "
                "API), which records no position in the trainer's data (consumed samples), so the "
                "trainer cannot resume from it; start from its weights with --init-from "
                f"{self.cfg.load} (fresh optimizer and steps)"
            )
        self.iteration, self.consumed = state["iteration"], state["consumed_samples"]
        self.valid_consumed, self.skipped = state["valid_consumed"], state["skipped"]
        self.metrics.rewind(self.iteration)
        self.metrics.say(
            f"resumed from {self.cfg.load} at iteration {self.iteration}, {self.consumed} samples"
        )


def _expert_load(results: list) -> dict:
    """The routed-experts load of the steps of one log: ``tokens_per_expert`` (per layer,
    summed over the steps), ``load_imbalance`` (per layer, max / mean tokens per expert,
    averaged over the steps) and ``load_imbalance_max`` (its largest layer); nothing for a
    model without routed experts."""
    loads = [r.expert_load for r in results if r.expert_load]
    if not loads:
        return {}
    tokens = {layer: [sum(c) for c in zip(*(load[layer] for load in loads))] for layer in loads[0]}
    per_step = [r.load_imbalance for r in results if r.expert_load]
    imbalance = {layer: sum(s[layer] for s in per_step) / len(per_step) for layer in loads[0]}
    return {"tokens_per_expert": tokens, "load_imbalance": imbalance,
            "load_imbalance_max": max(imbalance.values())}


def _summary(analysis: dict) -> dict:
    """The per-step numbers read from a trace, for metrics.jsonl."""
    ranks = analysis["ranks"]
    hidden = [r["dp_hidden"] for r in ranks if r["dp_hidden"] is not None]
    return {"bubble": max(r["bubble"] for r in ranks), "p2p_s": max(r["p2p_s"] for r in ranks),
            "dp_hidden": min(hidden) if hidden else None}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


