"""Values for a model built on the meta device (docs/architecture.md §2.1).

A model built under ``with torch.device("meta"):`` has shapes and no values. fxmeg
captures and transforms it as it is; each rank then makes only the tensors it holds,
from one of two sources:

* **weights**: a checkpoint read in slices (``fxmeg.weights.sources``): each rank reads the boxes
  of its tensor-parallel shards, nothing else;
* **initialisation**: for each module that directly owns tensors, its tensors are made
  full size, one module at a time, filled by ``init_fn(module)`` under a generator
  seeded from ``(seed, module name)``, and only this rank's slice is kept. The values
  therefore do not depend on the layout, and ``materialize(model, init_fn, seed)`` on
  one device makes exactly the model every parallel layout trains.

Non-persistent buffers (rotary tables, masks) are never in a checkpoint: their modules
are initialised even when the parameters come from weights. ``init_fn`` defaults to
``module.reset_parameters()``, or for the modules of a Hugging Face model (also one wrapped
in the user's loss module) to its ``_init_weights`` (which also recomputes rotary tables). A tensor
``init_fn`` leaves unwritten is an error naming it: found by recording which storages the call
writes.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fxmeg.errors import CaptureError, InitError
from fxmeg.ir.layouts import is_split
from fxmeg.torch_private import (
    TorchDispatchMode,
    op_schema,
    own_buffers,
    own_parameters,
    storage_key,
)
from fxmeg.weights.sharding import ep_shard, local_to_global, tp_shard

InitFn = Callable[[nn.Module], None]


def seed_for(seed: int, module: str) -> int:
    """The generator seed of module ``module`` (its FQN) for run seed ``seed``."""
    digest = hashlib.sha256(f"{seed}/{module}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def default_init(model: nn.Module) -> InitFn:
    """``module.reset_parameters()``; for a module inside a Hugging Face model (the model
    itself, or one wrapped in the user's loss module) that model's own ``_init_weights``,
    which also recomputes rotary tables (the outermost one's, as ``from_config`` applies it)."""
    from fxmeg.interop.hugging_face import is_hugging_face

    if is_hugging_face(model):
        return model._init_weights
    owner: dict[int, nn.Module] = {}
    for sub in model.modules():  # outer before inner: the outermost model claims a module first
        if is_hugging_face(sub):
            for m in sub.modules():
                owner.setdefault(id(m), sub)

    def reset(module: nn.Module) -> None:
        if id(module) in owner:
            return owner[id(module)]._init_weights(module)
        reset_parameters = getattr(module, "reset_parameters", None)
        if reset_parameters is None:
            raise InitError(f"{type(module).__name__} has no reset_parameters()")
        reset_parameters()

    return reset


@dataclass(frozen=True)
class Owner:
    """Where a tensor lives: the module that registers it, and its attribute name there."""

    module: str
    attr: str


def owners(model: nn.Module) -> dict[str, Owner]:
    """Every parameter and buffer by its first FQN (the name fxmeg uses) -> its owner.
    A tied tensor belongs to the module of its first name."""
    found: dict[int, str] = {}
    out: dict[str, Owner] = {}
    for fqn, module in model.named_modules():
        for attr, t in (*own_parameters(module).items(), *own_buffers(module).items()):
            if t is None or id(t) in found:
                continue
            name = f"{fqn}.{attr}" if fqn else attr
            found[id(t)] = name
            out[name] = Owner(fqn, attr)
    return out


class _Writes(TorchDispatchMode):
    """Records the storages every op run under it writes (in-place and out= arguments),
    also through views and ``.data`` aliases."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = op_schema(func).arguments
        values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
        for spec, value in zip(schema, values):
            if (
                spec.alias_info is not None
                and spec.alias_info.is_write
                and isinstance(value, torch.Tensor)
            ):
                self.storages.add(storage_key(value))
        return func(*args, **kwargs)


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: t
        for k, t in (*own_parameters(module).items(), *own_buffers(module).items())
        if t is not None
    }


def _run_init(module: nn.Module, name: str, init_fn: InitFn, seed: int) -> dict[str, torch.Tensor]:
    """Call ``init_fn(module)`` with the generators seeded for ``name``; the module's
    tensors after it. Raises InitError naming any tensor the call left unwritten."""
    before = _tensors(module)
    devices = {t.device for t in before.values() if t.device.type not in ("cpu", "meta")}
    device_type = next(iter(devices)).type if devices else "cuda"
    with torch.random.fork_rng(devices=list(devices), device_type=device_type), torch.no_grad():
        torch.manual_seed(seed_for(seed, name))
        with _Writes() as writes:
            try:
                init_fn(module)
            except InitError as exc:
                raise InitError(_no_init(module, name, str(exc)), repr(name or "<root>")) from exc
    after = _tensors(module)
    unwritten = [k for k, t in before.items()
                 if after.get(k) is t and t.numel() and storage_key(t) not in writes.storages]
    if unwritten:
        raise InitError(_no_init(module, name, f"init_fn left {', '.join(unwritten)} unwritten"),
                        repr(name or "<root>"))
    return after


def _no_init(module: nn.Module, name: str, why: str) -> str:
    return (
        f"cannot initialise module {name or '<root>'!r} ({type(module).__name__}) of a model built "
        f"on meta: {why}. Pass init_fn=fn, where fn(module) fills every parameter and buffer that "
        "module registers itself (nn.init.* on module.weight, buffers recomputed), or load them "
        "with weights=PATH"
    )


@contextlib.contextmanager
def _fresh(module: nn.Module, make: Callable[[str, torch.Tensor], torch.Tensor]):
    """For the duration, each tensor ``module`` registers itself is replaced by
    ``make(attr, tensor)`` (a Parameter stays a Parameter); restored afterwards, whatever
    ``init_fn`` did to the module's tables."""
    params, buffers = dict(own_parameters(module)), dict(own_buffers(module))
    try:
        for attr, t in _tensors(module).items():
            fresh = make(attr, t)
            if attr in params:
                own_parameters(module)[attr] = nn.Parameter(fresh, requires_grad=t.requires_grad)
            else:
                own_buffers(module)[attr] = fresh
        yield
    finally:
        own_parameters(module).clear(), own_parameters(module).update(params)
        own_buffers(module).clear(), own_buffers(module).update(buffers)


def init_module(module: nn.Module, name: str, init_fn: InitFn, seed: int, device: torch.device,
                dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Module ``name``'s own tensors (attribute -> tensor), made full size on ``device``
    in ``dtypes[attr]`` (default: as registered) and filled by ``init_fn``. The module
    itself is left as it was (its meta tensors back in place)."""
    def empty(attr: str, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtypes.get(attr, t.dtype), device=device)

    with _fresh(module, empty):
        return {k: t.detach() for k, t in _run_init(module, name, init_fn, seed).items()}


def check_init(model: nn.Module, modules: Iterable[str], init_fn: InitFn) -> None:
    """Run ``init_fn`` on each of ``modules`` (FQNs) on meta, where it costs nothing, and
    raise one InitError listing every module it cannot fill. Every rank calls this before
    any process group work, so a bad init is refused everywhere at once. An init that
    cannot run on meta (an op without a meta kernel) is checked when it runs for real."""
    failed = []
    for name in modules:
        module = model.get_submodule(name)
        try:  # fresh meta tensors: the model stays untouched
            with _fresh(module, lambda attr, t: torch.empty_like(t, device="meta")):
                _run_init(module, name, init_fn, 0)
        except InitError as exc:
            failed.append(exc)
        except (NotImplementedError, RuntimeError):
            pass  # no meta kernel: checked when it runs on the device
    if failed:
        more = (
            f" ({len(failed) - 1} more module(s) too: {', '.join(e.module for e in failed[1:4])}"
            + (", ...)" if len(failed) > 4 else ")")
            if len(failed) > 1
            else ""
        )
        raise InitError(str(failed[0]) + more)


@dataclass
class Source:
    """Where the values of a meta model come from: the weights that hold a tensor, else
    its module's initialisation."""

    model: nn.Module
    init_fn: InitFn
    seed: int
    weights: object | None = None
    """A ``fxmeg.weights.sources.Weights``, or None."""
    names: Mapping[str, str] | None = None
    """Tensor (first FQN) -> its name in ``weights`` (``fxmeg.weights.sources.check``)."""

    def has(self, name: str) -> bool:
        """Whether the weights hold tensor ``name``."""
        return self.names is not None and name in self.names

    def values(self, wanted: Mapping[str, tuple], device: torch.device, tp: int, rank: int,
               ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
        """``wanted``: tensor -> (tp spec or None, dtype, expert shard or None). This rank's
        local tensor of each: the tensor-parallel shard for rank ``rank`` of ``tp`` (the
        whole tensor when the spec is None) and, for an expert bank, of that the experts of
        ep rank ``ep_rank`` of ``ep``; in that dtype, on ``device``. From weights, only
        those boxes are read."""
        out: dict[str, torch.Tensor] = {}
        where = owners(self.model)  # one walk of the model for every tensor
        from_weights = {n: w for n, w in wanted.items() if self.names and n in self.names}
        if from_weights:
            requests = []
            for name, (spec, dtype, experts) in from_weights.items():
                local = list(
                    _tensors(self.model.get_submodule(where[name].module))[where[name].attr].shape
                )
                if is_split(spec):
                    local = list(spec.local_shape(local, tp))
                first = 0
                if experts is not None and ep > 1:
                    assert not is_split(spec) or spec.dim != 0, f"{name}: tp splits the experts"
                    local = list(experts.local_shape(local, ep))
                    first = experts.experts_of(ep, ep_rank)[0]
                out[name] = torch.empty(local, dtype=dtype, device=device)
                box = ((0,) * len(local), tuple(local))
                pairs = [(((g[0][0] + first, *g[0][1:]), g[1]), loc)
                         for g, loc in local_to_global(box, spec, tp, rank)]
                requests.append((self.names[name], out[name], pairs))
            self.weights.fill(requests)
        by_module: dict[str, list[str]] = {}
        for name in wanted:
            if name not in out:
                by_module.setdefault(where[name].module, []).append(name)
        for module, names in by_module.items():
            attrs = {where[n].attr: n for n in names}
            full = init_module(
                self.model.get_submodule(module),
                module,
                self.init_fn,
                self.seed,
                device,
                {where[n].attr: wanted[n][1] for n in names},
            )
            for attr, name in attrs.items():
                spec, dtype, experts = wanted[name]
                mine = ep_shard(tp_shard(full[attr], spec, tp, rank), experts, ep, ep_rank)
                out[name] = mine.to(dtype)
        return out


def materialize(model: nn.Module, *, init_fn: InitFn | None = None, seed: int = 0,
                device: torch.device | str = "cpu") -> nn.Module:
    """Give a model built on meta its values on one device, in place, exactly as every
    parallel layout of ``parallelize(model, ..., init_fn=init_fn, seed=seed)`` does: its
    single-device twin. Returns ``model``."""
    init_fn = init_fn or default_init(model)
    where = owners(model)
    modules = dict.fromkeys(o.module for n, o in where.items()
                            if _tensors(model.get_submodule(o.module))[o.attr].is_meta)
    check_init(model, modules, init_fn)
    made: dict[int, torch.Tensor] = {}
    for name in modules:
        module = model.get_submodule(name)
        old = _tensors(module)
        full = init_module(module, name, init_fn, seed, torch.device(device), {})
        for attr, value in full.items():
            if attr in own_parameters(module):
                made[id(old[attr])] = nn.Parameter(value, requires_grad=old[attr].requires_grad)
            else:
                made[id(old[attr])] = value
    for module in model.modules():  # tied tensors: every name gets the one new tensor
        for table in (own_parameters(module), own_buffers(module)):
            for attr, t in table.items():
                if t is not None and id(t) in made:
                    table[attr] = made[id(t)]
    return model


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (shapes, no values). A model with
    some tensors on meta and others real is refused: which values would it train from?
    Here, not in capture: ``value_source`` asks it too, and the runtime, which imports
    this module, must not import capture."""
    tensors = dict((*model.named_parameters(), *model.named_buffers()))
    meta = [n for n, t in tensors.items() if t.is_meta]
    if meta and len(meta) < len(tensors):
        real = next(n for n, t in tensors.items() if not t.is_meta)
        raise CaptureError(
            f"{type(model).__name__} has {len(meta)} tensor(s) on the meta device (e.g. "
            f"{meta[0]!r}) and {len(tensors) - len(meta)} real one(s) (e.g. {real!r}); build the "
            "whole model under `with torch.device('meta'):` (fxmeg then materialises each rank's "
            "part from weights= or init_fn=) or entirely with real tensors"
        )
    return bool(meta)


def value_source(model: nn.Module, program, *, weights=None, init_fn: InitFn | None = None,
                 seed: int = 0) -> Source | None:
    """Where ``parallelize`` takes the values of ``program``'s tensors from: None when the
    model's own (real) tensors are the values, else a Source. Checks everything it can
    without data and without a process group, so that every rank refuses a bad source at
    once: each tensor's name and shape in the weights (``fxmeg.weights.sources.check``), and that
    ``init_fn`` fills every tensor of each module it must initialise."""
    from fxmeg.errors import ConfigError

    meta = on_meta(model)
    if weights is None and not meta:
        if init_fn is not None:
            raise ConfigError(
                "init_fn= initialises a model built on the meta device, but this model "
                "has real tensors: build it under `with torch.device('meta'):`, or drop init_fn"
            )
        return None
    init_fn = init_fn or default_init(model)
    opened = names = None
    if weights is not None:
        from fxmeg.weights.converted import converted
        from fxmeg.weights.sources import check, open_weights

        opened = converted(open_weights(weights), model)
        names = check(opened, _persistent(program))
    where = owners(model)
    tensors = {n: _tensors(model.get_submodule(o.module))[o.attr] for n, o in where.items()}
    modules = dict.fromkeys(
        where[n].module for n, t in tensors.items() if t.is_meta and n not in (names or {})
    )
    check_init(model, modules, init_fn)
    return Source(model, init_fn, seed, opened, names)


def _persistent(program) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every state-dict tensor by first name -> (all its names, its full shape)."""
    canonical = {a: n for n, names in program.aliases.items() for a in names}
    out = {}
    for key, (shape, _) in program.full_shapes.items():
        name = canonical.get(key, key)
        out.setdefault(name, (tuple(program.aliases.get(name, (name,))), tuple(shape)))
    return out
