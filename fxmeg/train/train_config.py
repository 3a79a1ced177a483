"""`fxmeg train`'s options (TrainConfig) and their flat names: every scalar field of
TrainConfig, and of EngineConfig and its sections (``fxmeg.config.flat_names``), is one
flag and one config-file key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from fxmeg.config import SECTIONS, EngineConfig, flat_names, scalar_fields
from fxmeg.data.megatron import DataPaths, MaskRule
from fxmeg.data.sft import LAYOUTS, SFTFormat
from fxmeg.errors import ConfigError, closest
from fxmeg.sizes import Size, check_numbers

_ENGINE = EngineConfig(micro_batch_size=4, global_batch_size=32)
"""The engine options of a TrainConfig that sets none: micro-batches of 4, global batches of 32."""
OPTIMIZERS = ("adamw", "muon")
"""What `--optimizer` chooses from."""


@dataclass(frozen=True)
class TrainConfig:
    """Every option of `fxmeg train`: the trainer's own fields, and ``engine`` (an
    EngineConfig, which holds the ParallelConfig) for everything ``fxmeg.parallelize``
    takes. Flags and config-file keys are flat: each scalar field of TrainConfig, EngineConfig
    and its sections is one name (--micro-batch-size 4, --tp 2; ``tp = 2`` in TOML); build
    one from them with ``TrainConfig.from_flat`` and change one with ``replace``."""

    model: str = "models.gpt:GPT"
    """The model class, module:Class; built from model_args (kwargs or its config dataclass;
    a Hugging Face class, e.g. transformers:LlamaForCausalLM, from its config_class)."""
    model_args: str = "{}"
    """JSON object of the model's constructor or config arguments."""
    data: str = ""
    """One data prefix (PREFIX.bin / .idx, Megatron's indexed format, e.g. from `fxmeg
    prepare-data`): the same as data_path = PREFIX."""
    data_path: str = ""
    """Megatron's --data-path, cut by split: a prefix, prefixes (weighted by their samples),
    or weights and prefixes 'W1 P1 W2 P2 ...'; samples in Megatron's order (docs/cli.md, Data)."""
    split: str = "969,30,1"
    """Megatron's --split: the weights of the train, valid and test documents of data_path."""
    train_data_path: str = ""
    """Instead of data_path: the training split's own blend (all its documents), as data_path."""
    valid_data_path: str = ""
    """With train_data_path: the validation split's own blend."""
    test_data_path: str = ""
    """With train_data_path: the test split's own blend (fxmeg trains and evaluates; nothing reads
    it)."""
    data_cache_path: str = ""
    """Megatron's --data-cache-path: a directory for the sample-order indices; later runs with
    the same data and settings read them instead of building them (fxmeg/data/cache.py)."""
    vocab_size: int = 0
    """The data's vocabulary size (0: from tokenizer_model, else from PREFIX.json, which `fxmeg
    prepare-data` writes and Megatron's tools do not); every token id is checked against it."""
    tokenizer_model: str = ""
    """The tokenizer the data was made with (a tokenizer.json, or a directory holding one, as
    Megatron's --tokenizer-model): the vocabulary size and the end-of-document id."""
    eod_id: int = -1
    """The end-of-document token id (-1: from tokenizer_model or PREFIX.json); the masks need it."""
    eod_mask_loss: bool = False
    """Megatron's --eod-mask-loss: no loss where the input token is end-of-document."""
    reset_position_ids: bool = False
    """Megatron's --reset-position-ids: positions restart after each end-of-document (a model
    that takes position_ids by keyword: a Hugging Face one)."""
    reset_attention_mask: bool = False
    """Megatron's --reset-attention-mask: the documents packed in a sample do not attend to
    each other (a model that takes a 4-D attention_mask by keyword: a Hugging Face one)."""
    sft: bool = False
    """Supervised fine-tuning: the data paths are JSON-lines files of prompt/response pairs
    (or conversations, with chat_template), tokenised with tokenizer_model; the loss counts
    response tokens only (fxmeg/data/sft.py)."""
    sft_layout: str = "packed"
    """With sft: 'packed' (examples kept apart in windows of seq_len: a Hugging Face model) or
    'padded' (one example per row, each global batch padded to its length bucket; needs
    variable_seq_lengths)."""
    sft_pad_multiple: int = 8
    """With sft_layout='padded': a global batch is padded to a multiple of this (at most seq_len).
    """
    sft_prompt_key: str = "prompt"
    """With sft: the field of a line holding the prompt."""
    sft_response_key: str = "response"
    """With sft: the field of a line holding the response."""
    sft_messages_key: str = "messages"
    """With sft and chat_template: the field of a line holding the conversation."""
    chat_template: str = ""
    """With sft: a Jinja chat template file, or a tokenizer_config.json holding one; the
    lines are then conversations and the loss counts the assistant turns."""
    seq_len: int = 128
    """Tokens per sample (each sample reads seq_len + 1 tokens)."""
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
    lr_warmup_iters: int = 0
    """Linear warmup over this many steps (with train_iters; Megatron's: steps x the final
    global batch size in samples)."""
    lr_decay_samples: int = 0
    """Samples by the end of decay (0: the whole run)."""
    lr_decay_iters: int = 0
    """Steps by the end of decay (with train_iters; 0: the whole run)."""
    lr_decay_style: str = "cosine"
    """constant, linear, cosine, inverse-square-root or WSD."""
    lr_wsd_decay_samples: int = 0
    """WSD: samples of the final anneal (0: the last tenth of the decay)."""
    lr_wsd_decay_iters: int = 0
    """WSD: steps of the final anneal (with train_iters)."""
    lr_wsd_decay_style: str = "exponential"
    """WSD: the anneal's shape: exponential, linear, cosine or minus_sqrt."""
    optimizer: str = "adamw"
    """'adamw', or 'muon': Muon on the hidden layers' matrices and AdamW on the rest
    (embeddings, head, biases, norms), one lr and weight decay for both
    (fxmeg.runtime.optimizer.optimizer.muon_adamw; with the distributed optimizer it shards
    layer-wise)."""
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
    predicted_step_s: float = 0.0
    """A predicted step time in seconds (`--layout auto` sets the search's; 0: none): the
    first three logged steps show the measured time beside it."""
    run_dir: str = ""
    """Where metrics.jsonl, TensorBoard files and plots go ('': runs/run, or runs/run-N when
    that holds a run; a resumed run continues the directory its checkpoint names)."""
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
    """Engine options, in sections (engine.parallel: the layout; flat names: see from_flat)."""

    SIZES: ClassVar[dict[str, Size]] = {
        "seq_len": Size(1, "sequence length (tokens per sample)"),
        "vocab_size": Size(0, "vocabulary size of the data (0: from the tokenizer or PREFIX.json)"),
        "sft_pad_multiple": Size(1, "padding multiple of SFT batches"),
        "eod_id": Size(-1, "end-of-document token id (-1: from the tokenizer or PREFIX.json)"),
        "seed": Size(0, "random seed"),
        "train_iters": Size(0, "number of training steps"),
        "train_samples": Size(0, "number of training samples"),
        "exit_interval": Size(0, "save-and-stop interval in steps (0: never)"),
        "lr_warmup_samples": Size(0, "learning-rate warmup in samples"),
        "lr_decay_samples": Size(0, "learning-rate decay in samples (0: the whole run)"),
        "lr_wsd_decay_samples": Size(0, "WSD anneal in samples (0: the last tenth of the decay)"),
        "lr_warmup_iters": Size(0, "learning-rate warmup in steps"),
        "lr_decay_iters": Size(0, "learning-rate decay in steps (0: the whole run)"),
        "lr_wsd_decay_iters": Size(0, "WSD anneal in steps"),
        "eval_interval": Size(0, "evaluation interval in steps (0: only at the end)"),
        "eval_iters": Size(1, "number of validation batches per evaluation"),
        "log_interval": Size(1, "log interval in steps"),
        "save_interval": Size(0, "checkpoint interval in steps (0: only at the end)"),
        "keep_last": Size(0, "number of checkpoints kept (0: all)"),
        "trace_interval": Size(1, "trace interval in steps"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if (self.train_iters > 0) == (self.train_samples > 0):
            raise ConfigError("set exactly one of train_iters and train_samples (> 0)")
        if self.data and (self.data_path or self.train_data_path):
            raise ConfigError(
                "data is the one-prefix spelling of data_path: give one of data, data_path and "
                "the per-split paths (train_data_path ...)"
            )
        self.data_paths().check()
        self._check_lr_units()
        self._check_sft()
        if self.engine.lr_schedule is not None:
            raise ConfigError(
                "engine.lr_schedule must stay None: the trainer builds the schedule "
                "from lr, min_lr, lr_warmup_samples, lr_decay_samples and lr_decay_style"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r} is not one of {OPTIMIZERS}"
                              + closest(self.optimizer, OPTIMIZERS))
        batch_size_schedule(self)  # validates

    def _check_lr_units(self) -> None:
        """The lr schedule in steps or in samples, as the run's length is (Megatron's rule:
        the *_iters lengths go with train_iters); never both for one length."""
        for what in ("warmup", "decay", "wsd_decay"):
            iters, samples = getattr(self, f"lr_{what}_iters"), getattr(self, f"lr_{what}_samples")
            if iters and samples:
                raise ConfigError(
                    f"lr_{what}_iters={iters} and lr_{what}_samples={samples} both set: "
                    f"give the {what.replace('_', ' ')} length once, in steps or in samples"
                )
            if iters and not self.train_iters:
                raise ConfigError(
                    f"lr_{what}_iters={iters} counts steps, but the run is given in samples "
                    f"(train_samples={self.train_samples}): use lr_{what}_samples, or train_iters"
                )

    def lr_samples(self, global_batch_size: int) -> tuple[int, int, int]:
        """(warmup, decay, WSD anneal) lengths in samples, steps converted at
        ``global_batch_size`` (the final one, as Megatron's ``args.global_batch_size``); 0
        where not set."""
        return tuple(
            getattr(self, f"lr_{w}_samples") or getattr(self, f"lr_{w}_iters") * global_batch_size
            for w in ("warmup", "decay", "wsd_decay")
        )

    def _check_sft(self) -> None:
        if not self.sft:
            given = [
                f
                for f in (
                    "sft_layout",
                    "sft_pad_multiple",
                    "sft_prompt_key",
                    "sft_response_key",
                    "sft_messages_key",
                    "chat_template",
                )
                if getattr(self, f) != getattr(TrainConfig, f)
            ]
            if given:
                raise ConfigError(f"{', '.join(given)} read SFT data: add --sft, or drop them")
            return
        if self.sft_layout not in LAYOUTS:
            raise ConfigError(f"sft_layout={self.sft_layout!r} is not one of {LAYOUTS}"
                              + closest(self.sft_layout, LAYOUTS))
        if not self.tokenizer_model:
            raise ConfigError(
                "--sft tokenises its JSON lines with the model's tokenizer: pass --tokenizer-model "
                "PATH (a tokenizer.json, or the directory holding it)"
            )
        if self.data_cache_path:
            raise ConfigError(
                "--data-cache-path caches the sample order of indexed (.bin / .idx) data; --sft "
                "reads JSON lines and orders them at start-up: drop --data-cache-path"
            )
        if self.masks():
            raise ConfigError(
                f"--sft lays out its own masks (--sft-layout); {' '.join(self.masks().flags())} "
                "are for pretraining data"
            )
        if self.sft_layout == "padded" and self.seq_len % self.sft_pad_multiple:
            raise ConfigError(
                "--sft-layout padded pads to multiples of "
                f"sft_pad_multiple={self.sft_pad_multiple}, up to seq_len={self.seq_len}, which is "
                "not one: make seq_len a multiple of it"
            )
        if self.sft_layout == "padded" and not self.engine.variable_seq_lengths:
            raise ConfigError("--sft-layout padded pads each global batch to its own length: add "
                              "--variable-seq-lengths (or use --sft-layout packed)")

    def sft_format(self) -> SFTFormat:
        return SFTFormat(
            self.sft_prompt_key,
            self.sft_response_key,
            self.sft_messages_key,
            self.chat_template,
            self.sft_layout,
            self.sft_pad_multiple,
        )

    def masks(self) -> MaskRule:
        """Megatron's three mask switches (``fxmeg.data.megatron.MaskRule``)."""
        return MaskRule(self.eod_mask_loss, self.reset_position_ids, self.reset_attention_mask)

    def data_paths(self) -> DataPaths:
        """Where the data is (``fxmeg.data.megatron``)."""
        return DataPaths(
            blend=tuple((self.data_path or self.data).split()),
            split=self.split,
            per_split=tuple(
                tuple(p.split())
                for p in (self.train_data_path, self.valid_data_path, self.test_data_path)
            ),
        )

    @classmethod
    def from_flat(cls, where: str = "", /, **values) -> TrainConfig:
        """A TrainConfig from flat names (the flags' and config files' keys): every
        trainer field and every scalar field of EngineConfig and its sections; unset ones
        keep their defaults. An unknown name is refused with the nearest valid one
        (``where``, e.g. a config file, is named in that message)."""
        own, engine = _split_flat(values, where)
        return cls(engine=_ENGINE.replace(**engine), **own)

    def replace(self, **changes) -> TrainConfig:
        """This config with some flat names (as ``from_flat`` takes them) changed."""
        own, engine = _split_flat(changes)
        return dataclasses.replace(self, engine=self.engine.replace(**engine), **own)

    def flat(self) -> dict:
        """Flat name -> value of every name ``from_flat`` takes (the scalar fields)."""
        engine = self.engine.flat()
        return {name: getattr(self, name) if cls is TrainConfig else engine[name]
                for name, (cls, _) in flat_fields().items()}


def flat_fields() -> dict[str, tuple[type, type]]:
    """Flat name -> (the class declaring it, its value type), in flag order: TrainConfig's
    fields, then EngineConfig's scalar fields, then its sections' (``fxmeg.config.flat_names``)."""
    owners = {"": EngineConfig, **SECTIONS}
    engine = {name: (owners[section], scalar_fields(owners[section]).get(name))
              for name, section in flat_names().items()}
    return {name: (TrainConfig, kind) for name, kind in scalar_fields(TrainConfig).items()} | {
        name: (cls, kind) for name, (cls, kind) in engine.items() if kind is not None}


def flat_defaults() -> dict:
    """Flat name -> the value a TrainConfig takes when that name is not given."""
    own = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name != "engine"}
    engine = _ENGINE.flat()
    return {
        name: own[name] if cls is TrainConfig else engine[name]
        for name, (cls, _) in flat_fields().items()
    }


def engine_from_flat(**values) -> EngineConfig:
    """The EngineConfig of a TrainConfig given these flat EngineConfig names (its
    sections' included: ``fxmeg plan`` takes the layout flags of ``fxmeg train``)."""
    own, engine = _split_flat(values)
    if own:
        raise ConfigError(
            f"{sorted(own)} are options of the trainer, not of the engine or the layout"
        )
    return _ENGINE.replace(**engine)


MEGATRON_NAMES: dict[str, tuple[str, object]] = {
    "tensor_model_parallel_size": ("tp", None),
    "pipeline_model_parallel_size": ("pp", None),
    "context_parallel_size": ("cp", None),
    "expert_model_parallel_size": ("ep", None),
    "num_virtual_stages_per_pipeline_rank": ("vpp", None),
    "seq_length": ("seq_len", None),
    "bf16": ("precision", "bf16"),
    "fp16": ("precision", "fp16"),
    "use_distributed_optimizer": ("distributed_optimizer", True),
    "recompute_granularity": ("recompute", None),
    "recompute_activations": ("recompute", "selective"),
    "moe_expert_capacity_factor": ("moe_capacity_factor", None),
}
"""Megatron-LM's names for fxmeg's flat names where the meaning is the same, as flags and
config-file keys: name -> (fxmeg's name, the value a switch sets; None: the value given)."""


def from_megatron(values: dict) -> dict:
    """``values`` with Megatron-LM's names (``MEGATRON_NAMES``) turned into fxmeg's; a
    switch given false (``--no-bf16``) sets nothing; a name given twice with two values is
    refused."""
    out = {k: v for k, v in values.items() if k not in MEGATRON_NAMES}
    for alias, (name, switch) in MEGATRON_NAMES.items():
        if alias not in values:
            continue
        value = values[alias] if switch is None else (switch if values[alias] else None)
        if value is None:
            continue
        if name in out and out[name] != value:
            raise ConfigError(
                f"{alias}={values[alias]!r} (Megatron's name) and {name}={out[name]!r} "
                f"disagree: give one of them"
            )
        out[name] = value
    return out


def _split_flat(values: dict, where: str = "") -> tuple[dict, dict]:
    """(TrainConfig's own fields, the engine's and its sections') of flat ``values``,
    Megatron's names read as fxmeg's; an unknown name is refused naming the nearest."""
    values = from_megatron(values)
    names = flat_fields()
    for name in values:
        if name not in names:
            place = f" in {where}" if where else ""
            raise ConfigError(f"unknown config key {name!r}{place}" + closest(name, names))
    own = {k: v for k, v in values.items() if names[k][0] is TrainConfig}
    return own, {k: v for k, v in values.items() if k not in own}


def batch_size_schedule(
    cfg: TrainConfig, engine: EngineConfig | None = None
) -> list[tuple[int, int]]:
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
