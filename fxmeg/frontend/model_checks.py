"""What a layout asks of the model, checked from the model itself before capture.

Capture and the passes refuse a layout the model cannot take only where they meet it (a
view splitting 3 heads over tp=2 ranks, an experts block of 3 over ep=2), after a capture
that takes seconds to minutes on a large model. The numbers a model's config states are
checked here first, by ``fxmeg.frontend.pass_driver.transform`` (the one door of ``parallelize``,
``transform`` and ``plan``), with the same rules the passes apply:

  heads    tp divides the attention heads (a Hugging Face config's num_attention_heads,
           ``n_head`` of fxmeg's own models), unless the model has no attention module or
           ``tp_plan`` replicates something inside one (the user's plan decides; the
           pass says what fails). Key/value heads are not checked: tp not dividing them
           is allowed (fxmeg/passes/tp/heads.py replicates them), and context
           parallelism splits no heads.
  experts  ep divides the routed experts (num_local_experts, num_experts,
           n_routed_experts, moe_num_experts: the Hugging Face names).
  blocks   pp * vpp chunks need as many blocks: the partition pass cuts between the
           numbered children of the module list with the most of them
           (fxmeg/passes/partition.py). Counted here on the module tree, an upper bound of
           what the graph holds, so a model this refuses the partition pass refuses too.
           Nothing needs to divide: the cut is balanced by cost.

A model with no config fxmeg knows (any ``nn.Module``) is checked by the passes alone.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections import defaultdict

from torch import nn

from fxmeg.config import EngineConfig
from fxmeg.errors import ConfigError
from fxmeg.interop.hugging_face import is_hugging_face

HEADS = ("num_attention_heads", "n_head", "n_heads")
"""Config fields holding the attention heads (the first found is read)."""
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config fields holding the routed experts per layer (Hugging Face's names)."""
NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")
"""A module FQN inside a numbered child of a module list: ('model.layers', '3')."""


def check_model(model: nn.Module, config: EngineConfig) -> None:
    """Refuse, before capture, a layout the model's stated numbers cannot take.

    Requires: ``config`` resolved (tp, ep, pp, vpp known).
    Ensures: a ConfigError naming the config field, the numbers and the fix when tp does
    not divide the attention heads, ep the routed experts, or the model has fewer blocks
    than pp * vpp chunks (module docstring); nothing is refused that the passes accept."""
    par = config.parallel
    found = model_config(model)
    if found is not None and par.tp > 1:
        _check_heads(model, found, par.tp, dict(par.tp_plan))
    if found is not None and par.ep > 1:
        _check_experts(model, found, par.ep)
    if par.num_chunks > 1:
        error = blocks_error(par.num_chunks, module_blocks(model))
        if error is not None:
            raise error


def model_config(model: nn.Module) -> object | None:
    """The config whose numbers the model was built from: a Hugging Face model's ``config``
    (its text config, for a model with several), or the config dataclass a plain module
    keeps as ``cfg`` or ``config`` (fxmeg's models/gpt.py and models/llama.py, nanoGPT)."""
    if is_hugging_face(model):
        text = getattr(model.config, "get_text_config", None)
        return text() if callable(text) else model.config
    for name in ("cfg", "config"):
        cfg = getattr(model, name, None)
        if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            return cfg
    return None


def _field(cfg: object, names: tuple[str, ...]) -> tuple[str, int] | None:
    """(the field as the config's class spells it, its value) of the first of ``names``
    holding a positive int."""
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            # GPT-2: num_attention_heads is n_head
            own = getattr(cfg, "attribute_map", {}).get(name, name)
            return f"{type(cfg).__name__}.{own}", value
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def attention_modules(model: nn.Module) -> list[str]:
    """The outermost modules whose class is an attention (its name holds "Attention": every
    Hugging Face decoder's, fxmeg's models')."""
    found: list[str] = []
    for name, module in model.named_modules():
        if "Attention" in type(module).__name__ and not any(
            name.startswith(f + ".") for f in found
        ):
            found.append(name)
    return found


def _check_heads(model: nn.Module, cfg: object, tp: int, plan: dict[str, str]) -> None:
    heads = _field(cfg, HEADS)
    attention = attention_modules(model)
    if heads is None or heads[1] % tp == 0 or not attention:
        return
    inside = [
        n
        for n, _ in model.named_modules()
        if any(n == a or n.startswith(a + ".") for a in attention)
    ]
    if any(role == "replicate" and fnmatch.filter(inside, glob) for glob, role in plan.items()):
        return  # the user's plan keeps (part of) the attention whole: the pass judges it
    field, n = heads
    glob = re.sub(r"\.\d+\.", ".*.", attention[0] + ".") + "*"
    raise ConfigError(
        f"tp={tp} does not divide {n}, the number of heads of {type(model).__name__}'s attention "
        f"({field}={n}): tensor parallelism gives each tp rank whole heads; choose tp in "
        f"{_divisors(n)}, or keep the attention whole on every tp rank with tp_plan={{{glob!r}: "
        "'replicate'}"
    )


def _check_experts(model: nn.Module, cfg: object, ep: int) -> None:
    experts = _field(cfg, EXPERTS)
    if experts is None or experts[1] < 2 or experts[1] % ep == 0:
        return
    field, n = experts
    raise ConfigError(
        f"ep={ep} does not divide the {n} experts of {type(model).__name__} ({field}={n}): expert "
        f"parallelism gives each ep rank {n} / ep whole experts of every layer; choose ep among "
        f"{_divisors(n)}"
    )


def module_blocks(model: nn.Module) -> list[str]:
    """The numbered children of the module list with the most of them ('layers.0', ...),
    in order: the partition pass's blocks as the module tree has them (every name of a
    shared module counted)."""
    lists: dict[str, set[int]] = defaultdict(set)
    for name, _ in model.named_modules(remove_duplicate=False):
        m = NUMBERED.match(name)
        if m:
            lists[m[1]].add(int(m[2]))
    if not lists:
        return []
    container = max(lists, key=lambda c: (len(lists[c]), -len(c)))
    return [f"{container}.{i}" for i in sorted(lists[container])]


def blocks_error(num_chunks: int, blocks: list[str]) -> ConfigError | None:
    """The refusal of pp * vpp = ``num_chunks`` chunks over ``blocks`` (partition.py's rule:
    at most one chunk per block), or None."""
    if num_chunks == 1 or len(blocks) >= num_chunks:
        return None
    if not blocks:
        return ConfigError(
            f"pp * vpp = {num_chunks} chunks, but no repeated blocks were found in the model "
            "(module lists such as 'layers.0', 'layers.1'); fxmeg cuts pipelines at block "
            "boundaries"
        )
    return ConfigError(
        f"pp * vpp = {num_chunks} chunks, but the model has only {len(blocks)} blocks ({blocks[0]} "
        f".. {blocks[-1]}); choose pp * vpp <= {len(blocks)}"
    )
