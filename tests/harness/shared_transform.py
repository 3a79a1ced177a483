"""The ranks of one test spawn share each transform: the first rank to ask for a Program
computes it, the others load it (test infrastructure, docs/contributing.md).

Every rank of a spawn builds the same model and calls ``fxmeg.parallelize`` with the same
example and options, so each used to capture and transform it again: about half of a rank's
time in the suite. A Program is rank-free (docs/architecture.md §2), so one transform serves all.

``install(directory)`` (tests/harness/distributed.py calls it in every rank) wraps ``transform``
where fxmeg calls it. A call is keyed by its index among this rank's transforms and by
everything the transform reads: the model's class, ``repr``, Hugging Face config and the
attention / experts implementations it runs (``config._attn_implementation``,
``_experts_implementation``, which its ``repr`` leaves out), the names, shapes, dtypes,
devices and values of its state dict and of every buffer (non-persistent ones too, e.g.
rotary tables); the code each module runs (``_code``: its ``forward``, hooks and the
functions they call by global name); the example's tensors; the config or options;
``FXMEG_SKIP_PASSES``; the loss function (its code and state, not only its name) and
the loss each Hugging Face model inside calls; the device. The index keeps apart two
transforms of one rank that look alike but are not (a test that patches a pass between
them): only the n-th transforms of two ranks are one. The first rank to create
``KEY.lock`` transforms (with ``FXMEG_VERIFY``'s pass checks when the spawn sets it) and
writes ``KEY.program``; a rank that finds the lock waits for that file and loads it.

A Program holds the user's tensors. The file holds none of the model's: each is written as
its state-dict name and bound, on load, to the loading rank's own model, after the same
in-place precision cast the transform makes (``_cast``), whose fp32 tensors are bound to
``Program.master_values``, and the buffers it makes fp32 again (the routers' expert
biases). A tensor on a model tensor's memory (the graph's own alias of a buffer the
runtime updates in place) is bound as the same view of it. Other tensors
(constants the passes made) travel by value, and the FakeTensors of ``node.meta["val"]``
as meta tensors of the same shape, stride and dtype (nothing reads them after the
transform). A GraphModule travels as its graph's nodes, its attributes and ``meta``, not
as generated code (which ``pickle`` would trace again, losing the ``fxmeg`` tags the
runtime binds by).

Not shared: ``stop_after`` calls, a loss function without a stable name, and a transform
that failed (every rank then runs it and fails by itself, with its own message).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import time
import types

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

import fxmeg
import fxmeg.api
import fxmeg.diagnostics.layout_plan
import fxmeg.frontend.pass_driver as transform_module
import fxmeg.frontend.variable_shapes
from fxmeg.frontend.router_bias import replace_buffers

WAIT_S = 300.0
_ORIGINAL = transform_module.transform
_CALLERS = (fxmeg, fxmeg.api, fxmeg.diagnostics.layout_plan, fxmeg.frontend.variable_shapes)
_calls = 0


def install(directory: str) -> None:
    """Route this process's transforms through the shared cache in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    shared = functools.partial(_shared_transform, directory)
    functools.update_wrapper(shared, _ORIGINAL)
    for module in _CALLERS:
        module.transform = shared


def _shared_transform(directory: str, model: nn.Module, example, config=None, *, loss_fn=None,
                      stop_after=None, device=None, **options):
    global _calls
    _calls += 1  # the n-th transform of one rank is the n-th of the others
    key = None if stop_after is not None else _key(model, example, config, loss_fn, device, options)
    if key is None:
        return _ORIGINAL(
            model, example, config, loss_fn=loss_fn, stop_after=stop_after, device=device, **options
        )
    path = os.path.join(directory, f"{_calls}-{key}")
    try:
        os.close(os.open(path + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        found = _wait(path)
        if found is not None:
            return _load(found, model)
        return _ORIGINAL(model, example, config, loss_fn=loss_fn, device=device, **options)
    try:
        program = _ORIGINAL(model, example, config, loss_fn=loss_fn, device=device, **options)
        blob = _dump(program, model)
    except BaseException:  # the others then transform by themselves
        open(path + ".failed", "w").close()
        raise
    with open(path + ".tmp", "wb") as f:
        f.write(blob)
    os.replace(path + ".tmp", path + ".program")
    return program


def _wait(path: str) -> bytes | None:
    """The Program another rank wrote, or None when its transform failed."""
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        if os.path.exists(path + ".program"):
            with open(path + ".program", "rb") as f:
                return f.read()
        if os.path.exists(path + ".failed"):
            return None
        time.sleep(0.02)
    raise TimeoutError(
        f"no rank finished the shared transform {os.path.basename(path)} in {WAIT_S:.0f} s"
    )


# ---------------------------------------------------------------------------- the key

def _key(model, example, config, loss_fn, device, options) -> str | None:
    if loss_fn is not None and not _stable_name(loss_fn):
        return None
    h = hashlib.sha256()
    for part in (
        type(model).__module__,
        type(model).__qualname__,
        repr(model),
        repr(getattr(model, "config", None)),
        repr(_implementations(model)),
        repr(config),
        repr(sorted(options.items())),
        os.environ.get("FXMEG_SKIP_PASSES", ""),
        repr(device),
    ):
        h.update(part.encode())
    h.update(_code(model).encode())
    h.update(_losses(model, loss_fn).encode())
    for name, t in model.state_dict(keep_vars=True).items():
        _hash_tensor(h, name, t)
    # non-persistent ones are not in the state dict
    for name, t in model.named_buffers(remove_duplicate=False):
        _hash_tensor(h, f"buffer {name}", t)
    leaves, spec = pytree.tree_flatten(example)
    h.update(repr(spec).encode())
    for i, t in enumerate(leaves):
        _hash_tensor(h, str(i), t) if isinstance(t, torch.Tensor) else h.update(repr(t).encode())
    return h.hexdigest()[:32]


def _stable_name(fn) -> str | None:
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
    return None if "<locals>" in name or "<lambda>" in name or name == "." else name


def _implementations(model: nn.Module) -> list[tuple[str, str, object]]:
    """The attention and experts implementation of every Hugging Face config in ``model``
    (sub-configs included): transformers picks the attention / experts code by them, and
    a config's ``repr`` does not show them."""
    found, seen = [], set()
    configs = [(name, getattr(m, "config", None)) for name, m in model.named_modules()]
    while configs:
        name, cfg = configs.pop(0)
        if not hasattr(cfg, "to_dict") or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        found += [
            (name, k, getattr(cfg, k, None))
            for k in ("_attn_implementation", "_experts_implementation")
        ]
        configs += [(f"{name}/{k}", getattr(cfg, k, None)) for k in getattr(cfg, "sub_configs", {})]
    return found


def _code(model: nn.Module) -> str:
    """A digest of the code every module of ``model`` runs: its ``forward`` (a method of its
    class or a function set on the instance), its forward hooks, and what they call."""
    seen: dict[int, object] = {}
    parts = []
    for name, m in model.named_modules():
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
        parts.append(f"{name}:{type(m).__module__}.{type(m).__qualname__}:"
                     + "|".join(_callable(f, seen) for f in (m.forward, *hooks)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _losses(model: nn.Module, loss_fn) -> str:
    """A digest of the loss functions: ``loss_fn``'s code and state (two instances of one
    class with other settings differ), and for each Hugging Face model inside ``model`` the
    function its ``loss_function`` gives: one set on it (``model.loss_function = f``), else
    its loss_type's entry of transformers' LOSS_MAPPING (read without the property, which
    warns for a model without a loss)."""
    seen: dict[int, object] = {}
    parts = [_callable(loss_fn, seen) if loss_fn is not None else ""]
    for name, m in model.named_modules():
        if not isinstance(getattr(type(m), "loss_function", None), property):
            continue
        own = vars(m).get("_loss_function")
        if own is None:
            from transformers.loss.loss_utils import LOSS_MAPPING

            own = LOSS_MAPPING.get(
                getattr(m, "loss_type", None) or "ForCausalLM", LOSS_MAPPING["ForCausalLM"]
            )
        parts.append(f"{name}:{_callable(own, seen)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _callable(fn, seen: dict[int, object]) -> str:
    """What ``fn`` computes, as far as its code and state show: a function's code (with its
    defaults, closure values and the functions it names globally, once each), a bound
    method's function, a partial's function and arguments, another callable object's class,
    ``__call__`` and attributes. No memory address enters it: the ranks must agree.
    ``seen`` holds what was digested (by id, kept alive: a bound method is made anew at
    each access, and a freed one's id is reused)."""
    if id(fn) in seen:
        return "<seen>"
    seen[id(fn)] = fn
    if isinstance(fn, types.MethodType):
        return f"method {type(fn.__self__).__qualname__} {_callable(fn.__func__, seen)}"
    if isinstance(fn, functools.partial):
        func = _callable(fn.func, seen)
        return f"partial {func} {_value(fn.args, seen)} {_value(fn.keywords, seen)}"
    if isinstance(fn, types.FunctionType):
        code = fn.__code__
        called = sorted({n for c in _codes(code) for n in c.co_names
                         if isinstance(fn.__globals__.get(n), types.FunctionType)})
        cells = [_cell(c) for c in fn.__closure__ or ()]
        return " ".join(
            [
                f"function {fn.__module__}.{fn.__qualname__}",
                _code_text(code),
                _value(fn.__defaults__, seen),
                _value(fn.__kwdefaults__, seen),
                _value(cells, seen),
                _value(getattr(fn, "__wrapped__", None), seen),
            ]
            + [f"{n}={_callable(fn.__globals__[n], seen)}" for n in called]
        )
    if isinstance(fn, types.BuiltinFunctionType):  # its repr may hold its object's address
        return f"builtin {getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', None)}"
    call = type(fn).__call__ if callable(fn) else None
    state = vars(fn) if hasattr(fn, "__dict__") else {}
    return " ".join(
        [
            f"object {type(fn).__module__}.{type(fn).__qualname__}",
            _callable(call, seen) if isinstance(call, types.FunctionType) else "",
            _value(state, seen),
        ]
    )


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a variable the function closes over, not yet assigned
        return "<empty cell>"


def _codes(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _code_text(code: types.CodeType) -> str:
    """A code object's bytecode, constants and names (line numbers left out)."""
    consts = [
        _code_text(c) if isinstance(c, types.CodeType) else _value(c, {}) for c in code.co_consts
    ]
    return hashlib.sha256(
        repr(
            (
                code.co_code,
                consts,
                code.co_names,
                code.co_varnames,
                code.co_freevars,
                code.co_cellvars,
                code.co_argcount,
                code.co_kwonlyargcount,
            )
        ).encode()
    ).hexdigest()


def _value(v, seen: dict[int, object]) -> str:
    """A value a function closes over or is given, without memory addresses."""
    if v is None or isinstance(
        v, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)
    ):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(_value(x, seen) for x in v) + "]"
    if isinstance(v, (set, frozenset)):
        return "{" + ",".join(sorted(_value(x, seen) for x in v)) + "}"
    if isinstance(v, dict):
        return "{" + ",".join(f"{_value(k, seen)}:{_value(x, seen)}" for k, x in v.items()) + "}"
    if isinstance(v, torch.Tensor):
        h = hashlib.sha256()
        _hash_tensor(h, "", v)
        return h.hexdigest()
    if isinstance(v, type):
        return f"class {v.__module__}.{v.__qualname__}"
    # a module's own code and state are keyed apart
    if isinstance(v, (nn.Module, types.ModuleType)):
        return f"{type(v).__qualname__} {getattr(v, '__name__', '')}"
    if callable(v):
        return _callable(v, seen)
    return f"{type(v).__module__}.{type(v).__qualname__}"


def _hash_tensor(h, name: str, t: torch.Tensor) -> None:
    h.update(f"{name}{tuple(t.shape)}{t.stride()}{t.dtype}{t.device}{t.requires_grad}".encode())
    if not t.is_meta:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())


# ---------------------------------------------------------------------------- without it

def transform_alone(model: nn.Module, example, config=None, **options):
    """fxmeg's own transform, the cache left out: this rank transforms for itself."""
    return _ORIGINAL(model, example, config, **options)


def program_digest(program) -> str:
    """A digest of what a Program tells the runtime (docs/architecture.md §2: identical on every
    rank): each graph's code and its nodes' fxmeg tags (the parent, its chunks and their
    submodules, the reference), the chunks' calling conventions, placement, gradient
    buffer layouts, tp and ep specs, holders, shapes and the other records; not the
    tensors' values (the model's own, bound per rank)."""
    h = hashlib.sha256()
    graphs = [("reference", program.reference)] + [
        (name, gm) for name, gm in program.graph.named_modules() if isinstance(gm, fx.GraphModule)]
    for name, gm in graphs:
        h.update(f"{name}\n{gm.code}\n".encode())
        h.update(repr([(n.name, n.meta.get("fxmeg")) for n in gm.graph.nodes]).encode())
    for field in (
        "config",
        "specs",
        "placement",
        "buffers",
        "tp_specs",
        "ep_specs",
        "holders",
        "partition",
        "full_shapes",
        "aliases",
        "inputs",
        "value_checks",
        "flops_per_microbatch",
        "aux_scale",
        "init_dtypes",
        "keywords",
        "position_tables",
        "tp_whole",
        "cp_layout",
        "unread",
    ):
        # dicts in their order: the runtime walks it
        h.update(f"{field}={getattr(program, field)!r}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------- the file

def _dump(program, model: nn.Module) -> bytes:
    named = [(("model", n), t) for n, t in _model_tensors(model)]
    named += [(("master", n), t) for n, t in program.master_values.items()]
    buffer = io.BytesIO()
    _Pickler(buffer, named).dump(program)
    fp32 = [n for n, t in model.named_buffers(remove_duplicate=False) if t.dtype == torch.float32]
    return pickle.dumps((program.config.dtype, fp32, buffer.getvalue()))


def _load(blob: bytes, model: nn.Module):
    dtype, fp32, payload = pickle.loads(blob)
    before = dict(model.named_buffers(remove_duplicate=False))
    masters = transform_module._cast(model, dtype)  # the transform's side effects on the model
    _keep_fp32(model, fp32, before)
    tensors = {("model", n): t for n, t in _model_tensors(model)}
    tensors.update({("master", n): t for n, t in masters.items()})
    return _Unpickler(io.BytesIO(payload), tensors).load()


def _keep_fp32(model: nn.Module, fp32: list[str], before: dict[str, torch.Tensor]) -> None:
    """The buffers the transform left fp32 after its cast (the routers' expert biases,
    fxmeg/frontend/router_bias.py), fp32 again from their values before the cast."""
    swap = {}
    for name, t in model.named_buffers(remove_duplicate=False):
        if name in fp32 and t.dtype != torch.float32:
            swap.setdefault(id(t), before[name].detach().to(torch.float32))
    replace_buffers(swap, (model,))


def _model_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


class _Pickler(pickle.Pickler):
    def __init__(self, file, named: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.names = {id(t): name for name, t in named}
        self.storages = {_storage(t): name for name, t in reversed(named) if _storage(t)}

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.names:
                return self.names[id(obj)]
            if isinstance(obj, FakeTensor):
                return ("fake", tuple(obj.shape), obj.stride(), obj.dtype, obj.requires_grad)
            if _storage(obj) in self.storages:  # another tensor on a model tensor's memory
                return (
                    "view",
                    self.storages[_storage(obj)],
                    tuple(obj.shape),
                    obj.stride(),
                    obj.storage_offset(),
                    obj.dtype,
                    type(obj) is nn.Parameter,
                    obj.requires_grad,
                )
        if isinstance(obj, fx.Node):
            raise TypeError(f"a Node ({obj.name}) outside its graph's node list cannot be shared")
        return None

    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj.namespace, obj._schema.name.split("::")[-1], obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _op, (
                obj._qualified_op_name.split("::")[0],
                obj._qualified_op_name.split("::")[1],
                None,
            )
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, fx.GraphModule):
            return _graph_module, _graph_module_state(obj)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors: dict):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid):
        if pid[0] == "fake":
            _, shape, stride, dtype, requires_grad = pid
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(
                requires_grad
            )
        if pid[0] == "view":
            _, name, shape, stride, offset, dtype, parameter, requires_grad = pid
            base = self.tensors[name]
            assert base.dtype == dtype, (name, base.dtype, dtype)
            view = base.detach().as_strided(shape, stride, offset)
            return (
                nn.Parameter(view, requires_grad)
                if parameter
                else view.requires_grad_(requires_grad)
            )
        return self.tensors[pid]


def _storage(t: torch.Tensor) -> int:
    """The address of a tensor's memory (0 for none: meta, empty)."""
    return 0 if t.is_meta or isinstance(t, FakeTensor) else t.untyped_storage().data_ptr()


def _op(namespace: str, name: str, overload: str | None):
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _higher_order(name: str):
    return getattr(torch.ops.higher_order, name)


def _graph_module_state(gm: fx.GraphModule) -> tuple:
    nodes = [
        (n.op, n.name, n.target, _names(n.args), _names(n.kwargs), n.type, n.meta)
        for n in gm.graph.nodes
    ]
    attributes = {k: v for k, v in gm.__dict__.items() if isinstance(v, torch.Tensor)}
    return (type(gm).__name__ if type(gm).__name__ != "GraphModuleImpl" else "GraphModule",
            dict(gm._modules), dict(gm._parameters), dict(gm._buffers), attributes,
            nodes, gm.graph._codegen, dict(gm.meta))


def _graph_module(class_name, modules, parameters, buffers, attributes, nodes, codegen, meta):
    root = nn.Module()
    gm = fx.GraphModule(root, fx.Graph(), class_name)
    for name, m in modules.items():
        gm._modules[name] = m
    gm._parameters.update(parameters)
    gm._buffers.update(buffers)
    for name, t in attributes.items():
        setattr(gm, name, t)
    graph = fx.Graph(owning_module=gm)
    graph._codegen = codegen
    made: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs, type_expr, node_meta in nodes:
        node = graph.create_node(
            op, target, _nodes(args, made), _nodes(kwargs, made), name, type_expr
        )
        assert node.name == name, (node.name, name)
        node.meta = node_meta
        made[name] = node
    gm.graph = graph
    gm.meta.update(meta)
    return gm


class _Ref(str):
    """A node argument: the name of an earlier node of the same graph."""


def _names(value):
    return fx.node.map_arg(value, lambda n: _Ref(n.name))


def _nodes(value, made: dict):
    return fx.node.map_aggregate(value, lambda a: made[a] if isinstance(a, _Ref) else a)
