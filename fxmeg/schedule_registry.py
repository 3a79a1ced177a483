"""The pipeline schedules, one row each: every fact about a schedule except the order of
its actions.

A row (``Spec``) gives the schedule's name, the function that builds it, where its chunks
sit on the pipeline ranks, its rules on vpp, pp and the micro-batch count m, whether it
splits backward into input- and weight-gradient work (zero bubble), and whether 'auto'
may pick it. Every reader takes these facts from here: ``ParallelConfig`` (the name, the
vpp and pp rules, 'auto', the placement, ``splits_backward``), ``EngineConfig``'s batch
check and ``fxmeg.runtime.pipeline.schedules.build`` (the same refusals, written once below:
``layout_refusal`` and ``batch_refusal``), the partition pass (a V placement) and
docs/parallelism.md's schedule table (tests/config/test_schedule_registry.py checks it row for
row against ``table_rows``).

Adding a schedule:
  1. one ``Spec`` in ``SPECS`` below (a new kind of rule: a field, and its line in
     ``layout_refusal`` or ``batch_refusal``);
  2. its builder in fxmeg/runtime/pipeline/schedules.py, named by the row's ``builder``: a pure
     function ``(pp, vpp, m) -> Schedule`` (tests/config/test_schedule_registry.py checks
     that every row names one);
  3. its row in docs/parallelism.md's table (the test prints the row it expects).
The simulator grids (tests/runtime/test_schedules.py, test_schedules_zero_bubble.py) then
say whether it deadlocks.

Imports nothing of fxmeg but the errors: config, the passes and the runtime all read it,
and the passes never reach the runtime, so a row names its builder rather than holding it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxmeg.errors import closest


@dataclass(frozen=True)
class Spec:
    """One pipeline schedule's facts."""

    name: str
    """As given to ``schedule=`` / ``--schedule``."""
    builder: str
    """The function of fxmeg.runtime.pipeline.schedules that builds it: ``(pp, vpp, m) ->
    Schedule``."""
    placement: str = "loop"
    """Chunk c's pipeline rank: 'loop', c % pp (Megatron's interleaving); 'v', down the
    ranks and back up (c for c < pp, else 2 * pp - 1 - c: ZB-V, DualPipeV)."""
    vpp: str = "1"
    """Chunks per pipeline rank: '1', '>1' or '2'."""
    pp: str = "any"
    """Pipeline ranks: '1', '>1' or 'any'."""
    m_multiple_of_pp: bool = False
    """The micro-batch count m must be a multiple of pp (pp, 2 * pp, ...)."""
    m_min_per_pp: int = 0
    """m must be at least this many times pp."""
    m_fallback: str = ""
    """The schedule a refusal of m suggests instead ('' for none)."""
    splits_backward: bool = False
    """Each backward runs as I (input gradient) and W (weight gradients) actions."""
    auto: bool = False
    """'auto' picks the first such schedule whose vpp and pp rules the layout meets."""


SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("none", "_none", pp="1", auto=True),
        Spec("gpipe", "_gpipe"),
        Spec("1f1b", "_one_f_one_b", auto=True),
        # Megatron's interleaved schedule runs micro-batches in groups of pp per chunk
        Spec("interleaved", "_interleaved", vpp=">1", pp=">1", m_multiple_of_pp=True, auto=True),
        Spec("zbh1", "_zbh1", pp=">1", splits_backward=True),
        Spec("zbv", "_zbv", placement="v", vpp="2", pp=">1", splits_backward=True),
        # DeepSeek's DualPipe: at least one micro-batch per chunk (2 * pp) fills its V
        Spec(
            "dualpipev",
            "_dualpipev",
            placement="v",
            vpp="2",
            pp=">1",
            m_min_per_pp=2,
            m_fallback="zbv",
            splits_backward=True,
        ),
    )
}
"""The schedules by name, in the order the docs and messages list them."""

SCHEDULES = ("auto", *SPECS)
"""Every accepted ``schedule=`` value."""
V_SCHEDULES = tuple(n for n, s in SPECS.items() if s.placement == "v")
"""Schedules that place two chunks per rank in a V (see ``placement``)."""
ZERO_BUBBLE = tuple(n for n, s in SPECS.items() if s.splits_backward)
"""Schedules that run each backward as input-gradient (I) and weight-gradient (W) work."""


def _holds(rule: str, value: int) -> bool:
    return {"any": True, "1": value == 1, ">1": value > 1, "2": value == 2}[rule]


def resolve(name: str, *, pp: int, vpp: int) -> str:
    """The schedule ``name`` stands for: itself, or for 'auto' the first ``auto`` row whose
    vpp and pp rules hold (none at pp=1, 1f1b at vpp=1, else interleaved)."""
    if name != "auto":
        return name
    return next(
        s.name for s in SPECS.values() if s.auto and _holds(s.vpp, vpp) and _holds(s.pp, pp)
    )


def placement(name: str, *, pp: int, vpp: int) -> tuple[int, ...]:
    """The pipeline rank of each of the pp * vpp chunks under schedule ``name`` (resolved):
    round robin (chunk c on rank c % pp: Megatron's interleaving), or for a V placement
    two chunks per rank down the ranks and back up (chunk c on rank c for c < pp, else on
    2 * pp - 1 - c): the first and the last chunk share rank 0, chunks pp - 1 and pp share
    rank pp - 1 (ZB-V, DualPipeV)."""
    if SPECS[name].placement == "v":
        assert vpp == 2, vpp  # layout_refusal refuses other vpp
        return tuple(c if c < pp else 2 * pp - 1 - c for c in range(2 * pp))
    return tuple(c % pp for c in range(pp * vpp))


def _either(names) -> str:
    """'a', 'b' or 'c'."""
    quoted = [repr(n) for n in names]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else quoted[0]


def layout_refusal(name: str, *, pp: int, vpp: int) -> str | None:
    """Why schedule ``name`` cannot run at this pp and vpp (the message, naming the
    numbers and the fix), or None when it can."""
    if name not in SCHEDULES:
        return f"schedule={name!r} is not one of {SCHEDULES}" + closest(name, SCHEDULES)
    if vpp > 1 and pp == 1:
        return f"vpp={vpp} needs pp > 1; set pp >= 2 or vpp=1"
    if name == "auto":
        return None
    spec = SPECS[name]
    if spec.vpp == "2" and not (vpp == 2 and _holds(spec.pp, pp)):
        shape = " in a V" if spec.placement == "v" else ""
        return (
            f"schedule={name!r} runs two chunks per pipeline rank{shape}: it needs vpp=2 and pp > "
            f"1; got vpp={vpp}, pp={pp}. Set vpp=2 (and pp >= 2)"
        )
    if spec.vpp == "1" and vpp > 1:
        takers = [n for n, s in SPECS.items() if s.vpp != "1"]
        return (
            f"vpp={vpp} runs only with schedule={_either(takers)} (got {name!r}); set vpp=1 or "
            "change the schedule"
        )
    if spec.vpp == ">1" and vpp == 1:
        return f"schedule={name!r} needs vpp > 1; set vpp=2 or use '1f1b'"
    if spec.pp == ">1" and pp == 1:
        return f"schedule={name!r} needs pp > 1; set pp >= 2 or schedule='none'"
    if spec.pp == "1" and pp > 1:
        return (
            f"schedule={name!r} runs without a pipeline; got pp={pp}. Set pp=1, or schedule='auto'"
        )
    return None


def batch_refusal(name: str, *, pp: int, m: int, origin: str = "") -> str | None:
    """Why schedule ``name`` (resolved) cannot run ``m`` micro-batches on ``pp`` pipeline
    ranks, or None. ``origin`` says where m came from, e.g. ' (global_batch_size=12 /
    (micro_batch_size * dp))'."""
    spec = SPECS[name]
    if spec.m_multiple_of_pp and (m < pp or m % pp):
        return (
            f"the {name} schedule needs the micro-batch count m to be a multiple of pp={pp}; got "
            f"m={m}{origin}. Choose global_batch_size so that m is one of "
            f"{[pp * i for i in (1, 2, 3)]}"
        )
    least = spec.m_min_per_pp * pp
    if m < least:
        instead = f", or schedule={spec.m_fallback!r}" if spec.m_fallback else ""
        return (
            f"the {name} schedule needs at least {spec.m_min_per_pp} * pp = {least} micro-batches; "
            f"got m={m}{origin}. Choose global_batch_size so that m >= {least}{instead}"
        )
    return None


def _rule_text(rule: str) -> str:
    return {"any": "any", "1": "1", ">1": "> 1", "2": "2"}[rule]


def table_rows() -> list[tuple[str, ...]]:
    """docs/parallelism.md's schedule table, one row of cells per schedule: name, chunk
    placement, vpp, pp, micro-batches m, backward, picked by 'auto'."""
    rows = []
    for s in SPECS.values():
        m = (
            "a multiple of pp"
            if s.m_multiple_of_pp
            else f">= {s.m_min_per_pp} * pp"
            if s.m_min_per_pp
            else "any"
        )
        rows.append(
            (
                f"`{s.name}`",
                "V" if s.placement == "v" else "round robin",
                _rule_text(s.vpp),
                _rule_text(s.pp),
                m,
                "I + W" if s.splits_backward else "whole",
                "yes" if s.auto else "",
            )
        )
    return rows
