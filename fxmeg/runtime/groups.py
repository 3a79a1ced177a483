"""Process groups, built explicitly from a pure rank layout (no globals).

Rank layout (Megatron's default order tp-cp-dp-pp, tensor-parallel fastest):
    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
Experts fold over the dp x cp ranks of one (tp, pp) coordinate (Megatron's "parallel
folding", expert order tp-ep-dp-pp): with q = cp_rank + cp * dp_rank (the dp x cp rank),
ep_rank = q % ep and the expert-data-parallel rank is q // ep.

fxmeg holds every process group weakly (``WeakGroup``), so that
``dist.destroy_process_group()`` destroys them: docs/reliability.md, "Process exit".
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import product

import torch
import torch.distributed as dist

from fxmeg.errors import GroupDestroyedError
from fxmeg.torch_private import release_world_capture, resolve_process_group


@dataclass(frozen=True)
class Topology:
    """Pure arithmetic over the rank layout; testable without processes."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def rank(self, *, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank (``cp_rank`` gives the fourth)."""
        outer = rank // (self.tp * self.cp)
        return rank % self.tp, outer % self.dp, outer // self.dp

    def cp_rank(self, rank: int) -> int:
        """The context-parallel rank of a global rank."""
        return rank // self.tp % self.cp

    def _over(self, vary: str) -> list[list[int]]:
        """Groups of the ranks that differ only in the axes of ``vary`` (letters of
        't', 'c', 'd', 'p'), each sorted, one per combination of the other axes."""
        sizes = {"t": self.tp, "c": self.cp, "d": self.dp, "p": self.pp}
        fixed = [a for a in "pdct" if a not in vary]  # outermost first
        out = []
        for values in product(*(range(sizes[a]) for a in fixed)):
            at = dict(zip(fixed, values))
            members = []
            for inner in product(*(range(sizes[a]) for a in vary)):
                at.update(zip(vary, inner))
                members.append(self.rank(tp=at["t"], cp=at["c"], dp=at["d"], pp=at["p"]))
            out.append(sorted(members))
        return out

    def pp_groups(self) -> list[list[int]]:
        return self._over("p")

    def dp_groups(self) -> list[list[int]]:
        return self._over("d")

    def tp_groups(self) -> list[list[int]]:
        return self._over("t")

    def cp_groups(self) -> list[list[int]]:
        """Ranks holding the parts of the same sequences (context parallelism)."""
        return self._over("c")

    def dp_cp_groups(self) -> list[list[int]]:
        """Ranks whose gradients are reduced together, and over which the distributed
        optimizer shards: data-parallel x context-parallel (Megatron's data-parallel
        group "with context parallel")."""
        return self._over("dc")

    def ep_groups(self) -> list[list[int]]:
        """Ranks that split the experts among them (all-to-all of routed tokens): runs of
        ``ep`` consecutive dp x cp ranks of one (tp, pp) coordinate."""
        return [
            run[i : i + self.ep] for run in self.dp_cp_groups() for i in range(0, len(run), self.ep)
        ]

    def edp_groups(self) -> list[list[int]]:
        """Ranks holding the same experts (expert gradients are reduced and the
        distributed optimizer shards them over these): every ``ep``-th dp x cp rank."""
        return [run[i::self.ep] for run in self.dp_cp_groups() for i in range(self.ep)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (tp x pp): ranks that together hold one model replica."""
        return self._over("tp")

    def subgroups(self, pp_ranks: frozenset[int]) -> list[list[int]]:
        """For a set of pipeline ranks (e.g. the holders of a tied weight), the matching
        global-rank group of every (dp, cp, tp) coordinate."""
        return [[self.rank(tp=t, cp=c, dp=d, pp=p) for p in sorted(pp_ranks)]
                for d, c, t in product(range(self.dp), range(self.cp), range(self.tp))]


def group_named(name: str) -> dist.ProcessGroup:
    """The live process group registered as ``name``; a named error once
    ``dist.destroy_process_group()`` destroyed it."""
    try:
        return resolve_process_group(name)
    except RuntimeError as exc:
        raise _destroyed(name) from exc


def _destroyed(name: str) -> GroupDestroyedError:
    return GroupDestroyedError(
        f"process group {name!r} was destroyed (dist.destroy_process_group()): an engine "
        "cannot communicate after it; destroy the process groups after the last step"
    )


def _weakly(group: dist.ProcessGroup | None) -> tuple | None:
    return None if group is None else (weakref.ref(group), group.group_name)


def _strongly(held: tuple | None) -> dist.ProcessGroup | None:
    if held is None:
        return None
    group = held[0]()
    if group is None:
        raise _destroyed(held[1])
    return group


class WeakGroup:
    """An attribute that holds a process group by a weak reference: what fxmeg keeps never
    holds a group alive past ``dist.destroy_process_group()``, and a read after it raises
    ``GroupDestroyedError``.

    That matters at exit. A gloo group's destructor joins its worker threads; a group that
    outlives destroy_process_group() dies (if at all) while Python finalizes. A worker that
    finishes a collective then releases the work's tensors, and since torch 2.10 a tensor's
    C++ count going 2 -> 1 releases its Python object under the GIL; Python ends a thread
    that asks for the GIL during finalization with pthread_exit, whose unwinding through the
    work's destructor aborts the process: "terminate called without an active exception",
    SIGABRT (docs/reliability.md, "Process exit"). Destroyed by destroy_process_group()
    instead, the group joins its workers while Python still runs (torch's binding releases
    the GIL around the destructor)."""

    def __set_name__(self, owner, attr: str) -> None:
        self.key = f"_{attr}_weakly"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return _strongly(obj.__dict__.get(self.key))

    def __set__(self, obj, group: dist.ProcessGroup | None) -> None:
        obj.__dict__[self.key] = _weakly(group)


class WeakGroups(MutableMapping):
    """A dict of process groups (or None) held as ``WeakGroup`` holds one."""

    def __init__(self, groups=()) -> None:
        self._held: dict = {}
        self.update(groups)

    def __getitem__(self, key) -> dist.ProcessGroup | None:
        return _strongly(self._held[key])

    def __setitem__(self, key, group: dist.ProcessGroup | None) -> None:
        self._held[key] = _weakly(group)

    def __delitem__(self, key) -> None:
        del self._held[key]

    def __iter__(self) -> Iterator:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)


@dataclass
class Groups:
    """This rank's process groups, held weakly (``WeakGroup``). ``None`` stands for a group of
    one rank."""

    topo: Topology
    rank: int
    tied: WeakGroups = field(default_factory=WeakGroups)
    """Pipeline-rank set holding a shared parameter -> its group for this rank."""

    pp = WeakGroup()
    dp = WeakGroup()
    tp = WeakGroup()
    mp = WeakGroup()
    cp = WeakGroup()
    dp_cp = WeakGroup()
    """Gradient reduction and optimizer sharding: dp x cp (the dp group when cp=1)."""
    ep = WeakGroup()
    """The ranks splitting the experts (ep > 1)."""
    edp = WeakGroup()
    """Expert gradients' reduction and sharding: the ranks holding the same experts."""
    world = WeakGroup()
    """Every rank: fxmeg's own copy of the default group, which importing
    torch.distributed.nn after init_process_group would keep alive past destroy_process_group
    (its functions capture it as a default argument; ``build_groups`` releases that, but a
    later import by the user's code would capture it again)."""

    twins: WeakGroups = field(default_factory=WeakGroups)
    """'tp', 'cp', 'ep' -> a second group over the same ranks, for a second lane's
    collectives (``build_groups(lanes=True)``; fxmeg/runtime/lanes.py). Empty otherwise."""

    def __post_init__(self) -> None:
        if not isinstance(self.twins, WeakGroups):
            self.twins = WeakGroups(self.twins)
        if not isinstance(self.tied, WeakGroups):
            self.tied = WeakGroups(self.tied)

    def twin_names(self) -> dict[str, str]:
        """Each group that has a twin: its registered name -> the twin's."""
        return {getattr(self, n).group_name: t.group_name for n, t in self.twins.items()}

    @property
    def pp_rank(self) -> int:
        return self.topo.coords(self.rank)[2]

    @property
    def tp_rank(self) -> int:
        return self.topo.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.topo.coords(self.rank)[1]

    @property
    def cp_rank(self) -> int:
        return self.topo.cp_rank(self.rank)

    @property
    def dp_cp_size(self) -> int:
        return self.topo.dp * self.topo.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in its dp x cp group (cp fastest, as the ranks are ordered)."""
        return self.cp_rank + self.topo.cp * self.dp_rank

    @property
    def ep_rank(self) -> int:
        return self.dp_cp_rank % self.topo.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_cp_rank // self.topo.ep

    @property
    def edp_size(self) -> int:
        return self.dp_cp_size // self.topo.ep

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's pipeline."""
        tp, dp, _ = self.topo.coords(self.rank)
        return self.topo.rank(tp=tp, cp=self.cp_rank, dp=dp, pp=pp_rank)


def build_groups(
    topo: Topology, *, tied: list[frozenset[int]] = (), timeout_s: float | None = None,
    lanes: bool = False,
) -> Groups:
    """Create every group in the same order on every rank (new_group is collective);
    their collectives fail after ``timeout_s`` instead of waiting forever. Also releases
    torch.distributed.nn's hold on the default group (``release_world_capture``). With
    ``lanes``, also a twin of each tp, cp and ep group (``Groups.twins``)."""
    if dist.is_initialized():
        release_world_capture()
    if topo.world_size == 1:
        return Groups(topo, 0, tied={s: None for s in tied})
    rank = dist.get_rank()
    groups = Groups(topo, rank)
    for name, layout in (
        ("pp", topo.pp_groups()),
        ("dp", topo.dp_groups()),
        ("tp", topo.tp_groups()),
        ("mp", topo.mp_groups()),
    ):
        setattr(groups, name, _make(layout, rank, timeout_s))
    groups.world = _make([list(range(topo.world_size))], rank, timeout_s)
    groups.dp_cp = groups.dp
    if topo.cp > 1:  # without cp the dp x cp group is the dp group (no extra new_group)
        groups.cp = _make(topo.cp_groups(), rank, timeout_s)
        groups.dp_cp = _make(topo.dp_cp_groups(), rank, timeout_s)
    groups.edp = groups.dp_cp
    if topo.ep > 1:
        groups.ep = _make(topo.ep_groups(), rank, timeout_s)
        groups.edp = _make(topo.edp_groups(), rank, timeout_s)
    for pp_ranks in tied:
        groups.tied[pp_ranks] = _make(topo.subgroups(pp_ranks), rank, timeout_s)
    layouts = {"tp": topo.tp_groups, "cp": topo.cp_groups, "ep": topo.ep_groups}
    for name in layouts if lanes else ():
        if getattr(topo, name) > 1:
            groups.twins[name] = _make(layouts[name](), rank, timeout_s)
    return groups


def _make(layout: list[list[int]], rank: int, timeout_s: float | None) -> dist.ProcessGroup | None:
    mine = None
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    for ranks in layout:
        if len(ranks) == 1:  # every rank skips the same singleton groups
            continue
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> None:
    """In-place all-reduce; nothing to do for a group of one."""
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


# torch 2.13 renamed these (the old names warn); torch >= 2.6 has the old ones only.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_range(start: int, end: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's equal contiguous part [lo, hi) of [start, end)."""
    if group is None:
        return start, end
    size = (end - start) // dist.get_world_size(group)
    lo = start + dist.get_rank(group) * size
    return lo, lo + size


def shard_of(flat: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's equal contiguous part of ``flat`` (all of it for a group of one)."""
    if group is None:
        return flat
    size = flat.numel() // dist.get_world_size(group)
    return flat[dist.get_rank(group) * size :][:size]


def reduce_scatter_(
    flat: torch.Tensor, group: dist.ProcessGroup | None
) -> dist.Work | Works | None:
    """Sum ``flat`` over the group into this rank's shard of it, in place, asynchronously.
    The rest of ``flat`` is scratch afterwards (gloo's reduce writes into it)."""
    if group is None:
        return None
    if _by_parts(group):
        return Works([dist.reduce(part, group_dst=r, group=group, async_op=True)
                      for r, part in enumerate(_parts(flat, group))])
    return _reduce_scatter(shard_of(flat, group), flat, group=group, async_op=True)


def gather_into(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None
) -> dist.Work | None:
    """Fill ``out`` with every rank's ``shard`` in rank order, asynchronously (``shard`` is
    this rank's part; for a group of one, a copy)."""
    if group is None:
        out.copy_(shard)
        return None
    if _by_parts(group):
        shard_of(out, group).copy_(shard)
        return all_gather_(out, group)
    return _all_gather(out, shard, group=group, async_op=True)


def all_gather_(flat: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work | Works | None:
    """Fill ``flat`` with every rank's shard of it, in place, asynchronously."""
    if group is None:
        return None
    if _by_parts(group):
        return Works([dist.broadcast(part, group_src=r, group=group, async_op=True)
                      for r, part in enumerate(_parts(flat, group))])
    return _all_gather(flat, shard_of(flat, group), group=group, async_op=True)


def _parts(flat: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's equal contiguous part of ``flat``, in rank order (see ``shard_of``)."""
    n = dist.get_world_size(group)
    size = flat.numel() // n
    return [flat[r * size :][:size] for r in range(n)]


def _by_parts(group: dist.ProcessGroup) -> bool:
    """Whether the sharded collectives of ``group`` run as one reduce or broadcast per
    rank's part: on gloo, whose reduce-scatter and all-gather copy their whole input
    first (a 16 MiB reduce-scatter over 4 ranks peaks 24-27 MiB above its tensors, an
    all-gather 16 MiB) while its reduce and broadcast work in place, and take about half
    the time (bench/collectives.py measures both). Elsewhere (NCCL) the fused ones."""
    return dist.get_backend(group) == "gloo"


class Works:
    """Several collectives in flight as one: ``wait`` waits for all of them."""

    __slots__ = ("works",)

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        return True
