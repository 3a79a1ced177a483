"""Every private PyTorch name fxmeg uses, in one place.

torch keeps no promise about names with a leading underscore (``torch._guards``,
``op._schema``, ``torch._foreach_norm``): a release may move or drop them. So no other
module of fxmeg/ touches one; they import it from here, where each entry says what it is
for and was checked on torch ``CHECKED_ON``. After a torch upgrade, ``pytest
tests/repo/test_torch_private.py`` resolves every entry and names the ones that moved;
its source scan fails on a private torch name read anywhere else in fxmeg/.
(The public op namespaces ``torch.ops.aten`` / ``torch.ops.fxmeg`` are not private,
whatever their ops are called: ``aten._to_copy`` needs no entry.)

Adding one (docs/contributing.md, "Private torch APIs"): a re-export ``name =
_private("torch.module:attr")`` or a short function, with a one-line comment of what
fxmeg needs it for and anything version-specific, under its area. A module torch does
not import by itself is resolved on first call, so importing this module stays cheap.

This module imports nothing of fxmeg (tools/import_graph.py holds it to that), so any
module, passes and runtime alike, can import it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

CHECKED_ON = "2.13.0"  # the torch release every entry below was checked on


def _private(where: str) -> Any:
    """The object at ``where`` ("module:attr.attr"), or an ImportError naming it, the
    installed torch and CHECKED_ON (a bare AttributeError deep in a pass would not)."""
    module, _, attrs = where.partition(":")
    try:
        obj = importlib.import_module(module)
        for name in attrs.split("."):
            obj = getattr(obj, name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"fxmeg uses torch's private {module}.{attrs}, which torch {torch.__version__} does "
            f"not have ({exc}); fxmeg/torch_private.py was checked on torch {CHECKED_ON}. Install "
            f"torch {CHECKED_ON}, or find where the name moved and update its entry "
            "(docs/contributing.md, 'Private torch APIs')"
        ) from exc
    return obj


# --- export / capture: ATen ops and higher-order ops in captured graphs -------------------

# The class of one ATen overload (``aten.add.Tensor``): a call_function target with a schema.
OpOverload = _private("torch._ops:OpOverload")
# The class of export's region ops (autocast / set-grad-enabled wraps, checkpoint tags).
HigherOrderOperator = _private("torch._ops:HigherOrderOperator")


def op_schema(target: Any) -> torch.FunctionSchema | None:
    """The ATen schema (name, arguments with defaults and alias info, returns) of a
    call_function target; None for anything that has none (a Python function, a
    higher-order op, ``operator.getitem``)."""
    return getattr(target, "_schema", None)


# --- fake tensors -------------------------------------------------------------------------

# The fake mode the given tensors (export's node.meta["val"]) belong to, or the active one.
detect_fake_mode = _private("torch._guards:detect_fake_mode")
# A fresh fake mode: split_backward traces a chunk's joint graph under one
# (it passes allow_non_fake_inputs=True, a keyword of 2.13's constructor).
FakeTensorMode = _private("torch._subclasses.fake_tensor:FakeTensorMode")
# Base class of a dispatch-level mode: meta_init watches which storages an init_fn writes.
TorchDispatchMode = _private("torch.utils._python_dispatch:TorchDispatchMode")



# --- autograd / partitioner (split_backward, the executor) --------------------------------


def aot_export_joint_simple(fn, args, *, trace_joint: bool) -> torch.fx.GraphModule:
    """AOT autograd's joint forward + backward graph of ``fn`` on (fake) ``args``.
    Resolved on call: importing torch._functorch.aot_autograd costs seconds."""
    export = _private("torch._functorch.aot_autograd:aot_export_joint_simple")
    return export(fn, args, trace_joint=trace_joint)


def default_partition(joint, args, **kwargs):
    """AOT autograd's partitioner: a joint graph cut into forward and backward graphs,
    saving every value backward reads. split_backward passes 2.13's ``num_fwd_outputs``
    keyword. Resolved on call (as above)."""
    return _private("torch._functorch.partitioners:default_partition")(joint, args, **kwargs)


def min_cut_rematerialization_partition(joint, args, **kwargs):
    """The min-cut partitioner: as default_partition, but recomputes nodes tagged
    MUST_RECOMPUTE in backward instead of saving them; split_backward also passes
    ``compiler="aot_eager"`` (2.13 keywords). Resolved on call (as above).

    Without its common-subexpression pass (``torch._functorch.config.cse``): that pass
    imports torch._inductor's pattern matcher, and with it inductor's lowerings, jinja2 and
    ao.quantization (181 modules: 21 MiB more resident on every rank and 1.6 s more
    ``parallelize`` for the bench GPT at tp2 sp x pp2 under zbh1 with full recompute). On
    fxmeg's joint graphs it only merged duplicate views (the bench GPT's split is the same
    without it; a Llama's keeps 6 more ``view`` nodes, which copy nothing)."""
    partition = _private("torch._functorch.partitioners:min_cut_rematerialization_partition")
    with _private("torch._functorch.config:patch")(cse=False):
        return partition(joint, args, **kwargs)


# Swap a module's parameters / buffers for the given tensors within a ``with`` (the public
# torch.func.functional_call calls the module; split_backward needs the swap around an Interpreter).
reparametrize_module = _private("torch.nn.utils.stateless:_reparametrize_module")
# The autograd engine's backward (what torch.autograd.backward calls): the executor runs it
# from outputs whose data DEALLOC replaced, which torch.autograd.backward's shape check
# refuses (Megatron: custom_backward). Callers pass 2.13's keywords (keep_graph, create_graph,
# inputs, allow_unreachable, accumulate_grad).
run_backward = _private("torch.autograd:Variable._execution_engine.run_backward")


# --- tensors: views, storages, subclasses -------------------------------------------------

# is_alias_of(a, b): whether two tensors share storage; works on fake tensors (no data pointer).
is_alias_of = _private("torch._C:_is_alias_of")
# Context manager: inside a subclass's __torch_function__, run func as on a plain tensor.
DisableTorchFunctionSubclass = _private("torch._C:DisableTorchFunctionSubclass")


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, None when ``t`` owns its storage."""
    return t._base


def storage_key(t: torch.Tensor) -> int:
    """An int naming ``t``'s storage, equal for all its views (the storage object
    itself is made anew on each ``untyped_storage()`` call)."""
    return t.untyped_storage()._cdata


# --- nn.Module internals: a module's own tables, written in place -------------------------


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter table (not its children's), the live dict: writing it
    swaps a parameter without register_parameter's checks; entries may be None."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffer table (not its children's), the live dict (as above)."""
    return module._buffers


# --- distributed --------------------------------------------------------------------------


# The ProcessGroup a group name (``group.group_name``, what fxmeg's ops carry) stands for.
resolve_process_group = _private("torch.distributed.distributed_c10d:_resolve_process_group")


def release_world_capture() -> None:
    """torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a
    default argument, evaluated when the module is first imported. Imported after
    init_process_group (torch._dynamo imports it, and so does torch.distributed.checkpoint),
    they hold the default process group past destroy_process_group(): it then dies while
    Python finalizes, where a gloo worker releasing a finished work's tensors aborts the rank
    (docs/reliability.md, "Process exit"). This imports the module now and puts None (the
    default group, as each of those functions reads it) where a process group was captured.
    Checked on 2.13: their defaults are read only by their own bodies."""
    import torch.distributed.nn.functional as functional

    for fn in vars(functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, torch.distributed.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(
                None if isinstance(d, torch.distributed.ProcessGroup) else d for d in defaults)


# --- optimizer: foreach kernels -----------------------------------------------------------

# The 2-norm of each tensor of a list, in one kernel launch per device and dtype.
foreach_norm = _private("torch:_foreach_norm")
# Multiply each tensor of a list in place by one scalar (gradient clipping).
foreach_mul_ = _private("torch:_foreach_mul_")

# --- pytree: fxmeg uses none (tests/harness/shared_transform.py uses torch.utils._pytree) ---
