"""The training loop (docs/design.md §8.1, §8.3, §8.9, §8.10): Megatron's pretrain() on
fxmeg's engine.

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
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

import fxmeg
from fxmeg import checkpoint, hugging_face, trace
from fxmeg.build import build_model
from fxmeg.config import EngineConfig, ParallelConfig, scalar_fields
from fxmeg.data import Corpus, Sampler, Samples
from fxmeg.errors import CheckpointError, ConfigError, closest
from fxmeg.lr_schedule import LRSchedule
from fxmeg.metrics import Metrics, perplexity
from fxmeg.numbers import Size, check_numbers
from fxmeg.plan import memory_report
from fxmeg.runtime.optimizer import adamw, muon_adamw

_ENGINE = EngineConfig(micro_batch_size=4, global_batch_size=32)
"""The engine options of a TrainConfig that sets none: micro-batches of 4, global batches of 32."""
OPTIMIZERS = ("adamw", "muon")
"""What `--optimizer` chooses from."""


@dataclass(frozen=True)
class TrainConfig:
    """Every option of `fxmeg train`: the trainer's own fields, and ``engine`` (an
    EngineConfig, which holds the ParallelConfig) for everything ``fxmeg.parallelize``
    takes. Flags and config-file keys are flat: each scalar field of the three classes
    is one name (--micro-batch-size 4, --tp 2; ``tp = 2`` in TOML); build one from them
    with ``TrainConfig.from_flat`` and change one with ``replace``."""

    model: str = "models.gpt:GPT"
    """The model class, module:Class; built from model_args (kwargs or its config dataclass;
    a Hugging Face class, e.g. transformers:LlamaForCausalLM, from its config_class)."""
    model_args: str = "{}"
    """JSON object of the model's constructor or config arguments."""
    data: str = ""
    """Prefix of a corpus written by `fxmeg prepare-data`."""
    seq_len: int = 128
    """Tokens per sample (each sample reads seq_len + 1 tokens)."""
    valid_fraction: float = 0.05
    """Share of the corpus (at a document boundary, from the end) held out for validation."""
    seed: int = 1234
    """Seed of model initialisation and data shuffling."""
    step_batch_size_schedule: str = ""
    """'THRESHOLD:BS ...': from THRESHOLD consumed samples on, train with global batch BS."""
    train_iters: int = 0
    """Steps to train (or train_samples)."""
    train_samples: int = 0
    """Samples to train (or train_iters)."""
    exit_interval: int = 0
    """Save and stop when the iteration is a multiple of this (0: never)."""
    exit_duration_in_mins: float = 0.0
    """Save and stop after this many minutes (0: never)."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_warmup_samples: int = 0
    """Linear warmup from 0 over this many samples."""
    lr_decay_samples: int = 0
    """Samples by the end of decay (0: the whole run)."""
    lr_decay_style: str = "cosine"
    """constant, linear, cosine, inverse-square-root or WSD."""
    lr_wsd_decay_samples: int = 0
    """WSD: samples of the final anneal (0: the last tenth of the decay)."""
    lr_wsd_decay_style: str = "exponential"
    """WSD: the anneal's shape: exponential, linear, cosine or minus_sqrt."""
    optimizer: str = "adamw"
    """'adamw', or 'muon': Muon on the hidden layers' matrices and AdamW on the rest
    (embeddings, head, biases, norms), one lr and weight decay for both
    (fxmeg.runtime.optimizer.muon_adamw; with the distributed optimizer it shards layer-wise)."""
    weight_decay: float = 0.01
    """Weight decay (not applied to biases and norms)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    eval_interval: int = 0
    """Evaluate every this many steps (0: only at the end)."""
    eval_iters: int = 10
    """Validation batches per evaluation."""
    log_interval: int = 10
    """Log every this many steps."""
    run_dir: str = "runs/run"
    """Where metrics.jsonl, TensorBoard files and plots go."""
    tensorboard: bool = True
    """Also write TensorBoard events (when tensorboard is installed)."""
    progress: bool = True
    """Show a live progress line on rank 0."""
    save: str = ""
    """Checkpoint directory ('' : no checkpoints)."""
    load: str = ""
    """Resume from the latest checkpoint in this directory, if any."""
    save_interval: int = 0
    """Save every this many steps (0: only at the end and before batch-size switches)."""
    keep_last: int = 0
    """Keep only this many checkpoints (0: all)."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on."""
    init_from: str = ""
    """Start from these weights: a state_dict file (e.g. one written by `fxmeg export`), a
    safetensors file or Hugging Face directory, or an fxmeg checkpoint. The model is built
    on the meta device and each rank reads only its slices."""
    check_determinism: bool = False
    """Run each step's forward and backward twice and report steps that differ."""
    trace: str = ""
    """Write a Chrome / Perfetto timeline of traced steps to this directory ('' : off)."""
    trace_interval: int = 1
    """Trace every this many steps (with --trace); `fxmeg plot-schedule` draws one."""
    engine: EngineConfig = _ENGINE
    """Engine options and, in engine.parallel, the layout (flat names: see from_flat)."""

    SIZES: ClassVar[dict[str, Size]] = {
        "seq_len": Size(1, "sequence length (tokens per sample)"),
        "seed": Size(0, "random seed"),
        "train_iters": Size(0, "number of training steps"),
        "train_samples": Size(0, "number of training samples"),
        "exit_interval": Size(0, "save-and-stop interval in steps (0: never)"),
        "lr_warmup_samples": Size(0, "learning-rate warmup in samples"),
        "lr_decay_samples": Size(0, "learning-rate decay in samples (0: the whole run)"),
        "lr_wsd_decay_samples": Size(0, "WSD anneal in samples (0: the last tenth of the decay)"),
        "eval_interval": Size(0, "evaluation interval in steps (0: only at the end)"),
        "eval_iters": Size(1, "number of validation batches per evaluation"),
        "log_interval": Size(1, "log interval in steps"),
        "save_interval": Size(0, "checkpoint interval in steps (0: only at the end)"),
        "keep_last": Size(0, "number of checkpoints kept (0: all)"),
        "trace_interval": Size(1, "trace interval in steps"),
    }
    """The rule of each integer field (``fxmeg.numbers.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if (self.train_iters > 0) == (self.train_samples > 0):
            raise ConfigError("set exactly one of train_iters and train_samples (> 0)")
        if not self.data:
            raise ConfigError("data is required: the prefix of a corpus from `fxmeg prepare-data`")
        if self.engine.lr_schedule is not None:
            raise ConfigError("engine.lr_schedule must stay None: the trainer builds the schedule "
                              "from lr, min_lr, lr_warmup_samples, lr_decay_samples and lr_decay_style")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r} is not one of {OPTIMIZERS}"
                              + closest(self.optimizer, OPTIMIZERS))
        batch_size_schedule(self)  # validates

    @classmethod
    def from_flat(cls, where: str = "", /, **values) -> TrainConfig:
        """A TrainConfig from flat names (the flags' and config files' keys): every
        trainer field and every scalar field of EngineConfig and ParallelConfig; unset
        ones keep their defaults. An unknown name is refused with the nearest valid one
        (``where``, e.g. a config file, is named in that message)."""
        own, engine = _split_flat(values, where)
        return cls(engine=_with_flat(_ENGINE, engine), **own)

    def replace(self, **changes) -> TrainConfig:
        """This config with some flat names (as ``from_flat`` takes them) changed."""
        own, engine = _split_flat(changes)
        return dataclasses.replace(self, engine=_with_flat(self.engine, engine), **own)

    def flat(self) -> dict:
        """Flat name -> value of every name ``from_flat`` takes (the scalar fields)."""
        owners = {TrainConfig: self, EngineConfig: self.engine, ParallelConfig: self.engine.parallel}
        return {name: getattr(owners[cls], name) for name, (cls, _) in flat_fields().items()}


def flat_fields() -> dict[str, tuple[type, type]]:
    """Flat name -> (the class declaring it, its value type), in flag order: TrainConfig's
    fields, then EngineConfig's scalar fields, then ParallelConfig's."""
    return {name: (cls, kind) for cls in (TrainConfig, EngineConfig, ParallelConfig)
            for name, kind in scalar_fields(cls).items()}


def flat_defaults() -> dict:
    """Flat name -> the value a TrainConfig takes when that name is not given."""
    own = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name != "engine"}
    owners = {EngineConfig: _ENGINE, ParallelConfig: _ENGINE.parallel}
    return {name: own[name] if cls is TrainConfig else getattr(owners[cls], name)
            for name, (cls, _) in flat_fields().items()}


def engine_from_flat(**values) -> EngineConfig:
    """The EngineConfig of a TrainConfig given these flat EngineConfig / ParallelConfig
    names (``fxmeg plan`` takes the layout flags of ``fxmeg train``)."""
    own, engine = _split_flat(values)
    if own:
        raise ConfigError(f"{sorted(own)} are options of the trainer, not of the engine or the layout")
    return _with_flat(_ENGINE, engine)


def _split_flat(values: dict, where: str = "") -> tuple[dict, dict]:
    """(TrainConfig's own fields, the engine's and layout's) of flat ``values``; an
    unknown name is refused naming the nearest."""
    names = flat_fields()
    for name in values:
        if name not in names:
            place = f" in {where}" if where else ""
            raise ConfigError(f"unknown config key {name!r}{place}" + closest(name, names))
    own = {k: v for k, v in values.items() if names[k][0] is TrainConfig}
    return own, {k: v for k, v in values.items() if k not in own}


def _with_flat(engine: EngineConfig, values: dict) -> EngineConfig:
    """``engine`` with flat EngineConfig / ParallelConfig names changed (one check, at the end)."""
    layout = scalar_fields(ParallelConfig)
    parallel = dataclasses.replace(engine.parallel, **{k: v for k, v in values.items() if k in layout})
    others = {k: v for k, v in values.items() if k not in layout}
    return dataclasses.replace(engine, parallel=parallel, **others)


def batch_size_schedule(cfg: TrainConfig, engine: EngineConfig | None = None) -> list[tuple[int, int]]:
    """(threshold in consumed samples, global batch size) from 0 on, ascending. The
    micro-batch count may only grow (docs/design.md §8.3.3): a shrinking size is refused.
    Each size is checked as EngineConfig checks global_batch_size, against ``engine``
    (default cfg.engine; pass the resolved one for the full check with dp)."""
    engine = engine or cfg.engine
    steps = [(0, engine.global_batch_size)]
    for item in cfg.step_batch_size_schedule.split():
        try:
            threshold, size = (int(x) for x in item.split(":"))
        except ValueError as exc:
            raise ConfigError(
                f"step_batch_size_schedule entry {item!r} is not THRESHOLD:BATCH_SIZE"
            ) from exc
        if threshold == 0:
            steps[0] = (0, size)
        else:
            steps.append((threshold, size))
    for (t0, b0), (t1, b1) in zip(steps, steps[1:]):
        if t1 <= t0:
            raise ConfigError(f"step_batch_size_schedule thresholds must increase: {t0} then {t1}")
        if b1 < b0:
            raise ConfigError(
                f"step_batch_size_schedule would shrink the global batch from {b0} to {b1} at "
                f"{t1} samples; the micro-batch count may only grow (docs/design.md §8.3.3)"
            )
    for threshold, size in steps:
        try:
            dataclasses.replace(engine, global_batch_size=size)
        except ConfigError as exc:
            raise ConfigError(
                f"step_batch_size_schedule, global batch {size} from {threshold} samples: {exc}"
            ) from None
    return steps


class Trainer:
    def __init__(self, cfg: TrainConfig, model: nn.Module | None = None) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        engine = cfg.engine.resolve(world)  # dp=None: world // (tp * cp * pp); every batch rule with dp
        self.world, self.dp = world, engine.parallel.dp
        self.sizes = batch_size_schedule(cfg, engine)
        self.engine_config = dataclasses.replace(
            engine, global_batch_size=self._size_at(0), lr_schedule=self._lr_schedule())
        corpus = Corpus(cfg.data)
        self.train_data = Samples(corpus, cfg.seq_len, split="train", valid_fraction=cfg.valid_fraction)
        self.valid_data = Samples(corpus, cfg.seq_len, split="valid", valid_fraction=cfg.valid_fraction)
        self.train_order = Sampler(len(self.train_data), seed=cfg.seed, shuffle=True)
        self.valid_order = Sampler(len(self.valid_data), seed=cfg.seed, shuffle=False)
        torch.manual_seed(cfg.seed)
        if model is None:
            # Megatron pads the vocabulary to a multiple of 128 (x tp there); without the tp
            # factor the model's shapes do not depend on the layout, so checkpoints reshard
            vocab = -(-corpus.vocab_size // 128) * 128
            args = {"vocab_size": vocab, "seq_len": cfg.seq_len} | json.loads(cfg.model_args)
            # --init-from: built on meta, each rank reads only its slices of the weights
            with torch.device("meta") if cfg.init_from else contextlib.nullcontext():
                model = build_model(cfg.model, args)
        self.keywords = hugging_face.is_hugging_face(model)
        """Batches are keyword dicts (a Hugging Face model: fxmeg.hugging_face), else tuples."""
        self.engine = self._engine(model)
        self.checkpointer = checkpoint.Checkpointer(
            self.engine.program, self.engine.context, keep=cfg.keep_last or None, async_save=cfg.async_save,
            hugging_face=self.engine.hugging_face,  # config.json for `fxmeg export --format hf`
        )
        total = cfg.train_iters or None
        self.metrics = Metrics(cfg.run_dir, enabled=self.rank == 0, total=total,
                               progress=cfg.progress, tensorboard=cfg.tensorboard)
        self.checkpointer.on_saved = lambda path: self.metrics.record("event", {"saved": path})
        if self.keywords and not hugging_face.takes_shift_labels(model):
            self.metrics.say(f"{type(model).__name__}'s loss ignores shift_labels: it shifts labels "
                             "itself, so the last token of each window is never a target")
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
        decay = cfg.lr_decay_samples or cfg.train_samples or cfg.train_iters * self.sizes[-1][1]
        style = cfg.lr_decay_style
        return LRSchedule(
            max_lr=cfg.lr, min_lr=cfg.min_lr, warmup_samples=cfg.lr_warmup_samples,
            decay_samples=max(decay, cfg.lr_warmup_samples + 1), style=style,
            wsd_decay_samples=(cfg.lr_wsd_decay_samples or max(1, decay // 10)) if style == "WSD" else None,
            wsd_style=cfg.lr_wsd_decay_style,
        )

    def _engine(self, model: nn.Module) -> fxmeg.Engine:
        cfg = self.cfg
        example = self.batch("train", range(self.engine_config.micro_batch_size))
        betas, eps, wd = (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps, cfg.weight_decay
        return fxmeg.parallelize(
            model, example, config=self.engine_config, weights=cfg.init_from or None,
            optimizer=muon_adamw(lr=cfg.lr, weight_decay=wd, betas=betas, eps=eps) if cfg.optimizer == "muon"
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
                result = self.engine.train_step(self._train_batch(size), check_determinism=cfg.check_determinism,
                                                trace=traced)
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
            self.metrics.say(f"exit ({reason}) at iteration {self.iteration}, {self.consumed} samples; "
                             f"validation loss {self.last_eval['valid_loss']:.4f}")
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self.checkpointer.wait()  # never leave a background save behind
        return {**self.last_train, **self.last_eval, "iteration": self.iteration,
                "consumed_samples": self.consumed, "exit": reason}

    def _report_step(self, result) -> None:
        """Events worth a line of their own: skipped and non-deterministic steps."""
        if result.skipped:
            self.metrics.record("event", {"iteration": self.iteration, "skipped": result.skip_reason,
                                          "grad_norm": result.grad_norm})
            self.metrics.say(f"step {self.iteration} skipped ({result.skip_reason})")
        if result.rerun_mismatch:
            self.metrics.record("event", {"iteration": self.iteration, "nondeterministic": True})
            self.metrics.say(f"step {self.iteration} is not deterministic: its rerun gave a different "
                             "loss or gradients (same batch, same parameters)")

    def _write_trace(self) -> None:
        """All ranks' spans of the step just taken, as DIR/step_N.json (rank 0 writes)."""
        groups = self.engine.context.groups
        tp, dp, pp = groups.topo.coords(groups.rank)
        cp = f" cp {groups.cp_rank}" if groups.topo.cp > 1 else ""
        gathered = trace.gather(self.engine.context.tracer.events, f"pp {pp} dp {dp}{cp} tp {tp}")
        if gathered is not None:
            os.makedirs(self.cfg.trace, exist_ok=True)
            path = os.path.join(self.cfg.trace, f"step_{self.iteration}.json")
            trace.write(path, *gathered)
            self.metrics.record("event", {"iteration": self.iteration, "trace": path,
                                          **_summary(trace.analyze(gathered[0]))})

    def _finished(self) -> bool:
        cfg = self.cfg
        return (cfg.train_iters and self.iteration >= cfg.train_iters) or (
            cfg.train_samples and self.consumed >= cfg.train_samples
        )

    def _exit_reason(self, start: float) -> str:
        """Why to stop now, decided by all ranks together."""
        cfg = self.cfg
        local = self._signal or (cfg.exit_duration_in_mins and time.monotonic() - start > 60 * cfg.exit_duration_in_mins)
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
            self.save()  # docs/design.md §8.3.3: a checkpoint just before the switch
        self.engine.set_global_batch_size(size)
        self.metrics.record("event", {"iteration": self.iteration, "consumed_samples": self.consumed,
                                      "batch_size_switch": [old, size]})
        self.metrics.say(f"global batch size {old} -> {size} at {self.consumed} samples")

    def _train_batch(self, size: int):
        if not self.engine.needs_data:
            return None  # a middle pipeline stage reads no data
        return self.batch("train", self.train_order.indices(self.consumed, size))

    def batch(self, split: str, indices) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        """The samples ``indices`` of the "train" or "valid" split as the model takes
        them: (input_ids, labels), or for a Hugging Face model the keyword batch
        (``hugging_face.keyword_batch``: the same next-token targets)."""
        ids, labels = (self.train_data if split == "train" else self.valid_data).batch(indices)
        return hugging_face.keyword_batch(ids, labels) if self.keywords else (ids, labels)

    # ------------------------------------------------------------------ eval, log, save

    def evaluate(self) -> dict:
        """eval_iters batches of the persistent sequential validation stream
        (docs/design.md §8.9); its seconds as eval_time."""
        tick = time.perf_counter()
        size = self.engine.config.global_batch_size
        m = size // (self.engine_config.micro_batch_size * self.dp)
        loss_sum = tokens = 0.0
        for _ in range(self.cfg.eval_iters):
            batch = None
            if self.engine.needs_data:
                batch = self.batch("valid", self.valid_order.indices(self.valid_consumed, size))
            r = self.engine.eval_step(batch, num_microbatches=m)
            self.valid_consumed += size
            loss_sum += r.loss * r.num_tokens
            tokens += r.num_tokens
        loss = loss_sum / max(tokens, 1.0)
        out = {"iteration": self.iteration, "valid_loss": loss, "valid_ppl": perplexity(loss),
               "eval_time": time.perf_counter() - tick}
        self.last_eval = out
        self.metrics.record("eval", out)
        self.metrics.say(f"validation at iteration {self.iteration}: loss {loss:.4f}, perplexity {out['valid_ppl']:.2f}")
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
                    f"gradients {_mib(s['gradient_buffers'])}, optimizer {_mib(s['optimizer_state'])}, "
                    f"activations {_mib(s['activations'])} ({s['microbatches_in_flight']} micro-batches "
                    f"in flight), total {_mib(s['total'])}"
                )
        self.last_train = values
        self.metrics.record("train", values)
        self.metrics.show(
            f"loss {values['loss']:.4f} lr {values['lr']:.2e} grad_norm {values['grad_norm']:.3f} "
            f"{values['tokens_per_s']:,.0f} tok/s {values['tflops_per_rank'] * 1e3:.2f} GFLOP/s/rank"
            + (f" load imbalance {values['load_imbalance_max']:.2f}" if "load_imbalance_max" in values else ""),
            iteration=self.iteration,
        )
        return values

    def save(self) -> None:
        """Checkpoint this iteration (collective; in the background with async_save). The
        seconds the loop waited, as save_time: the whole save, or with async_save the wait
        for the previous one and the snapshot."""
        tick = time.perf_counter()
        state = {"consumed_samples": self.consumed, "valid_consumed": self.valid_consumed,
                 "skipped": self.skipped, "config": dataclasses.asdict(self.cfg)}
        path = self.checkpointer.save(self.cfg.save, self.iteration, state)
        self._saved = (self.iteration, self.valid_consumed)
        self.metrics.record("event", {"iteration": self.iteration, "save_started": path,
                                      "save_time": time.perf_counter() - tick})

    def _resume(self) -> None:
        state = self.checkpointer.load(self.cfg.load)
        if state is None:
            self.metrics.say(f"no checkpoint in {self.cfg.load}: starting from scratch")
            return
        if "consumed_samples" not in state:  # engine.save's: the caller fed its own batches
            raise CheckpointError(
                f"--load {self.cfg.load}: its checkpoint was saved by engine.save (the Python API), which "
                "records no position in the trainer's data (consumed samples), so the trainer cannot resume "
                f"from it; start from its weights with --init-from {self.cfg.load} (fresh optimizer and steps)")
        self.iteration, self.consumed = state["iteration"], state["consumed_samples"]
        self.valid_consumed, self.skipped = state["valid_consumed"], state["skipped"]
        self.metrics.rewind(self.iteration)
        self.metrics.say(f"resumed from {self.cfg.load} at iteration {self.iteration}, {self.consumed} samples")


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


