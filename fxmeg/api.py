"""The front door: ``parallelize`` and the ``Engine`` it returns (docs/architecture.md §1).

``parallelize`` = configuration (``fxmeg.config.make_config``) -> passes
(``fxmeg.transform``: the rank-free Program) -> this rank's runtime
(``fxmeg.runtime.context.build_context``). The Engine is a thin handle on the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fxmeg.config import EngineConfig, Example, batch_dim, example_tensors, make_config
from fxmeg.errors import CheckpointError, ConfigError
from fxmeg.frontend.capture import LossFn
from fxmeg.frontend.pass_driver import transform
from fxmeg.frontend.variable_shapes import Shapes, collect, meta_twin
from fxmeg.interop.hf_export import hugging_face_info
from fxmeg.ir.program import Partition, Program
from fxmeg.runtime import step
from fxmeg.runtime.batches import UserBatch, needs_data
from fxmeg.runtime.context import RankContext, build_context
from fxmeg.runtime.optimizer.optimizer import (
    OptimizerFactory,
    default_optimizer,
    param_groups,
    plan_optimizers,
)
from fxmeg.runtime.release import Released
from fxmeg.runtime.state import gather_full_state
from fxmeg.runtime.step import EvalResult, StepResult
from fxmeg.runtime.verify import ParamError, VerifyResult
from fxmeg.runtime.verify import verify as verify_program
from fxmeg.weights.checkpoint import Checkpointer, find_complete
from fxmeg.weights.meta_init import InitFn, value_source

__all__ = [
    "Engine",
    "EvalResult",
    "ParamError",
    "Saving",
    "StepResult",
    "VerifyResult",
    "parallelize",
]


def parallelize(
    model: nn.Module,
    example_inputs: Example,
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    config: EngineConfig | None = None,
    weights=None,
    init_fn: InitFn | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    **options,
) -> Engine:
    """Capture ``model`` on one example micro-batch and return an engine that trains it
    with Megatron-LM's semantics on this process's rank.

    ``example_inputs`` is one micro-batch, e.g. ``(input_ids, labels)``; the model returns
    its mean loss (or pass ``loss_fn(model, *batch) -> (loss_sum, num_tokens)``). A dict
    (``{"input_ids": .., "attention_mask": .., "labels": ..}``, a Hugging Face batch) is
    passed by keyword: ``model(**batch)`` (Hugging Face: ``model(**batch,
    use_cache=False).loss``; ``loss_fn(model, **batch)``), and every batch is then a dict
    with the same keys.
    ``optimizer`` is a factory receiving parameter groups (see
    ``fxmeg.runtime.optimizer.optimizer.param_groups``) and returning an optimizer, or several over
    disjoint parameters (``fxmeg.runtime.optimizer.optimizer.muon_adamw``); default AdamW.
    ``options`` are the fields of ``ParallelConfig`` (tp, pp, vpp, dp, schedule, split_points,
    sequence_parallel, tp_plan) and ``EngineConfig`` (micro_batch_size, global_batch_size,
    precision, clip_grad, distributed_optimizer, optimizer_sharding, ...), checked before any
    process-group work. Or pass a whole ``config`` (an EngineConfig) instead of options: it is
    resolved against the world size (``EngineConfig.resolve``: dp=None becomes world // (tp * pp))
    and used as is.

    With ``precision`` "bf16" or "fp16" the model's parameters and floating buffers are
    cast in place (as Megatron's Float16Module), so pass the model in fp32: the fp32
    masters start from those values.

    A model too large for one rank is built under ``with torch.device("meta"):``; each
    rank then makes only the tensors it holds, read from ``weights`` (a state_dict, a
    ``torch.save`` file, a Hugging Face safetensors file or directory, an fxmeg
    checkpoint: only this rank's slices are read) or initialised module by module by
    ``init_fn(module)`` (default ``reset_parameters()``; Hugging Face: its
    ``_init_weights``) under generators seeded from ``(seed, module name)``, so that the
    values do not depend on the layout (``fxmeg.materialize`` makes the same model on one
    device). ``device`` is where a meta model computes (default: the example's device,
    else the current accelerator, else the CPU).

    Ranks that must hold the same values (data-parallel replicas, tensor-parallel peers,
    the holders of a tied weight) are checked to do so, by parameter hashes: a rank that
    initialised differently raises ``ReplicaError`` on every rank, or, with
    ``broadcast_params=True``, receives the first replica's values.

    After this call the user's module holds only what this rank trains: every other
    parameter (another pipeline stage's, or the full tensor of a tensor-parallel shard)
    is a meta tensor. Read the whole model with ``Engine.full_state_dict()``.
    """
    factory = optimizer or default_optimizer
    config = _configure(example_inputs, config, options)
    config = _decide_sharding(
        config, factory, model, _stand_in_device(model, example_inputs, device)
    )
    # before transform casts the model
    twin = meta_twin(model) if config.variable_seq_lengths else None
    hf = hugging_face_info(model)
    program = transform(model, example_inputs, config, loss_fn=loss_fn, device=device)
    # checked here, before any collective
    source = value_source(model, program, weights=weights, init_fn=init_fn, seed=seed)
    context = build_context(program, optimizer=factory, source=source, model=model)
    engine = Engine(
        program,
        context,
        Shapes.start(twin, loss_fn, program, context) if twin is not None else None,
    )
    engine.hugging_face = hf
    return engine


def _configure(example_inputs: Example, config: EngineConfig | None, options: dict) -> EngineConfig:
    """The configuration on this world: made from ``options``, or ``config`` resolved
    (``EngineConfig.resolve``) and checked against the example; not both."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if config is None:
        return make_config(example_inputs, world=world, **options)
    if options:
        raise ConfigError(f"pass either config= or options, not both; got config and "
                          f"{sorted(options)}: set them in the EngineConfig (dataclasses.replace)")
    batch_dim(example_inputs, config.micro_batch_size)
    return config.resolve(world)


def _decide_sharding(config: EngineConfig, factory: OptimizerFactory, model: nn.Module,
                     device: torch.device) -> EngineConfig:
    """``config`` with the optimizer sharding decided, once, from what ``factory`` builds
    for this model's parameters (``OptimizerPlan.sharding``) and recorded
    (``decided_sharding``): before the passes, since the buckets pass pads the gradient
    buffers for elementwise shards, and before any process group, so that a request the
    optimizer cannot meet is refused on every rank at once."""
    plan = plan_optimizers(factory, param_groups(model.named_parameters()), device)
    dp = config.data_parallel
    decided = plan.sharding(dp.distributed_optimizer, dp.optimizer_sharding,
                            overlap_param_gather=dp.overlap_param_gather, zero=dp.zero_stage)
    return dataclasses.replace(
        config, data_parallel=dataclasses.replace(dp, decided_sharding=decided)
    )


def _stand_in_device(
    model: nn.Module, example_inputs: Example, device: torch.device | str | None
) -> torch.device:
    """Where ``_decide_sharding``'s parameter stand-ins live (they hold no memory): where
    the optimizers will step, as far as it is known before capture (the model's device,
    else ``device``, else the example's, else the CPU), so that a factory that asks for a
    device's kernels (``fused=True``) accepts them."""
    real = next((p.device for p in model.parameters() if not p.is_meta), None)
    if real is None and device is not None:
        real = torch.device(device)
    return real or next(
        (t.device for t in example_tensors(example_inputs) if not t.is_meta), torch.device("cpu")
    )


class Engine:
    """Trains this rank's part of a Program. Built by ``parallelize``.

    Public surface: ``train_step``, ``eval_step``, ``verify``, ``full_state_dict``,
    ``params_norm``, ``save``, ``load``, ``set_global_batch_size``; ``config``,
    ``named_parameters``, ``partition``, ``needs_data``, ``model_flops_per_step``; and ``program``
    (the rank-free Program) and ``context`` (this rank's RankContext) for tools that need more."""

    def __init__(
        self, program: Program, context: RankContext, shapes: Shapes | None = None
    ) -> None:
        self.program, self.context = program, context
        self.shapes = shapes
        """With ``variable_seq_lengths``: the Program of every input shape seen so far."""
        self._current = program
        self.hugging_face: dict | None = None
        """A transformers model's config and tied names
        (``fxmeg.interop.hf_export.hugging_face_info``), recorded in checkpoints for ``fxmeg export
        --format hf``."""
        self._checkpointer: Checkpointer | None = None
        self._placeholders: dict[str, nn.Parameter] | None = None

    def _select(self, batch, m: int) -> tuple[Program, UserBatch | Iterator[UserBatch] | None]:
        """The Program for ``batch``'s shape (compiled on first sight; collective over the
        pipeline stages), and the batch to pass on (an iterator's micro-batches, read)."""
        if self.shapes is None:
            return self.program, batch
        batch = collect(batch, m)
        self._current = self.shapes.select(batch, self.context)
        return self._current, iter(batch) if isinstance(batch, list) else batch

    @property
    def config(self) -> EngineConfig:
        """The configuration in force (global batch size included)."""
        return self.context.config

    @property
    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's trainable parameters (tensor-parallel shards), by the user's FQN. At
        zero=3 their memory is allocated only while a step uses them (docs/zero.md): there
        they are placeholders that give shapes and raise ``ReleasedError`` on a read of
        values (read ``full_state_dict()``)."""
        if self.config.data_parallel.zero_stage != 3:
            return self.context.named_parameters
        if self._placeholders is None:
            why = "zero=3 allocates its memory only while a step reads it (docs/zero.md)"
            self._placeholders = {
                n: Released(p, n, why) for n, p in self.context.named_parameters.items()
            }
        return self._placeholders

    @property
    def partition(self) -> Partition:
        """The pipeline cut: units per chunk and estimated costs."""
        return self.program.partition

    @property
    def needs_data(self) -> bool:
        """Whether this rank's chunks read inputs; middle pipeline stages may pass None."""
        return needs_data(self.program, self.context)

    @property
    def model_flops_per_step(self) -> float:
        """Model FLOPs of one step over all ranks: 3 x forward (backward ~ 2 x) for
        every micro-batch of every data-parallel replica (of the last step's input shape)."""
        cfg = self.config
        return 3.0 * self._current.flops_per_microbatch * cfg.num_microbatches * cfg.parallel.dp

    def train_step(
        self,
        batch: UserBatch | Iterator[UserBatch] | None,
        *,
        check_determinism: bool = False,
        trace: bool = False,
        full_grads: bool = False,
    ) -> StepResult:
        """One optimizer step on a global batch (tensors shaped [global_batch_size, ...],
        the same on every rank) or an iterator over this rank's micro-batches.

        ``check_determinism`` runs forward and backward twice on the batch (Megatron's
        rerun idea) and reports in ``rerun_mismatch`` whether loss or any reduced gradient
        differed; the step then uses the second run. ``trace`` records this step's
        timeline in ``context.tracer.events`` (see fxmeg.runtime.timelines). ``full_grads`` gathers
        every parameter's gradient whole into ``StepResult.grads``, before the optimizer
        clips and applies it (collective; for tests and debugging: it costs a gather of
        the model). With ``check_replicas_interval=N``, every N-th call first checks that
        replicas still hold the same parameters (``ReplicaError`` on every rank if not)."""
        program, batch = self._select(batch, self.config.num_microbatches)
        return step.train_step(
            program,
            self.context,
            batch,
            check_determinism=check_determinism,
            trace=trace,
            full_grads=full_grads,
        )

    def eval_step(self, batch: UserBatch | Iterator[UserBatch] | None, *,
                  num_microbatches: int | None = None) -> EvalResult:
        """Forward-only pass over a batch (any multiple of micro_batch_size * dp samples);
        token-weighted loss. Ranks that read no data pass None and num_microbatches."""
        program, batch = self._select(batch, num_microbatches or self.config.num_microbatches)
        return step.eval_step(program, self.context, batch, num_microbatches=num_microbatches)

    def verify(self, batch: UserBatch | None, *, loss_rtol: float | None = None,
               grad_rtol: float | None = None) -> VerifyResult:
        """Check this layout against single-device execution on one global batch: forward
        and backward of the parallel program (no optimizer step) and of the captured
        single-device graph (on rank 0, with the current full parameters); compare the
        loss and every parameter's reduced gradient, gathered whole. Returns a
        VerifyResult (``ok``, both losses, the first parameter in graph order beyond
        tolerance with its chunk, node and pass, the worst one, every error); identical on
        every rank. The engine's state is left as it was: parameters, optimizer state,
        loss scale and lr schedule untouched, gradient buffers zeroed, RNG states
        restored. Checks the example's input shape. Tolerances default by precision
        (fxmeg.runtime.verify.TOLERANCES). Collective: call it on every rank, with the global batch
        (a tuple, or a dict for a dict example) on rank 0 and on every rank whose chunks read data
        (others may pass None)."""
        if self.shapes is not None:  # on the example's shape (batches.check refuses another)
            self.shapes.use_example(self.context)
        return verify_program(
            self.program, self.context, batch, loss_rtol=loss_rtol, grad_rtol=grad_rtol
        )

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Train the next steps on global batches of this size (a batch-size schedule)."""
        self.context.set_global_batch_size(global_batch_size)

    def params_norm(self) -> float:
        """L2 norm of all parameters (each element once). Collective."""
        self.context.ddp.wait_for_params()
        return self.context.optimizer.global_norm("master")

    def full_state_dict(self) -> dict:
        """The user model's state_dict (every name, tied ones included) with this
        engine's current values, gathered on every rank. Collective: call it on every
        rank."""
        return gather_full_state(self.program, self.context)

    def save(
        self, directory: str, *, async_save: bool = False, state: dict | None = None
    ) -> Saving:
        """Checkpoint this engine into ``directory`` (``iter_<N>/``, N the train steps
        taken; ``latest`` names it once complete): parameters, optimizer state, lr
        schedule, loss scaler and RNG, as the trainer's ``--save`` writes them, so that
        ``load`` resumes it under any layout and ``fxmeg export`` reads it. ``state``: a
        picklable dict of the caller's own (an epoch, a data position), which ``load``
        returns. With ``async_save`` the files are written in the background while
        training goes on: wait on the returned ``Saving`` (the next ``save`` or ``load``
        waits too). Collective: call it on every rank."""
        checkpointer = self._checkpointer_for(async_save)
        path = checkpointer.save(directory, self.context.steps_taken, {"user": state or {}})
        return Saving(path, checkpointer.wait)

    def load(self, directory: str) -> dict:
        """Restore the newest complete checkpoint in ``directory`` (saved by ``save`` or
        by the trainer, at any layout): parameters, optimizer state, lr schedule, loss
        scaler, RNG, global batch size and the step count. Returns the ``state`` passed to
        ``save`` (empty for the trainer's). A directory with no checkpoint is a
        CheckpointError. Collective: call it on every rank."""
        if find_complete(directory) is None:  # before the checkpointer's process group
            raise CheckpointError(
                f"engine.load({directory!r}): no checkpoint there (no iter_* directory); "
                f"pass the directory engine.save or --save wrote"
            )
        checkpointer = self._checkpointer_for(False)
        restored = checkpointer.load(directory)
        self.context.steps_taken = restored["iteration"]
        return restored.get("user", {})

    def _checkpointer_for(self, async_save: bool) -> Checkpointer:
        """The engine's one Checkpointer (made on first use: it creates a process group),
        saving in the background or not as this call asks; a background save still
        running is waited for first."""
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(
                self.program, self.context, hugging_face=self.hugging_face
            )
        self._checkpointer.wait()
        self._checkpointer.async_save = async_save
        return self._checkpointer


@dataclasses.dataclass(frozen=True)
class Saving:
    """A checkpoint ``Engine.save`` wrote or is writing."""

    path: str
    """Its directory (``DIR/iter_<N>``)."""
    wait: Callable[[], None]
    """Block until it is complete on disk (at once for a synchronous save); re-raises a
    background save's error as CheckpointError."""
