"""Replicas that provably agree (docs/architecture.md §3, "Replicas that agree").

Every rank builds (or reads) its own copy of the model, so nothing but the caller's
seeding makes copies that must be equal actually equal. Three kinds of ranks hold the
same values of a trainable parameter (and of the frozen parameters and buffers of the same
chunks, checked over tp and dp alike):

* ``tp``: the ranks of a tensor-parallel group, for a parameter tp does not split (a
  norm's weight); at start-up, with the user's model, also the full tensor each rank
  cuts its shard of a split parameter from (a differently seeded tp rank shows there:
  the norms it replicates are usually ones);
* ``dp``: the ranks of a data-parallel group (the same shards of the same parameters);
* ``tied``: the pipeline ranks holding a tied weight (the same (dp, tp) coordinate);
* ``edp``: for a bank of routed experts under expert parallelism, the ranks holding the
  same experts (each ep rank holds others: they are left out of ``dp``).

``agree`` hashes each parameter (``tensor_hash``), compares every rank's hashes with its
group's first rank's (one broadcast of an (n, 2) int64 tensor per group), then spreads
the first difference to every rank (one all-gather of three numbers per rank over the
world), so every rank raises the same ReplicaError, naming the parameter and the ranks.
With ``broadcast=True`` the group's first rank's values are copied to the others first,
tp, then dp, then tied, so every replica ends up with the values of data-parallel rank 0's
tensor-parallel rank 0 (Megatron: ``broadcast_params``, ``--data-parallel-random-init``;
its check, ``check_param_hashes_across_dp_replicas``, hashes each parameter with sha256 on
the host).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxmeg.errors import ReplicaError
from fxmeg.ir.layouts import ParamLayout, is_split
from fxmeg.ir.program import Program
from fxmeg.runtime.groups import Groups, all_gather_
from fxmeg.weights.sharding import tp_shard

KINDS = ("tp", "dp", "tied", "edp")
"""The order of the checks, of the broadcasts (``_plan``) and of the report. tp first: a
tp broadcast re-cuts shards from the first tp rank's full tensor, which no dp broadcast
touched, so dp must copy those shards after it."""
PATTERN = 1 << 16
"""The weights of ``tensor_hash`` repeat every this many 16-bit words."""
BLOCK = 1 << 24
"""Words hashed at once: bounds the int32 temporary to 64 MiB."""
MISSING = (-(1 << 62), 0)
"""The hash of nothing (a split parameter whose full tensor this rank never had): a word
sum below -2^62 needs more than 2^47 words."""


@dataclass(frozen=True)
class Held:
    """One trainable parameter as this rank holds it."""

    tensors: tuple[torch.Tensor, ...]
    """The parameter and, at start-up in half precision, its fp32 master: what a broadcast
    writes. The last is hashed (the master decides the parameter, its cast)."""
    whole: tuple[torch.Tensor, ...] = ()
    """At start-up, a tp-split parameter cut from the user's model: the full tensors the
    shards in ``tensors`` were cut from (aligned with them)."""


def tensor_hash(t: torch.Tensor, pattern: torch.Tensor | None = None) -> torch.Tensor:
    """(2,) int64 on ``t``'s device: the sum of ``t``'s bytes read as int16 words x_i, and
    sum(x_i * c_i) with fixed weights c_i (``hash_pattern``). Integer sums are exact, so
    the hash does not depend on the reduction order (threads, device, kernel): identical
    bits give identical hashes on any rank (a float sum would not, and could round a
    one-ulp change away). A change of one element of a 16- or 32-bit tensor always
    changes it: its one or two words change by (d, e) != 0; if d + e != 0 the first sum
    moves, else the second moves by d * (c_i - c_(i+1)) != 0 (neighbouring weights
    differ). Any other difference goes unseen only if both sums happen to coincide."""
    flat = t.detach().contiguous().reshape(-1)
    words = (
        flat.view(torch.uint8).to(torch.int16)
        if flat.element_size() == 1
        else flat.view(torch.int16)
    )
    assert words.numel() < 1 << 33, words.numel()  # keeps both int64 sums exact
    c = hash_pattern(t.device) if pattern is None else pattern
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    for lo in range(0, words.numel(), BLOCK):  # BLOCK is a multiple of PATTERN: c_i stays aligned
        part = words[lo : lo + BLOCK]
        x = torch.empty(-(-part.numel() // PATTERN) * PATTERN, dtype=torch.int32, device=t.device)
        x[: part.numel()] = part
        x[part.numel() :] = 0  # padding adds nothing
        # int32 partial sums over short rows stay exact (|x| <= 2^15, c < 2^7) and are
        # much faster than summing into int64 directly; the few row sums go to int64
        plain = x.view(-1, 1 << 15).sum(1, dtype=torch.int32).sum()
        weighted = x.view(-1, PATTERN).mul_(c).view(-1, 256).sum(1, dtype=torch.int32).sum()
        total += torch.stack([plain, weighted])
    return total


def hash_pattern(device: torch.device | str) -> torch.Tensor:
    """(PATTERN,) int32 weights in [1, 2^7): a multiplicative hash of the index (Knuth's
    2654435761), 2 mod 4 at even and 1 mod 4 at odd indices, so neighbours differ."""
    i = torch.arange(PATTERN, dtype=torch.int64, device=device)
    mixed = (i * 2654435761) % (1 << 32) >> 25  # the top 7 bits
    return ((mixed & 0x7C) + 2 - (i & 1)).to(torch.int32)


def checked_names(program: Program) -> list[str]:
    """What replicas must agree on, in the order checks and errors use: the trainable
    parameters (the Program's order), then the state the chunks read and nobody trains
    (frozen parameters, buffers: a rotary table, a frozen base weight under adapters),
    in chunk order."""
    out = dict.fromkeys(program.parameters)
    for gm in program.chunks:
        out.update(dict.fromkeys(n for n, p in gm.named_parameters() if not p.requires_grad))
        out.update(dict.fromkeys(n for n, _ in gm.named_buffers()))
    return list(out)


def _state(chunks) -> dict[str, Held]:
    """This rank's chunks' frozen parameters and buffers, each once."""
    out = {}
    for gm in chunks.values():
        out.update((n, Held((p,))) for n, p in gm.named_parameters() if not p.requires_grad)
        out.update((n, Held((b,))) for n, b in gm.named_buffers())
    return out


def at_start(program: Program, chunks, masters: Mapping[str, torch.Tensor],
             local: Mapping[str, torch.Tensor]) -> dict[str, Held]:
    """What this rank holds right after its tensors are made (``build_context``), in the
    order of ``checked_names``: each parameter with its fp32 master, and for a tp-split one cut
    from the user's tensor (not from weights or an initialisation: ``local``) the user's
    full tensor and full master; then its frozen parameters and buffers."""
    params = {n: p for gm in chunks.values() for n, p in gm.named_parameters() if p.requires_grad}
    out = {}
    for name, user in program.parameters.items():
        if name not in params:
            continue
        spec = program.tp_specs.get(name)
        tensors = (params[name], masters[name]) if name in masters else (params[name],)
        whole = ()
        if _split(spec) and name not in local and not user.is_meta:
            whole = (user, program.master_values[name]) if name in masters else (user,)
        out[name] = Held(tensors, whole)
    return out | _state(chunks)


def now(program: Program, named: Mapping[str, torch.Tensor], chunks) -> dict[str, Held]:
    """What this rank holds during training: its parameters in the Program's order, then
    its frozen parameters and buffers."""
    return {n: Held((named[n],)) for n in program.parameters if n in named} | _state(chunks)


@torch.no_grad()
def agree(program: Program, groups: Groups, held: Mapping[str, Held], *, device: torch.device,
          broadcast: bool = False, step: int | None = None) -> None:
    """Check (after copying the first replica's values, with ``broadcast``) that every
    rank holds what its tp, dp and tied peers hold; raise ReplicaError on every rank
    otherwise, naming the first differing parameter in the Program's order and the
    ranks. ``step``: the check before that training step (None: at start-up).
    Collective: every rank calls it."""
    if groups.topo.world_size == 1:
        return
    plan = _plan(program, groups, held)
    if broadcast:
        _broadcast(program, groups, held, plan)
    order = {n: i for i, n in enumerate(checked_names(program))}
    memo: dict[int, torch.Tensor] = {}
    pattern = hash_pattern(device)
    # per kind: the first parameter (Program index) unlike the group's first rank
    codes = [-1] * len(KINDS)
    for kind, group, names in plan:
        mine = torch.stack(
            [
                _hash(_compared(kind, program.tp_specs.get(n), held[n]), memo, pattern, device)
                for n in names
            ]
        )  # (len(names), 2)
        first = mine.clone()
        dist.broadcast(first, dist.get_global_rank(group, 0), group=group)
        differs = (mine != first).any(-1).nonzero().flatten().tolist()
        if differs:
            k = KINDS.index(kind)
            codes[k] = min(i for i in (codes[k], order[names[differs[0]]]) if i >= 0)
    table = torch.empty(groups.topo.world_size * len(KINDS), dtype=torch.int64, device=device)
    table[groups.rank * len(KINDS) :][: len(KINDS)] = torch.tensor(codes)
    work = all_gather_(table, groups.world)
    if work is not None:
        work.wait()
    rows = table.view(-1, len(KINDS)).tolist()
    if any(i >= 0 for row in rows for i in row):
        raise _error(program, groups, rows, step)


def _plan(program: Program, groups: Groups,
          held: Mapping[str, Held]) -> list[tuple[str, dist.ProcessGroup, list[str]]]:
    """(kind, group, parameter names) for each of this rank's groups of more than one
    rank, in KINDS order; the names are the same, in the same order, on every rank of
    a group."""
    every = list(held)
    plan = []
    if groups.tp is not None and every:
        plan.append(("tp", groups.tp, every))
    dense = [n for n in every if n not in program.ep_specs]
    if groups.dp_cp is not None and dense:  # context-parallel ranks hold replicas too
        plan.append(("dp", groups.dp_cp, dense))
    for holders, group in sorted(groups.tied.items(), key=lambda kv: sorted(kv[0])):
        tied = [
            n for n in every if n in program.holders and frozenset(program.holders[n]) == holders
        ]
        if group is not None and tied:
            plan.append(("tied", group, tied))
    experts = [n for n in every if n in program.ep_specs]  # other experts on each ep rank
    if groups.edp is not None and experts:
        plan.append(("edp", groups.edp, experts))
    return plan


def _split(spec: ParamLayout | None) -> bool:
    return is_split(spec)


def _compared(kind: str, spec: ParamLayout | None, held: Held) -> torch.Tensor | None:
    """The tensor compared for ``kind``: over tp, a split parameter's full tensor (None
    when this rank has none); else this rank's own value."""
    if kind == "tp" and _split(spec):
        return held.whole[-1] if held.whole else None
    return held.tensors[-1]


def _hash(t: torch.Tensor | None, memo: dict[int, torch.Tensor], pattern: torch.Tensor,
          device: torch.device) -> torch.Tensor:
    """``tensor_hash`` on ``device``, once per tensor (dp and tied compare the same ones)."""
    if t is None:
        return torch.tensor(MISSING, dtype=torch.int64, device=device)
    if id(t) not in memo:
        memo[id(t)] = tensor_hash(t, pattern if t.device == pattern.device else None).to(device)
    return memo[id(t)]


def _broadcast(program: Program, groups: Groups, held: Mapping[str, Held], plan) -> None:
    """Copy each group's first rank's values to the others, in KINDS order. A tp-split
    parameter: its full tensors, then each rank cuts its shard again; one with no full
    tensor (made from weights or an initialisation, the same on every tp rank) is left."""
    tp, tp_rank = groups.topo.tp, groups.tp_rank
    for kind, group, names in plan:
        src = dist.get_global_rank(group, 0)
        for name in names:
            h, spec = held[name], program.tp_specs.get(name)
            if kind == "tp" and _split(spec):
                for shard, whole in zip(h.tensors, h.whole):
                    dist.broadcast(whole.detach(), src, group=group)
                    shard.detach().copy_(tp_shard(whole, spec, tp, tp_rank))
            else:
                for t in h.tensors:
                    dist.broadcast(_wire(t), src, group=group)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a broadcast may write it (bool buffers as bytes: gloo has no bool)."""
    return t.detach().view(torch.uint8) if t.dtype == torch.bool else t.detach()


_BETWEEN = {
    "tp": "between tensor-parallel ranks (it is replicated over tp)",
    "dp": "between data-parallel replicas",
    "tied": "between the pipeline ranks holding this tied weight",
    "edp": "between the ranks holding the same experts",
}


def _error(
    program: Program, groups: Groups, rows: list[list[int]], step: int | None
) -> ReplicaError:
    """The error every rank raises: the first differing parameter in the Program's order
    and, for each kind of group where it differs, each rank holding it differently and
    the rank it was compared with (its group's first): a rank named in several of them
    is the odd one out."""
    index = min(i for row in rows for i in row if i >= 0)
    name = checked_names(program)[index]
    pairs, parts = [], []
    for k, kind in enumerate(KINDS):
        mine = [(r, _first_of_group(program, groups, kind, name, r))
                for r, row in enumerate(rows) if row[k] == index]
        if mine:
            between = _BETWEEN[kind]
            if kind == "tp" and _split(program.tp_specs.get(name)):
                between = (
                    "between tensor-parallel ranks (in the full tensor their shards are cut from)"
                )
            parts.append(
                f"{between}: "
                + "; ".join(f"rank {r} holds other values than rank {s}" for r, s in mine)
            )
            pairs += mine
    what = f"{name!r} differs " + ", and ".join(parts)
    if step is None:
        return ReplicaError(
            f"replicas differ at start-up: {what}. They would train diverging models. Make every "
            "rank start from the same weights: seed every rank identically before building the "
            "model (torch.manual_seed(seed) with one seed on every rank), or pass "
            "broadcast_params=True to copy the first replica's values to the others",
            parameter=name, ranks=pairs)
    return ReplicaError(
        f"replicas drifted before train step {step} of this engine: {what}. Replicas are "
        "updated identically, so a rank's parameters were changed outside the engine (an "
        "in-place write, weights or a checkpoint loaded on some ranks only) or a rank computes "
        "differently (a faulty device). Resume from the last checkpoint saved while they agreed",
        parameter=name, ranks=pairs)


def _first_of_group(program: Program, groups: Groups, kind: str, name: str, rank: int) -> int:
    """The global rank ``rank`` was compared with: the first of its ``kind`` group."""
    tp, dp, pp = groups.topo.coords(rank)
    cp = groups.topo.cp_rank(rank)
    if kind == "tp":
        return groups.topo.rank(tp=0, dp=dp, pp=pp, cp=cp)
    if kind == "dp":  # the dp x cp group
        return groups.topo.rank(tp=tp, dp=0, pp=pp, cp=0)
    if kind == "edp":  # the first dp x cp rank with the same ep rank
        q = groups.topo.cp_rank(rank) + groups.topo.cp * dp
        first = q % groups.topo.ep
        return groups.topo.rank(tp=tp, dp=first // groups.topo.cp, pp=pp, cp=first % groups.topo.cp)
    return groups.topo.rank(tp=tp, dp=dp, pp=min(program.holders[name]), cp=cp)
