"""Hugging Face causal LMs in the trainer: building one from ``--model transformers:Class``
and ``--model-args``, and the keyword batches it is fed.

Targets. A sample is a window of seq_len + 1 tokens; the trainer's (input_ids, labels) are
that window shifted by one, so labels[t] is the token after input_ids[t]. A Hugging Face
causal LM shifts ``labels`` itself (position t is scored against labels[t + 1]): given
those labels it would learn to predict the token two ahead. The causal-LM loss of
transformers 5.x takes ``shift_labels``, targets already shifted, and then reads
``labels`` only to decide that a loss is wanted. So a batch is

    {"input_ids": x, "attention_mask": ones, "labels": x, "shift_labels": y}

and every position t is scored against y[t], the token after it: the seq_len targets of
the window, exactly what a model taking (input_ids, labels) learns. ``labels = input_ids``
is Hugging Face's own convention, so a model whose loss ignores ``shift_labels`` (see
``takes_shift_labels``) still learns the next token; it only leaves the window's last
target unused (seq_len - 1 targets per row). The mask is all ones: windows are cut from
a token stream and hold no padding (padded dict batches work through the Python API).
Megatron's mask switches change three keys (``keyword_batch``): ``shift_labels`` is -100
where the loss mask is 0, ``position_ids`` restart after each end-of-document, and
``attention_mask`` becomes the 4-D block-causal mask of the documents in the window.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import warnings
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from fxmeg.errors import ConfigError, closest

log = logging.getLogger("fxmeg.frontend.capture")
ATTENTION = ("sdpa", "eager")
"""The attention implementations whose graphs fxmeg captures and splits
(tests/frontend/test_hugging_face.py)."""
EXPORTABLE_EXPERTS = ("grouped_mm", "batched_mm")
"""The experts implementations fxmeg captures an "eager" mixture of experts with, in order of
preference: grouped_mm is transformers' own default (each expert multiplies its tokens, as
eager does); batched_mm gathers a copy of the expert weights per routed token (memory), so
it is the fallback for a model that refuses grouped_mm."""


def is_hugging_face(obj) -> bool:
    """Whether ``obj`` (a class or a module) is a transformers ``PreTrainedModel``; False
    without importing transformers when nothing imported it yet."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    cls = obj if isinstance(obj, type) else type(obj)
    return issubclass(cls, transformers.PreTrainedModel)


def build(cls: type, args: dict) -> nn.Module:
    """A ``cls`` (a transformers PreTrainedModel class) with random weights, from
    ``cls.config_class(**args)``.

    Requires: ``args`` holds config fields, plus the trainer's ``seq_len`` and optionally
    ``attn_implementation`` (one of ATTENTION, default "sdpa").
    Ensures: ``max_position_embeddings`` (under the config's own name, e.g. GPT-2's
    n_positions) is seq_len unless args set it, and at least seq_len; ``use_cache`` is
    False unless args set it (training keeps no key/value cache); an unknown field or
    one the config rejects is a ConfigError naming it. Nothing is downloaded."""
    config_cls = cls.config_class
    args = dict(args)
    seq_len = args.pop("seq_len", None)
    attention = args.pop("attn_implementation", "sdpa")
    if attention not in ATTENTION:
        raise ConfigError(
            f"--model-args attn_implementation={attention!r} for {cls.__name__}: fxmeg captures "
            f"{' and '.join(map(repr, ATTENTION))} attention; choose one of them"
        )
    names = config_fields(config_cls)
    for key in args:
        if key not in names:
            raise ConfigError(
                f"--model-args {key!r} is not a field of {config_cls.__name__} (the config of "
                f"{cls.__name__})" + closest(key, names)
            )
    positions = config_cls.attribute_map.get("max_position_embeddings", "max_position_embeddings")
    if (
        seq_len is not None
        and positions in names
        and not {"max_position_embeddings", positions} & set(args)
    ):
        args[positions] = seq_len
    if "use_cache" in names:
        args.setdefault("use_cache", False)
    try:
        config = config_cls(**args)
    except _config_errors() as exc:
        raise ConfigError(
            f"--model-args rejected by {config_cls.__name__} (the config of {cls.__name__}): "
            f"{' '.join(str(exc).split())}"
        ) from None
    table = getattr(config, "max_position_embeddings", None)
    if seq_len is not None and table is not None and table < seq_len:
        raise ConfigError(
            f"--seq-len {seq_len} is longer than {cls.__name__}'s position table "
            f"({positions}={table} in --model-args): raise {positions} or lower --seq-len"
        )
    return cls._from_config(config, attn_implementation=attention)


def config_fields(config_cls: type) -> list[str]:
    """The names ``config_cls(**kwargs)`` knows: its parameters and their aliases
    (``attribute_map``, e.g. GPT-2's hidden_size for n_embd)."""
    params = inspect.signature(config_cls).parameters.values()
    own = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return own + [a for a in config_cls.attribute_map if a not in own]


def _config_errors() -> tuple[type[Exception], ...]:
    """What a transformers config raises for a value it rejects: TypeError / ValueError,
    or (5.x configs are huggingface_hub strict dataclasses) a StrictDataclassError."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (TypeError, ValueError)
    return (TypeError, ValueError, StrictDataclassError)


def keyword_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    attend: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The keyword batch of a window batch (the module docstring says why these keys).

    Requires: ``labels`` is ``input_ids`` shifted by one, -100 where no loss counts
    (fxmeg.data.megatron.TrainData.fields), both (rows, seq_len) int64 and contiguous;
    ``position_ids`` the same shape; ``attend`` (rows, seq_len, seq_len) bool, True where a
    query may attend to a key, or (rows, seq_len) a padding mask (1: a token, 0: padding).
    Ensures: passed to a Hugging Face causal LM by keyword, position t is scored against
    labels[t]; with ``position_ids`` the model's positions are those; with ``attend`` its
    attention mask is that padding mask, or that 4-D mask (transformers uses a 4-D mask as given: it
    is the whole mask, causality included)."""
    mask = (
        torch.ones_like(input_ids)
        if attend is None
        else attend
        if attend.dim() == 2
        else attend[:, None]
    )
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": input_ids,
        "shift_labels": labels,
    }
    return batch if position_ids is None else batch | {"position_ids": position_ids}


def takes_shift_labels(model: nn.Module) -> bool:
    """Whether the model's loss reads ``shift_labels`` (transformers 5.x causal-LM loss);
    if not, its last target per row goes unused (module docstring)."""
    loss = getattr(model, "loss_function", None)
    return loss is not None and "shift_labels" in inspect.signature(loss).parameters


def warn_shifted_labels(model: nn.Module, example, *, loss_fn=None) -> None:
    """Warn (UserWarning) when a Hugging Face causal LM is given labels already shifted.

    Requires: ``example`` is the example micro-batch, (input_ids, labels, ...) or a dict.
    Ensures: a warning naming the rule when ``model`` is a transformers causal LM (its loss
    shifts ``labels`` itself: ``loss_type`` "ForCausalLM"), no ``loss_fn`` replaces that loss,
    no ``shift_labels`` is given, and on every row the labels are the input ids shifted by
    one (labels[:, :-1] == input_ids[:, 1:] wherever labels are not -100) but not the ids
    themselves: such a model would learn the token two ahead. Silent on meta tensors (no
    values: ``fxmeg.plan``) and on anything else."""
    if loss_fn is not None or not is_hugging_face(model) or not _shifts_labels(model):
        return
    if isinstance(example, Mapping):
        if "shift_labels" in example:
            return
        ids, labels = example.get("input_ids"), example.get("labels")
    else:
        ids, labels = (*example, None, None)[:2] if isinstance(example, tuple) else (None, None)
    if (
        not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor))
        or ids.is_meta
        or labels.is_meta
    ):
        return
    if ids.shape != labels.shape or ids.dim() != 2 or ids.shape[1] < 2:
        return
    if _matches(labels[:, :-1], ids[:, 1:]) and not _matches(labels, ids):
        warnings.warn(
            f"{type(model).__name__} got labels equal to its input_ids shifted by one (labels[:, "
            ":-1] == input_ids[:, 1:] on every row of the example), so it would learn the token "
            "two ahead: Hugging Face causal LMs shift labels themselves: pass labels=input_ids "
            "(-100 where no loss counts), or targets already shifted as shift_labels; see "
            "docs/hugging-face.md",
            UserWarning,
            stacklevel=3,
        )


def _shifts_labels(model: nn.Module) -> bool:
    """Whether the model's own loss shifts ``labels`` (transformers' causal-LM loss)."""
    return getattr(model, "loss_type", None) == "ForCausalLM" or type(model).__name__.endswith(
        "ForCausalLM"
    )


def _matches(labels: torch.Tensor, ids: torch.Tensor) -> bool:
    """Every row has a label that counts (not -100), and every such label equals the id."""
    counted = labels != -100
    return bool(counted.any(dim=1).all()) and bool((labels == ids)[counted].all())


@contextlib.contextmanager
def exportable_experts(model: nn.Module, *, grouped: bool = False) -> Iterator[None]:
    """While the body runs (fxmeg's capture), every Hugging Face model inside ``model``
    whose experts run "eager" runs them with the first of EXPORTABLE_EXPERTS it accepts,
    and says so (INFO on ``fxmeg.frontend.capture``, naming the class and both implementations).
    With ``grouped`` (expert or context parallelism, which find experts as grouped
    matmuls: fxmeg/passes/expert_parallel.py) "batched_mm" experts run "grouped_mm" too.

    Requires: nothing of the user; a model whose experts implementation transformers
    cannot set (dense models report "eager" too) is left alone.
    Ensures: the captured graph computes the values eager computes (the same per-expert
    products: on tiny Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and GPT-OSS the loss is equal
    and every gradient within 1e-6 relative); afterwards each model's implementation is
    what it was, so the user's model runs as it came. Why: "eager" loops over the experts
    that received tokens, a data-dependent loop torch.export cannot trace."""
    switched: list[tuple[nn.Module, dict]] = []
    try:
        for module in model.modules():
            before = _experts_implementation(module)
            replaced = ("eager", "batched_mm") if grouped else ("eager",)
            if before is None or not set(replaced) & set(before.values()):
                continue
            chosen = _switch_experts(
                module, before, replaced, EXPORTABLE_EXPERTS[:1] if grouped else EXPORTABLE_EXPERTS
            )
            switched.append((module, before))
            was = next(v for v in before.values() if v in replaced)
            why = (
                "expert and context parallelism take experts grouped by expert"
                if was == "batched_mm"
                else "the eager loop over routed experts cannot be exported"
            )
            log.info(
                "%s runs its experts with experts_implementation=%r, not %r, while fxmeg captures "
                "it (%s; the values are the same)",
                type(module).__name__,
                chosen,
                was,
                why,
            )
        yield
    finally:
        for module, before in reversed(switched):
            module.set_experts_implementation(before)


def _experts_implementation(module: nn.Module) -> dict | None:
    """The experts implementation of a Hugging Face model whose experts can be switched
    (per sub-config, as ``get_experts_implementation`` reports it), else None."""
    if not is_hugging_face(module):
        return None
    can_set = getattr(module, "_can_set_experts_implementation", None)
    if can_set is None or not hasattr(module, "set_experts_implementation") or not can_set():
        return None
    return module.get_experts_implementation()


def _switch_experts(
    module: nn.Module, before: dict, replaced: tuple[str, ...], choices: tuple[str, ...]
) -> str:
    """Run ``module``'s experts of an implementation in ``replaced`` with the first of
    ``choices`` it accepts."""
    for chosen in choices:
        try:
            module.set_experts_implementation(
                {k: chosen if v in replaced else v for k, v in before.items()}
            )
            return chosen
        except (ValueError, ImportError, KeyError):
            continue
    return "eager"  # none accepted: export (or the expert-parallel pass) says what fails


def config_from_spec(spec: list[str]):
    """A transformers config from ``[NAME_OR_JSON, KEY=VALUE, ...]``: a config.json file
    (its ``model_type`` picks the class), a config class name (``LlamaConfig``) or a
    model type (``llama``); each override's value is read as JSON, else kept as text.
    Nothing is downloaded."""
    import json
    import os

    import transformers

    source, *pairs = spec
    overrides = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ConfigError(
                f"--hf-config override {pair!r} is not KEY=VALUE (e.g. num_hidden_layers=80)"
            )
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text
    if source.endswith(".json") or os.path.isfile(source):
        with open(source) as f:
            values = json.load(f)
        if "model_type" not in values:
            raise ConfigError(
                f"{source} has no 'model_type' (e.g. \"llama\"): it names the transformers config"
            )
        return transformers.AutoConfig.for_model(values.pop("model_type"), **(values | overrides))
    cls = getattr(transformers, source, None)
    if isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig):
        return cls(**overrides)
    try:
        return transformers.AutoConfig.for_model(source, **overrides)
    except ValueError:
        raise ConfigError(
            f"--hf-config {source!r} is neither a JSON file, a transformers config class "
            "(LlamaConfig) nor a model type (llama)"
        ) from None
