"""Configuration: frozen dataclasses that check themselves before any work starts.

Every field has a one-line docstring; cross-field checks live in ``__post_init__`` and
their messages name the field, the numbers and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fxmeg.config_sections import (
    DataParallelConfig,
    GuardsConfig,
    MoEConfig,
    PipelineConfig,
    RecomputeConfig,
)
from fxmeg.errors import ConfigError, closest
from fxmeg.loss_scale import LossScaleConfig
from fxmeg.lr_schedule import LRSchedule
from fxmeg.schedule_registry import (
    SCHEDULES,  # noqa: F401 (read from here too: fxmeg.config.SCHEDULES)
    SPECS,
    Spec,
    batch_refusal,
    layout_refusal,
    placement,
    resolve,
)
from fxmeg.sharding_modes import OptimizerSharding, check_zero3_companions
from fxmeg.sizes import Size, check_numbers, check_size

CP_COMM_TYPES = ("all_gather", "p2p", "a2a", "a2a+p2p")
"""Megatron-Core's ``cp_comm_type`` values, each supported (``ParallelConfig.cp_comm_type``)."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over ranks, tensor-parallel fastest (Megatron's order
    tp-cp-dp-pp): rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)).

    Experts fold over the data-parallel x context-parallel ranks (Megatron's "parallel
    folding"): the dp * cp ranks of one (tp, pp) coordinate, cp fastest, are cut into
    consecutive runs of ``ep``: q = cp_rank + cp * dp_rank, ep_rank = q % ep, expert-data-
    parallel rank = q // ep (Megatron's expert order tp-ep-dp-pp, with expert tp = tp)."""

    tp: int = 1
    """Tensor-parallel size (ranks that share every layer's weights)."""
    cp: int = 1
    """Context-parallel size (ranks that each hold 1/cp of every sequence's tokens)."""
    cp_comm_type: str = "all_gather"
    """How cp ranks' attention meets every key (Megatron's ``cp_comm_type``): 'all_gather',
    'p2p' (ring attention), 'a2a' (DeepSpeed-Ulysses: sequence parts traded for heads) or
    'a2a+p2p' (a2a within runs of ``cp_a2a_size`` ranks, the ring across); docs/long-context.md."""
    cp_a2a_size: int | None = None
    """The all-to-all size of cp_comm_type='a2a+p2p' (Megatron's
    ``hierarchical_context_parallel_sizes[0]``): must divide cp."""
    pp: int = 1
    """Pipeline-parallel size (ranks that each hold a run of layers)."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline rank (interleaved, zbv or dualpipev when > 1)."""
    dp: int | None = None
    """Data-parallel size (replicas that each see a slice of the global batch); None =
    world size // (tp * cp * pp), fixed by ``resolve`` when the ranks exist."""
    schedule: str = "auto"
    """'auto', 'none' (pp=1), 'gpipe', '1f1b', 'interleaved' (vpp > 1), or zero bubble:
    'zbh1' (vpp=1), 'zbv' or 'dualpipev' (vpp=2, chunks placed in a V)."""
    max_pending_w: int | None = None
    """Under a zero-bubble schedule, the most micro-batches a pipeline rank holds between
    their I and their W; beyond, a backward runs whole (``schedules.cap_pending``): less
    memory, a longer bubble. None: as many as the schedule defers."""
    split_points: tuple[str, ...] | None = None
    """Pinned chunk starts, e.g. ('layers.2',): pp*vpp - 1 block names; None = balanced."""
    sequence_parallel: bool = False
    """Split the residual stream, norms and dropout along the sequence over tp ranks."""
    tp_plan: tuple[tuple[str, str], ...] = ()
    """Module-FQN glob -> colwise | rowwise | replicate | vocab, overriding the automatic plan."""
    ep: int = 1
    """Expert-parallel size: each layer's routed experts split over ep ranks carved out of
    the dp * cp ranks (must divide dp * cp and every layer's number of experts)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size of the routed experts (Megatron's ``--expert-tensor-parallel-size``):
    None means tp (each expert's MLP split over the tp ranks as a dense MLP is); 1 keeps every
    expert whole on every tp rank. Only 1 and tp are supported."""

    SIZES: ClassVar[dict[str, Size]] = {
        "tp": Size(1, "tensor-parallel size"),
        "cp": Size(1, "context-parallel size"),
        "cp_a2a_size": Size(2, "all-to-all size of cp_comm_type='a2a+p2p'", "not a2a+p2p"),
        "pp": Size(1, "pipeline-parallel size"),
        "vpp": Size(1, "virtual pipeline size (chunks per pipeline rank)"),
        "dp": Size(1, "data-parallel size", "world size // (tp * cp * pp)"),
        "ep": Size(1, "expert-parallel size (ranks that split each layer's experts)"),
        "expert_tensor_parallel_size": Size(
            1, "tensor-parallel size of the routed experts (1 or tp)", "tp"
        ),
        "max_pending_w": Size(0, "most split backwards waiting for their W",
                              "as many as the schedule defers"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if isinstance(self.tp_plan, dict):
            object.__setattr__(self, "tp_plan", tuple(self.tp_plan.items()))
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel=True needs tp > 1")
        # fxmeg/schedule_registry.py
        refusal = layout_refusal(self.schedule, pp=self.pp, vpp=self.vpp)
        if refusal:
            raise ConfigError(refusal)
        if self.max_pending_w is not None and not self.splits_backward:
            raise ConfigError(
                f"max_pending_w={self.max_pending_w} caps the weight gradients a zero-bubble "
                f"schedule defers, and schedule={self.resolved_schedule!r} defers none: use "
                "schedule='zbh1', 'zbv' or 'dualpipev', or drop max_pending_w")
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))
        self._check_cp_comm()
        if self.dp is not None:
            self._check_ep()
        if self.expert_tensor_parallel_size not in (None, 1, self.tp):
            raise ConfigError(
                f"expert_tensor_parallel_size={self.expert_tensor_parallel_size!r} with "
                f"tp={self.tp}: fxmeg splits the experts over all tp ranks or none; use "
                f"expert_tensor_parallel_size={self.tp} (the default) or 1 (experts whole on every "
                "tp rank)"
            )

    def _check_cp_comm(self) -> None:
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ConfigError(
                f"cp_comm_type={self.cp_comm_type!r} is not one of {list(CP_COMM_TYPES)} "
                "(Megatron's names; docs/long-context.md)"
                + closest(str(self.cp_comm_type).lower(), CP_COMM_TYPES))
        a2a = self.cp_a2a_size
        if self.cp_comm_type != "a2a+p2p":
            if a2a is not None:
                raise ConfigError(
                    f"cp_a2a_size={a2a} is the all-to-all size of cp_comm_type='a2a+p2p', not of "
                    f"{self.cp_comm_type!r}: drop it or set cp_comm_type='a2a+p2p'")
            return
        fits = [d for d in range(2, self.cp) if self.cp % d == 0]
        if a2a is None:
            given = " is not given"
        elif self.cp % a2a:
            given = f"={a2a} does not divide cp={self.cp}"
        elif a2a == self.cp:
            given = f"={a2a} leaves no ring (that is cp_comm_type='a2a')"
        else:
            return
        raise ConfigError(
            f"cp_comm_type='a2a+p2p' needs cp_a2a_size, the all-to-all size inside each ring "
            f"step, a divisor of cp below it; cp_a2a_size{given}: "
            + (f"use one of {fits}" if fits else
               f"cp={self.cp} has none: use cp_comm_type='a2a' or 'p2p', or a cp such as 4"))

    @property
    def cp_inner(self) -> int:
        """The cp ranks whose heads are exchanged by all-to-all (1: none, cp: all)."""
        return {"a2a": self.cp, "a2a+p2p": self.cp_a2a_size or 1}.get(self.cp_comm_type, 1)

    @property
    def expert_tp(self) -> int:
        """The routed experts' tensor-parallel size (``expert_tensor_parallel_size``)."""
        size = self.expert_tensor_parallel_size
        return self.tp if size is None else size

    def _check_ep(self) -> None:
        """ep folds over dp * cp: it must divide it (needs dp resolved)."""
        if self.dp_cp % self.ep:
            names = "dp * cp" if self.cp > 1 else "dp"
            sizes = f"{self.dp} * {self.cp} = {self.dp_cp}" if self.cp > 1 else f"{self.dp}"
            raise ConfigError(
                f"ep={self.ep} does not divide {names} = {sizes}: experts are split over ep ranks "
                f"carved out of the data-parallel{' x context-parallel' if self.cp > 1 else ''} "
                "ranks; choose ep among "
                f"{[d for d in range(1, self.dp_cp + 1) if self.dp_cp % d == 0]} or launch more "
                f"ranks (`fxmeg train --dp` / --nproc, torchrun --nproc-per-node): ep={self.ep} "
                f"needs dp * cp to be a multiple of {self.ep}"
            )

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: ranks holding the same experts, (dp * cp) / ep."""
        return self.dp_cp // self.ep
    @property
    def model_ranks(self) -> int:
        """Ranks that share one slice of the global batch: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks over which gradients are reduced and the distributed optimizer shards:
        dp * cp (Megatron's data-parallel group with context parallel); needs dp resolved."""
        assert self.dp is not None, "dp is not resolved"
        return self.dp * self.cp

    def resolve(self, world: int) -> ParallelConfig:
        """This layout on ``world`` ranks: dp=None becomes world // (tp * cp * pp); a given
        dp must make tp * cp * pp * dp = world."""
        tp, cp, pp, dp = self.tp, self.cp, self.pp, self.dp
        # the messages name cp only where it is set
        names, sizes = (
            ("tp * cp * pp", f"{tp} * {cp} * {pp}") if cp > 1 else ("tp * pp", f"{tp} * {pp}")
        )
        if dp is None:
            if world % (tp * cp * pp):
                raise ConfigError(
                    f"world size {world} is not divisible by {names} = {sizes}; launch a multiple "
                    f"of {tp * cp * pp} ranks or change {names.replace(' * ', ' / ')}"
                )
            return dataclasses.replace(self, dp=world // (tp * cp * pp))
        if tp * cp * pp * dp != world:
            raise ConfigError(
                f"{names} * dp = {sizes} * {dp} = {tp * cp * pp * dp} does not match the world "
                f"size {world}; launch {tp * cp * pp * dp} ranks or leave dp=None"
            )
        return self

    @property
    def num_chunks(self) -> int:
        """Pipeline chunks in the model: pp * vpp."""
        return self.pp * self.vpp

    @property
    def spec(self) -> Spec:
        """The resolved schedule's row of ``fxmeg.schedule_registry.SPECS``."""
        return SPECS[self.resolved_schedule]

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs backward as separate I and W actions."""
        return self.spec.splits_backward

    @property
    def resolved_schedule(self) -> str:
        """The schedule 'auto' stands for: interleaved if vpp > 1, else 1f1b, else none
        (``fxmeg.schedule_registry.resolve``)."""
        return resolve(self.schedule, pp=self.pp, vpp=self.vpp)

    @property
    def placement(self) -> tuple[int, ...]:
        """The pipeline rank of each chunk under the resolved schedule (``placement``)."""
        return placement(self.resolved_schedule, pp=self.pp, vpp=self.vpp)


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``fxmeg.parallelize`` needs besides the model and the optimizer: the batch,
    precision and compilation, and one section per concern (``fxmeg.config_sections``),
    each checking its own fields; the rules that join sections are checked here. Build one
    from flat names (the flags', config-file keys', ``parallelize``'s keywords) with
    ``from_flat``; change flat names with ``replace``."""

    micro_batch_size: int
    """Samples in one micro-batch on one rank (the example inputs' batch dimension)."""
    global_batch_size: int
    """Samples in one optimizer step over all data-parallel ranks."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and pipeline schedule."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """How pipeline stages exchange activations."""
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    """Gradient reduction, ZeRO and the distributed optimizer."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts options."""
    recomputation: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recompute."""
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    """Non-finite gradients, loss spikes, communication timeouts."""
    clip_grad: float = 1.0
    """Clip the global L2 gradient norm to this value; 0 disables clipping."""
    precision: str = "fp32"
    """Parameter and compute precision: fp32, bf16 or fp16 (fp32 masters and gradients)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 loss scaling (ignored for fp32 / bf16)."""
    lr_schedule: LRSchedule | None = None
    """Learning-rate / weight-decay schedule in samples; None keeps the optimizer's lr."""
    compile: bool = False
    """Run each chunk graph through torch.compile (inductor)."""
    variable_seq_lengths: bool = False
    """Batches may differ from the example in their non-batch dimensions (the sequence
    length, per global batch, as with dynamic padding): each new shape is captured and
    transformed once, on shapes alone, with the example's pipeline cut, and its chunks
    share this rank's parameters (Megatron's ``--variable-seq-lengths``;
    fxmeg/frontend/variable_shapes.py). Off: a batch must have the example's shape."""

    SIZES: ClassVar[dict[str, Size]] = {
        "micro_batch_size": Size(1, "micro-batch size (samples on one rank)"),
        "global_batch_size": Size(1, "global batch size (samples per optimizer step)"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        self._check_batch()
        if self.clip_grad < 0:
            raise ConfigError(f"clip_grad must be >= 0 (0 disables), got {self.clip_grad}")
        if self.precision not in DTYPES:
            raise ConfigError(
                f"precision={self.precision!r} is not one of {tuple(DTYPES)}"
                + closest(self.precision, DTYPES)
            )
        check_zero3_companions(self)
        self._check_experts()
        self.moe.check_with(self.parallel, compile=self.compile)

    @classmethod
    def from_flat(cls, **values) -> EngineConfig:
        """An EngineConfig from flat names (``flat_names``: micro_batch_size and
        global_batch_size, which have no default, and any option); an unknown name is
        refused with the nearest valid one."""
        parts = split_flat(values)
        return cls(
            **parts.pop(""), **{name: SECTIONS[name](**part) for name, part in parts.items()}
        )

    def replace(self, **values) -> EngineConfig:
        """This config with some flat names (as ``from_flat`` takes them) changed; every
        rule is checked once more on the result."""
        parts = split_flat(values)
        sections = {
            name: dataclasses.replace(getattr(self, name), **part)
            for name, part in parts.items()
            if name and part
        }
        return dataclasses.replace(self, **parts[""], **sections)

    def flat(self) -> dict:
        """Flat name -> value of every name ``from_flat`` takes."""
        return {name: getattr(getattr(self, section) if section else self, name)
                for name, section in flat_names().items()}

    def _check_experts(self) -> None:
        """What expert parallelism (and the capacity factor) does not run with yet, refused
        with the reason."""
        ep, factor = self.parallel.ep, self.moe.moe_capacity_factor
        if factor is not None and ep == 1:
            raise ConfigError(
                f"moe_capacity_factor={factor} needs ep > 1: at ep=1 fxmeg runs the model's own "
                "experts, dropless; set ep >= 2 or leave moe_capacity_factor=None"
            )
        if ep == 1:
            return
        dp = self.data_parallel
        if (
            dp.optimizer_sharding == "layerwise"
            or dp.decided_sharding is OptimizerSharding.LAYERWISE
        ):
            raise ConfigError(
                f"ep={ep} does not run with optimizer_sharding='layerwise' yet: experts are "
                "sharded over the expert-data-parallel ranks only (layer-wise sharding is asked "
                "for, or chosen for an optimizer that steps whole parameters, such as Muon); use "
                "optimizer_sharding='elementwise'"
            )

    def _check_batch(self) -> None:
        """global_batch_size against micro_batch_size * dp and the micro-batch count
        against the schedule's rule (``fxmeg.schedule_registry.batch_refusal``: interleaved,
        dualpipev); with dp still None only against micro_batch_size (the rest when
        ``resolve`` fixes dp)."""
        dp = self.parallel.dp
        per_step = self.micro_batch_size * (dp or 1)
        if self.global_batch_size % per_step:
            what = "micro_batch_size"
            if dp is not None:
                what += f" * dp = {self.micro_batch_size} * {dp}"
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"{what} = {per_step}; choose a multiple of {per_step}, e.g. "
                f"{max(per_step, self.global_batch_size // per_step * per_step)}"
            )
        if dp is None:
            return
        origin = f" (global_batch_size={self.global_batch_size} / (micro_batch_size * dp))"
        refusal = batch_refusal(
            self.parallel.resolved_schedule,
            pp=self.parallel.pp,
            m=self.num_microbatches,
            origin=origin,
        )
        if refusal:
            raise ConfigError(refusal)

    def resolve(self, world: int) -> EngineConfig:
        """This configuration on ``world`` ranks: the layout resolved
        (``ParallelConfig.resolve``) and every batch rule checked with the real dp."""
        return dataclasses.replace(self, parallel=self.parallel.resolve(world))

    @property
    def _dp(self) -> int:
        """The data-parallel size; an error while it is still None (unresolved)."""
        if self.parallel.dp is None:
            raise ConfigError("dp is not resolved yet: call config.resolve(world_size) first "
                              "(dp=None means world size // (tp * pp))")
        return self.parallel.dp

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def resolved_bucket_size(self) -> int | None:
        """Bucket size in elements (``DataParallelConfig.resolved_bucket_size`` at this dp)."""
        return self.data_parallel.resolved_bucket_size(self._dp)

    @property
    def num_microbatches(self) -> int:
        """m = global_batch_size / (micro_batch_size * dp), micro-batches per rank per step."""
        return self.global_batch_size // (self.micro_batch_size * self._dp)


SECTIONS: dict[str, type] = {
    "pipeline": PipelineConfig, "data_parallel": DataParallelConfig, "moe": MoEConfig,
    "recomputation": RecomputeConfig, "guards": GuardsConfig, "parallel": ParallelConfig,
}
"""EngineConfig's sections: field name -> class, in the order of the flat names."""
INTERNAL = frozenset({"decided_sharding"})
"""Section fields that are not options (set by ``parallelize``): no flat name."""


def flat_names() -> dict[str, str]:
    """Flat name -> the EngineConfig section holding it ('' for EngineConfig's own field):
    the one map from flags, config-file keys and ``parallelize``'s keywords to the nested
    fields. Every field is one flat name, in order: EngineConfig's own, then each
    section's (``SECTIONS``)."""
    own = {f.name: "" for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS}
    return own | {f.name: section for section, cls in SECTIONS.items()
                  for f in dataclasses.fields(cls) if f.name not in INTERNAL}


def split_flat(values: Mapping, *, unknown: str = "unknown option {name!r}") -> dict[str, dict]:
    """``values`` by flat name -> {'' (EngineConfig's own) or a section: its values}, with
    every key present; a name that is none of ``flat_names`` is refused with the nearest
    (``unknown`` words the refusal)."""
    names = flat_names()
    parts: dict[str, dict] = {"": {}} | {section: {} for section in SECTIONS}
    for name, value in values.items():
        if name not in names:
            raise ConfigError(unknown.format(name=name) + closest(name, names))
        parts[names[name]][name] = value
    return parts


def _accept_flat_names(cls: type) -> None:
    """``EngineConfig(2, 8, zero=1)`` as before the sections (the public API): a keyword that
    is no field of ``cls`` is a flat name, put into its section (a section given too is
    the base it changes); an unknown one is refused with the nearest (``split_flat``)."""
    generated, fields = cls.__init__, {f.name for f in dataclasses.fields(cls)}

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs):
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k not in fields}
        for section, part in split_flat(flat).items():
            if section and part:
                kwargs[section] = dataclasses.replace(
                    kwargs.get(section) or SECTIONS[section](), **part
                )
        generated(self, *args, **kwargs)

    cls.__init__ = __init__


_accept_flat_names(EngineConfig)

_FLAG_TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "int | None": int,
    "float | None": float,
}


def scalar_fields(cls: type) -> dict[str, type]:
    """Name -> value type of the fields of dataclass ``cls`` that one flag or config-file
    key can set (int, float, str, bool, int | None, float | None), in declaration order."""
    return {f.name: _FLAG_TYPES[f.type] for f in dataclasses.fields(cls) if f.type in _FLAG_TYPES}


Example = tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]
"""One micro-batch: a tuple of tensors passed to ``forward`` positionally, or a dict of
tensors passed by keyword (a Hugging Face batch: input_ids, attention_mask, labels)."""


def example_tensors(example: Example) -> tuple[torch.Tensor, ...]:
    """The example's tensors in order (a dict's in its key order); refuses anything else."""
    if isinstance(example, Mapping):
        if example and all(
            isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in example.items()
        ):
            return tuple(example.values())
    elif (
        isinstance(example, tuple) and example and all(isinstance(t, torch.Tensor) for t in example)
    ):
        return example
    raise ConfigError(
        "example_inputs must be one micro-batch: a non-empty tuple of tensors (passed to forward "
        "positionally) or a dict of tensors by argument name (passed by keyword, e.g. "
        f"{{'input_ids': ..., 'attention_mask': ..., 'labels': ...}}); got {type(example).__name__}"
    )


def batch_dim(example: Example, micro_batch_size: int | None) -> int:
    example = example_tensors(example)
    rows = {t.shape[0] if t.dim() else None for t in example}
    if len(rows) != 1 or None in rows:
        raise ConfigError(
            f"every example input needs the same batch dimension; got shapes "
            f"{[tuple(t.shape) for t in example]}"
        )
    (b,) = rows
    if micro_batch_size is not None:
        check_size("micro_batch_size", micro_batch_size, EngineConfig.SIZES["micro_batch_size"])
    if micro_batch_size is not None and micro_batch_size != b:
        raise ConfigError(
            f"the example inputs' batch dimension is {b}, but micro_batch_size="
            f"{micro_batch_size}; pass one micro-batch of {micro_batch_size} samples as "
            "example_inputs"
        )
    return b


def make_config(
    example: Example,
    *,
    world: int | None,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    split_points=None,
    tp_plan: dict[str, str] | None = None,
    **options,
) -> EngineConfig:
    """The EngineConfig of ``parallelize(model, example, **options)``: every flat name
    (``flat_names``) as a keyword; an unknown name is refused with the nearest valid one.
    ``world`` (the launched world size) fixes dp when it is None; ``world=None`` (a
    transform without processes) takes dp=1 unless given."""
    parts = split_flat(options)
    parallel = ParallelConfig(
        tp=tp, pp=pp, dp=1 if world is None and dp is None else dp,
        split_points=tuple(split_points) if split_points is not None else None,
        tp_plan=tuple((tp_plan or {}).items()),
        **parts.pop("parallel"),
    )
    parallel = parallel.resolve(world) if world is not None else parallel
    mbs = batch_dim(example, micro_batch_size)
    return EngineConfig(
        micro_batch_size=mbs,
        global_batch_size=mbs * parallel.dp if global_batch_size is None else global_batch_size,
        parallel=parallel,
        **parts.pop(""),
        **{name: SECTIONS[name](**part) for name, part in parts.items()},
    )


def cast_inputs(batch: Example, dtype: torch.dtype) -> Example:
    """Floating inputs in the training dtype (``EngineConfig.dtype``); token ids and masks
    as they are. A dict stays a dict."""
    if isinstance(batch, Mapping):
        return dict(zip(batch, cast_inputs(tuple(batch.values()), dtype)))
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in batch)
