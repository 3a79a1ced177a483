"""The schedule registry (fxmeg/schedule_registry.py) against its readers: the builders
(each row's rules admit exactly the layouts its builder runs, on its placement), the
configuration (the same refusals, word for word) and docs/parallelism.md's table."""

import itertools
from pathlib import Path

import pytest

from fxmeg import schedule_registry
from fxmeg.config import SCHEDULES, EngineConfig, ParallelConfig
from fxmeg.errors import ConfigError, ScheduleError
from fxmeg.runtime.pipeline import schedules
from fxmeg.runtime.pipeline.schedules import Kind, build, compute_actions, lower
from fxmeg.runtime.pipeline.simulator import simulate
from fxmeg.schedule_registry import SPECS, batch_refusal, layout_refusal, placement

DOC = Path(__file__).resolve().parents[2] / "docs" / "parallelism.md"
LAYOUTS = list(itertools.product(range(1, 5), (1, 2, 3), range(1, 10)))  # pp, vpp, m


def test_every_row_names_a_builder_and_every_builder_has_a_row():
    assert sorted(s.builder for s in SPECS.values()) == sorted(schedules._BUILDERS)
    assert SCHEDULES == ("auto", *SPECS)  # fxmeg.config.SCHEDULES is the registry's


@pytest.mark.parametrize("name", SPECS)
def test_the_rules_admit_what_the_builder_runs(name):
    """Where a row's rules admit (pp, vpp, m), its builder runs every (chunk, micro-batch)
    once forward and once backward (B, or I and W if it splits backward) on the rank the
    placement gives, without deadlock; elsewhere build refuses with the rule's message."""
    spec, split = SPECS[name], set()
    for pp, vpp, m in LAYOUTS:
        refusal = layout_refusal(name, pp=pp, vpp=vpp) or batch_refusal(name, pp=pp, m=m)
        if refusal:
            with pytest.raises(ScheduleError) as err:
                build(name, pp=pp, vpp=vpp, m=m)
            assert str(err.value) == refusal
            continue
        sched, where = build(name, pp=pp, vpp=vpp, m=m), placement(name, pp=pp, vpp=vpp)
        for rank in range(pp):
            passes = sorted((a.chunk, a.mb, k) for a in compute_actions(sched, rank)
                            for k in ("IW" if a.kind is Kind.B else a.kind.value))
            mine = [c for c in range(pp * vpp) if where[c] == rank]
            assert passes == sorted((c, i, k) for c in mine for i in range(m) for k in "FIW"), (
                pp,
                vpp,
                m,
            )
        split.add(any(a.kind is Kind.I for r in sched for a in compute_actions(sched, r)))
        simulate(lower(sched, num_chunks=pp * vpp, placement=where), pp=pp, placement=where)
    assert split == {spec.splits_backward}, "splits_backward disagrees with the builder"


@pytest.mark.parametrize("name", SCHEDULES)
def test_config_refuses_what_the_builder_refuses_in_the_same_words(name):
    for pp, vpp, m in LAYOUTS:
        refusal = layout_refusal(name, pp=pp, vpp=vpp)
        if refusal is None:
            par = ParallelConfig(pp=pp, vpp=vpp, schedule=name, dp=1)
            origin = f" (global_batch_size={m} / (micro_batch_size * dp))"
            refusal = batch_refusal(par.resolved_schedule, pp=pp, m=m, origin=origin)
            if refusal is None:
                EngineConfig(micro_batch_size=1, global_batch_size=m, parallel=par)
                continue
            with pytest.raises(ConfigError) as err:
                EngineConfig(micro_batch_size=1, global_batch_size=m, parallel=par)
            assert str(err.value) == refusal
            continue
        with pytest.raises(ConfigError) as err:
            ParallelConfig(pp=pp, vpp=vpp, schedule=name)
        assert str(err.value) == refusal


def test_auto_picks_none_1f1b_or_interleaved():
    assert [
        ParallelConfig(pp=pp, vpp=vpp).resolved_schedule
        for pp, vpp in ((1, 1), (2, 1), (2, 2), (3, 3))
    ] == ["none", "1f1b", "interleaved", "interleaved"]


def _doc_table() -> list[tuple[str, ...]]:
    lines = DOC.read_text().splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("| schedule | chunks on ranks |")
    )
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(tuple(cell.strip() for cell in line.strip().strip("|").split("|")))
    return rows


def test_the_docs_table_is_the_registry_row_for_row():
    want = schedule_registry.table_rows()
    printed = "\n".join("| " + " | ".join(row) + " |" for row in want)
    assert _doc_table() == want, f"docs/parallelism.md's schedule table should read:\n{printed}"
