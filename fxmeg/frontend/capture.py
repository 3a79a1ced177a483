"""Capture: torch.export (training IR) of a model and its loss on one example micro-batch.

The result is a plain ``fx.GraphModule`` in the user's vocabulary:

* parameters and buffers are ``get_attr`` nodes named by their original FQN (a tied
  parameter under its first name in ``named_parameters()``), holding the user's own
  ``nn.Parameter`` objects, so an optimizer built on them trains the user's model;
* placeholders are the example inputs, in order (a dict example: its tensors in key
  order, each placeholder named by its key; the model is called with them by keyword);
* the output is the flat tuple of the model's outputs (the loss first);
* a higher-order op (an autocast or ``torch.no_grad()`` region inside forward, ``wrap``)
  stays one ``call_function`` node; its body is a GraphModule under ``_fxmeg_hop``
  (``_fxmeg_hop.autocast_0``), read by a ``get_attr`` operand, that takes the
  parameters it uses as operands and holds no tensors itself;
* every node carries ``meta["val"]`` (a fake tensor: shape and dtype) and
  ``meta["fxmeg"]["module"]``, the FQN of the innermost module that created it
  (``""`` for code in the model's own ``forward``);
* ``gm.meta["fxmeg"]["capture"]`` is a ``fxmeg.ir.program.CaptureInfo``: input names and
  shapes, the user's names of tied tensors, whether a ``loss_fn`` gave the loss.

Exported training-IR graphs keep high-level ATen ops (``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention``,
``aten.cross_entropy_loss``) that autograd differentiates like the eager model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn

from fxmeg.config import Example
from fxmeg.errors import CaptureError
from fxmeg.interop.hugging_face import exportable_experts, is_hugging_face
from fxmeg.ir.program import CONSTANTS, CaptureInfo, InputSpec
from fxmeg.ir.tags import set_tags, tag
from fxmeg.torch_private import HigherOrderOperator, op_schema
from fxmeg.weights.meta_init import on_meta

LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_PREFIX = "model."  # FQN prefix of the user's model inside _WithLossFn
# Runtime metadata asserts export leaves behind; the graph's shapes are static anyway.
_EXPORT_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


@dataclass
class Captured:
    """A captured model: the graph plus the naming facts later passes need."""

    gm: fx.GraphModule
    input_names: list[str]
    """Placeholder names, one per example input, in order."""
    aliases: dict[str, list[str]]
    """Canonical FQN -> every name the user's ``state_dict`` has for that tensor."""
    explicit_loss: bool
    """True when the outputs are already ``(loss_sum, num_tokens)`` from a ``loss_fn``."""


class _HuggingFace(nn.Module):
    """A transformers PreTrainedModel as fxmeg expects it: forward(input_ids, labels)
    returning the loss, with the key-value cache off (export cannot return a cache).
    Hugging Face causal LMs shift the labels themselves: pass labels = input_ids.
    With ``names`` (a dict example) forward takes those tensors in order and passes them
    by keyword: ``model(**batch, use_cache=False).loss``."""

    def __init__(self, model: nn.Module, names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        batch = dict(zip(self.names or ("input_ids", "labels"), inputs, strict=True))
        return self.model(**batch, use_cache=False).loss


class _WithLossFn(nn.Module):
    """Runs ``loss_fn(model, *inputs)`` (a dict example: ``loss_fn(model, **batch)``) so
    that export sees the user's loss."""

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, names: tuple[str, ...] | None = None
    ) -> None:
        super().__init__()
        self.model, self.loss_fn, self.names = model, loss_fn, names

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.names is None:
            return self.loss_fn(self.model, *inputs)
        return self.loss_fn(self.model, **dict(zip(self.names, inputs, strict=True)))


class _Keywords(nn.Module):
    """``model(**batch)`` for a dict example: export takes the tensors positionally, in
    the example's key order, and the model receives them by name."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor):
        return self.model(**dict(zip(self.names, inputs, strict=True)))


def capture(
    model: nn.Module,
    example_inputs: Example,
    *,
    loss_fn: LossFn | None = None,
    grouped_experts: bool = False,
) -> Captured:
    """Export ``model`` (or ``loss_fn(model, *inputs)``) and return it in the user's names.
    A dict example is passed to the model (or ``loss_fn``) by keyword. ``grouped_experts``
    (expert or context parallelism): a Hugging Face MoE is captured with grouped experts,
    whatever its config names (``hugging_face.exportable_experts``)."""
    names = tuple(example_inputs) if isinstance(example_inputs, Mapping) else None
    example = tuple(example_inputs.values()) if names is not None else example_inputs
    if not isinstance(example, tuple) or not all(isinstance(t, torch.Tensor) for t in example):
        raise CaptureError(
            "example_inputs must be a tuple of tensors (one micro-batch, e.g. "
            "(input_ids, labels)) or a dict of tensors passed by keyword; got "
            f"{type(example_inputs).__name__}"
        )
    if on_meta(model):  # shapes only: export the model on meta inputs too
        example = tuple(t.to("meta") for t in example)
    example = _unaliased(example)
    if loss_fn is not None:
        root = _WithLossFn(model, loss_fn, names)
    elif is_hugging_face(model):
        root = _HuggingFace(model, names)
    elif names is not None:
        root = _Keywords(model, names)
    else:
        root = model
    try:
        with exportable_experts(model, grouped=grouped_experts):  # "eager" experts do not export
            ep = torch.export.export(root, example, strict=False)
    except Exception as exc:  # export raises many types; all mean "not capturable"
        raise CaptureError(_explain_export_failure(model, exc, root, example)) from exc
    prefix = _PREFIX if root is not model else ""
    placeholders = names or (("input_ids", "labels") if isinstance(root, _HuggingFace) else None)
    gm, input_names = _unlift(ep, model, prefix, placeholders)
    aliases = _aliases(model)
    inputs = tuple(
        InputSpec(n, tuple(t.shape), t.dtype) for n, t in zip(names or input_names, example)
    )
    set_tags(gm, {"capture": CaptureInfo(
        inputs, {k: tuple(v) for k, v in aliases.items()}, explicit_loss=loss_fn is not None,
        keywords=names is not None)})
    return Captured(gm, input_names, aliases, explicit_loss=loss_fn is not None)


def _unaliased(example: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The example with every tensor that shares storage with an earlier one cloned.
    Export traces aliased inputs as one value: with ``(ids, ids)`` as the example (labels
    = input ids), the graph would read the labels where the model reads its input ids,
    and every later batch would train on its labels only."""
    seen: set = set()
    out = []
    for t in example:
        key = (t.device, t.untyped_storage().data_ptr()) if not t.is_meta else None
        out.append(t.clone() if key is not None and key in seen else t)
        seen.add(key)
    return tuple(out)


def retarget(gm: fx.GraphModule, device: torch.device) -> None:
    """Replace every ``device=meta`` argument in ``gm`` (and its sub-graphs) with
    ``device``. A model captured on meta bakes meta into the tensors its forward creates
    (``torch.arange(s, device=ids.device)``), and passes that copy a value's device do too.
    On a CPU, a histogram of integers runs in fp32 (``_float_histc``). Ensures: no node
    argument names the meta device."""
    meta = torch.device("meta")

    def swap(a):
        return device if isinstance(a, torch.device) and a == meta else a

    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
        if device.type in ("cpu", "mps"):
            _float_histc(module.graph)
        module.recompile()


def _float_histc(graph: fx.Graph) -> None:
    """A histogram of integers computed in fp32 and cast back. Code that asks its tensors'
    device takes an accelerator's branch when captured on meta: transformers' MoE routing
    counts tokens per expert with ``torch.histc`` of ints (for determinism on CUDA), which a
    CPU does not implement (NotImplementedError "histogram_cpu" for 'Int'), and of floats
    on a CPU. Counts below 2^24 are exact in fp32."""
    for node in list(graph.nodes):
        x = node.args[0].meta.get("val") if node.target is torch.ops.aten.histc.default \
            else None
        if not isinstance(x, torch.Tensor) or x.is_floating_point():
            continue
        with graph.inserting_before(node):
            wide = graph.call_function(torch.ops.aten._to_copy.default, (node.args[0],),
                                       {"dtype": torch.float32})
        node.args = (wide, *node.args[1:])
        with graph.inserting_after(node):
            back = graph.call_function(torch.ops.aten._to_copy.default, (node,),
                                       {"dtype": x.dtype})
        back.meta = dict(node.meta)
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)


def owning_module(node: fx.Node) -> str:
    """FQN of the innermost module that created ``node`` ('' for top-level code)."""
    return tag(node, "module", "")


_CONTROL_FLOW = (
    "fxmeg needs a model whose forward has no data-dependent Python control flow "
    "(branches or loops on tensor values), returns tensors (no caches or custom "
    "objects) and runs on the example inputs. Fixes to try: make the branch depend "
    "on shapes or config, use torch.where / torch.cond, disable caches "
    "(use_cache=False), or pass loss_fn=... that calls the model the traceable way."
)
_DATA_DEPENDENT = ("data-dependent", "data dependent", "GuardOnDataDependent",
                   "DynamicOutputShape", "DataDependentOutput", "unbacked")


def _explain_export_failure(
    model: nn.Module, exc: Exception, root: nn.Module, example: tuple[torch.Tensor, ...]
) -> str:
    """What failed, where, and the fix that applies: the advice on data-dependent control
    flow only when tracing met a data-dependent value; otherwise what plain PyTorch does
    with the same call (``_eager_failure``), and for an attention module that repeats its
    keys, the heads its config gives."""
    reason = [line for line in str(exc).strip().splitlines() if line.strip()]
    first = reason[0] if reason else type(exc).__name__
    fqn, module = _failing_module(model, exc)
    place = f" in module {fqn or '<root>'!r} ({type(module).__name__})" if module else ""
    head = (f"torch.export could not capture {type(model).__name__}{place}: "
            f"{type(exc).__name__}: {first}\n")
    if _data_dependent(exc):
        return head + _CONTROL_FLOW
    eager = _eager_failure(model, root, example)
    if eager is None:
        return head + (
            "Tracing met no data-dependent value: an operation failed on the shapes or "
            "values it was given, while plain PyTorch runs the same call on the example "
            + ("(with no attention mask and with one that pads a token) "
               if is_hugging_face(model) else "") + "without error. " + _CONTROL_FLOW)
    call, error = eager
    return head + (
        f"This is not tracing: plain PyTorch fails too on {call} ({error}). "
        + ("Under torch.export transformers builds the causal mask as a tensor, where an "
           "eager call with no padding passes None, so the model runs its masked attention "
           "path, which fails here; " if "attention mask" in call else "")
        + "the model's code or configuration does not fit its example. "
        + _heads_hint(fqn, module))


def _data_dependent(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is tracing meeting a
    data-dependent value (a branch, a size or an output shape read from a tensor)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(k in f"{type(exc).__name__}: {exc}" for k in _DATA_DEPENDENT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _eager_failure(
    model: nn.Module, root: nn.Module, example: tuple[torch.Tensor, ...]
) -> tuple[str, str] | None:
    """(the call, ``Type: message``) when plain PyTorch fails the call export traced: the
    example itself, and for a Hugging Face model given ``input_ids`` and no
    ``attention_mask`` the same call with a mask that pads the first token of the first row
    (transformers drops an all-ones mask in eager mode, never while tracing: a padded one
    takes the masked path tracing takes); None when both run, or on meta (nothing to run)."""
    if on_meta(model) or any(t.is_meta for t in example):
        return None
    calls = [("the example", lambda: root(*example))]
    names = getattr(root, "names", None) or ("input_ids", "labels")
    if isinstance(root, _HuggingFace) and "attention_mask" not in names:
        batch = dict(zip(names, example, strict=True))
        ids = batch.get("input_ids")
        if ids is not None and ids.dim() == 2:
            mask = torch.ones_like(ids)
            mask[0, 0] = 0
            calls.append((
                "the example with an attention mask that pads its first token",
                lambda: model(**batch, attention_mask=mask, use_cache=False)))
    for call, run in calls:
        try:
            with torch.no_grad():
                run()
        except Exception as e:  # noqa: BLE001 - reported as the model's own failure
            return call, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
    return None


def _heads_hint(fqn: str, module: nn.Module | None) -> str:
    """For a failing attention module that repeats its keys and values
    (``num_key_value_groups`` > 1): the heads its config gives, and the fix for a
    latent-attention model, whose keys already have one head per query head."""
    groups = getattr(module, "num_key_value_groups", 1)
    config = getattr(module, "config", None)
    if not isinstance(groups, int) or groups <= 1 or config is None:
        return "Fix the model or its config so that plain PyTorch runs that call."
    kv = getattr(config, "num_key_value_heads", None)
    heads = getattr(config, "num_attention_heads", None)
    return (
        f"Module {fqn!r} repeats its keys and values num_key_value_groups={groups} times "
        f"(config num_key_value_heads={kv} of num_attention_heads={heads}); if its keys "
        "already have one head per query head (latent attention: keys expanded from a "
        "shared latent), set num_key_value_heads=num_attention_heads in the config.")


def _failing_module(model: nn.Module, exc: BaseException) -> tuple[str, nn.Module | None]:
    """(fqn, module) of the innermost module whose forward was running when export failed
    (``("", None)`` when none was)."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    tb, found = exc.__traceback__, ("", None)
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name == "_call_impl" and id(owner) in names:
            found = (names[id(owner)], owner)
        tb = tb.tb_next
    return found


def _unlift(
    ep: torch.export.ExportedProgram, model: nn.Module, prefix: str, names: tuple[str, ...] | None
):
    """Turn lifted parameter/buffer placeholders into get_attr nodes with user FQNs; the
    user inputs' placeholders are named ``names`` when given (a wrapper's ``*inputs``
    would otherwise name them ``inputs_0`` ..)."""
    sig = ep.graph_signature
    user_outputs = _check_outputs(ep)
    canonical = _canonical_names(model)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, torch.Tensor] = {}
    input_names: list[str] = []
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    getters: dict[str, fx.Node] = {}
    users = [n for n in placeholders if n.name in sig.user_inputs]
    for i, node in enumerate(users):  # user inputs first: they are the graph's signature
        env[node] = (
            graph.placeholder(names[i]) if names else graph.node_copy(node, lambda n: env[n])
        )
        env[node].meta = {**node.meta, "fxmeg": {"module": ""}}
        input_names.append(env[node].name)
    for node in placeholders:
        if node.name in sig.user_inputs:
            continue
        fqn, tensor = _lifted_tensor(ep, node.name, model, prefix)
        fqn = canonical.get(id(tensor), fqn)
        if fqn not in getters:  # a tied tensor is lifted once per name; keep one getter
            attrs[fqn] = tensor
            getters[fqn] = graph.get_attr(fqn)
            getters[fqn].meta = {**node.meta, "fxmeg": {"module": ""}}
        env[node] = getters[fqn]
    for node in ep.graph.nodes:
        if node.op in ("placeholder", "output") or node.target in _EXPORT_CHECKS:
            continue
        if node.op == "get_attr":  # the body of a higher-order op (autocast, no-grad, wrap)
            target = _body_name(ep.graph_module, node, attrs)
            caller = next(iter(node.users), node)
            body = getattr(ep.graph_module, node.target)
            attrs[target] = _body(body, prefix, _module_of(caller, prefix))
            env[node] = graph.get_attr(target)
            env[node].meta = dict(node.meta)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
        set_tags(env[node], {"module": _module_of(node, prefix)})
    graph.output(tuple(env[n] for n in user_outputs))
    for getter in getters.values():
        if not getter.users:
            graph.erase_node(getter)
            attrs.pop(getter.target)
    gm = fx.GraphModule(attrs, graph)
    gm.graph.lint()
    _refuse_state_updates(gm)
    return gm, input_names


_BODIES = "_fxmeg_hop"  # higher-order ops' bodies live under this submodule


def _module_of(node: fx.Node, prefix: str) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    module = list(stack.values())[-1][0] if stack else ""
    return _strip(module, prefix)


def _body_name(root: nn.Module, node: fx.Node, taken: dict) -> str:
    """``_fxmeg_hop.<region kind>_<i>`` for the body a get_attr node of the exported
    graph names (``autocast_0``, ``set_grad_enabled_1``, ``wrap_2``)."""
    if not isinstance(getattr(root, node.target, None), fx.GraphModule):
        raise CaptureError(
            f"the exported graph reads attribute {node.target!r} (node {node.name!r}), which "
            "is not the body of a higher-order op; fxmeg cannot capture it"
        )
    hops = (u.target for u in node.users if isinstance(u.target, HigherOrderOperator))
    hop = next(hops, None)
    kind = hop.name().removeprefix("wrap_with_") if hop is not None else "body"
    index = sum(name.startswith(f"{_BODIES}.") for name in taken)
    return f"{_BODIES}.{kind}_{index}"


def _body(module: fx.GraphModule, prefix: str, caller: str) -> fx.GraphModule:
    """A copy of a higher-order op's body (nested bodies too) without export's runtime
    metadata asserts; its nodes keep their metadata and get fxmeg's ``module`` tag (the
    calling node's module where export recorded none).
    Export's training IR passes parameters and buffers into a body as operands, so it
    holds no tensors of its own."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, object] = {}
    for node in module.graph.nodes:
        if node.target in _EXPORT_CHECKS:
            continue
        if node.op == "get_attr":
            value = getattr(module, node.target)
            if not isinstance(value, fx.GraphModule):
                raise CaptureError(
                    f"a higher-order op's body reads attribute {node.target!r} (node "
                    f"{node.name!r}), not a parameter passed in; fxmeg cannot capture it"
                )
            attrs[node.target] = _body(value, prefix, caller)
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.op != "output":
            set_tags(env[node], {"module": _module_of(node, prefix) or caller})
    return fx.GraphModule(attrs, graph)


def _refuse_state_updates(gm: fx.GraphModule) -> None:
    """Forward must not write parameters or buffers in place (e.g. BatchNorm running
    statistics): fxmeg replays forward per micro-batch, stage and rank."""
    for node in gm.graph.nodes:
        schema = op_schema(node.target)
        if node.op != "call_function" or schema is None:
            continue
        written = [
            a for spec, a in zip(schema.arguments, node.args)
            if spec.alias_info is not None and spec.alias_info.is_write
        ]
        if node.target == torch.ops.aten.batch_norm.default and node.args[5]:
            written += [node.args[3], node.args[4]]  # training: running statistics
        state = [a.target for a in written if isinstance(a, fx.Node) and a.op == "get_attr"]
        if state:
            raise _state_update_error(
                f"module {owning_module(node)!r} updates {', '.join(state)} in place during "
                f"forward ({schema.name}, node {node.name!r})"
            )


def _state_update_error(what: str) -> CaptureError:
    return CaptureError(
        f"{what}, e.g. BatchNorm running statistics; fxmeg replays forward per micro-batch "
        "and pipeline stage and cannot keep such state consistent. Use a norm without "
        "running statistics (LayerNorm, RMSNorm) or put the module in eval mode."
    )


def _check_outputs(ep: torch.export.ExportedProgram) -> list[fx.Node]:
    if ep.graph_signature.buffers_to_mutate:
        names = ", ".join(sorted(ep.graph_signature.buffers_to_mutate.values()))
        raise _state_update_error(f"the model updates buffers {names} during forward")
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    flat = [a for a in out_node.args[0] if isinstance(a, fx.Node)]
    if len(flat) != len(out_node.args[0]):
        raise CaptureError("the model returns non-tensor values; return the loss tensor")
    return flat


def _lifted_tensor(ep, name: str, model: nn.Module, prefix: str):
    sig = ep.graph_signature
    if name in sig.inputs_to_parameters:
        fqn = _strip(sig.inputs_to_parameters[name], prefix)
        return fqn, model.get_parameter(fqn)
    if name in sig.inputs_to_buffers:
        fqn = _strip(sig.inputs_to_buffers[name], prefix)
        return fqn, model.get_buffer(fqn)
    if name in sig.inputs_to_lifted_tensor_constants:
        const = sig.inputs_to_lifted_tensor_constants[name]
        if ep.constants[const].is_meta:
            raise CaptureError(
                f"forward creates a tensor constant ({const!r}) on the meta device, so its values "
                "are lost when the model is captured on meta; create it from Python values without "
                "device=<input>.device, or register it as a buffer the init_fn fills"
            )
        return f"{CONSTANTS}{const}", ep.constants[const]
    raise CaptureError(f"unsupported lifted input {name!r} in the exported graph")


def _strip(fqn: str, prefix: str) -> str:
    if prefix and fqn.startswith(prefix):
        return fqn[len(prefix) :]
    return "" if fqn == prefix.rstrip(".") else fqn


def _canonical_names(model: nn.Module) -> dict[int, str]:
    """id(tensor) -> its first name: the one ``named_parameters()`` reports."""
    names: dict[int, str] = {}
    for fqn, t in (*model.named_parameters(), *model.named_buffers()):
        names.setdefault(id(t), fqn)
    return names


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Canonical FQN -> all state_dict names of that tensor (tied weights have several)."""
    by_id: dict[int, list[str]] = {}
    named = (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    )
    for fqn, t in named:
        by_id.setdefault(id(t), []).append(fqn)
    return {names[0]: names for names in by_id.values()}
