"""The suite's slow-first order, read from recorded durations (tests/durations.json).

`make test` runs two pytest-xdist workers that each take a whole module at a time
(``--dist loadfile``, in collection order). Starting the longest modules first keeps one
worker from running a long module alone at the end, so tests/conftest.py sorts the modules
by the seconds recorded here, slowest first; a module the file does not know runs after the
known ones, in its usual order.

The file is written by the suite itself: `make durations` runs `make test`'s command with
``--record-durations``, and tests/conftest.py sums each module's setup, call and teardown
seconds (a module's spawn lands in its first test's setup) and rewrites the file when the
run was whole (`whole_run`). docs/contributing.md says when to refresh it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

FILE = Path(__file__).resolve().parents[1] / "durations.json"
"""Where the recorded durations live: ``{"source": how they were measured, "seconds":
{module path: seconds}}``."""


def read(path: Path = FILE) -> dict[str, float]:
    """Module path (``tests/parity/test_zoo.py``) -> recorded seconds; empty without a file."""
    if not path.exists():
        return {}
    return {module: float(s) for module, s in json.loads(path.read_text())["seconds"].items()}


def slowest_first(modules: Iterable[str], seconds: Mapping[str, float]) -> list[str]:
    """``modules`` ordered by recorded ``seconds``, slowest first; modules without a record
    follow, and ties keep their order in ``modules`` (the sort is stable)."""
    modules = list(dict.fromkeys(modules))
    return sorted(modules, key=lambda m: (0, -seconds[m]) if m in seconds else (1, 0.0))


def whole_run(ran: Mapping[str, int], collected: int, on_disk: Iterable[str],
              failed: int = 0) -> str | None:
    """Why a run's durations must not replace the file, or None when they may: every test
    collected ran (``ran``: module -> tests reported; ``collected``: tests collected), every
    test module on disk (``on_disk``) is among those that ran, and none failed (a failed
    spawn ends early: its seconds would mislead)."""
    if failed:
        return f"{failed} tests failed"
    missing = sorted(set(on_disk) - set(ran))
    if missing:
        more = ", ..." if len(missing) > 3 else ""
        return f"{len(missing)} test modules did not run ({', '.join(missing[:3])}{more})"
    if sum(ran.values()) != collected:
        return f"{sum(ran.values())} of {collected} collected tests ran"
    return None


def write(seconds: Mapping[str, float], source: str, path: Path = FILE) -> None:
    """Rewrite the file: slowest first, tenths of a second (a stable, readable diff)."""
    ordered = {m: round(seconds[m], 1) for m in slowest_first(sorted(seconds), seconds)}
    path.write_text(json.dumps({"source": source, "seconds": ordered}, indent=1) + "\n")


def module(nodeid: str) -> str:
    """The module path of a test id: ``tests/parity/test_zoo.py::test_x[a]`` -> its file."""
    return nodeid.split("::")[0]


class Recorder:
    """A pytest plugin (``--record-durations``, in the xdist controller, which receives every
    worker's reports, or in the one process without workers): sums each module's seconds and
    rewrites the file at the end of a whole run."""

    def __init__(self, path: Path = FILE) -> None:
        self.path = path
        self.seconds: Counter[str] = Counter()
        self.ran: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[module(report.nodeid)] += report.duration
        if report.when == "teardown":
            self.ran[module(report.nodeid)] += 1

    def pytest_sessionfinish(self, session) -> None:
        root = Path(str(session.config.rootpath))
        on_disk = [str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")]
        option = session.config.option
        narrowed = [flag for flag, value in (("-k", option.keyword), ("-m", option.markexpr),
                                             ("--deselect", option.deselect)) if value]
        refused = (f"{' '.join(narrowed)} chose some tests" if narrowed
                   else whole_run(self.ran, session.testscollected, on_disk, session.testsfailed))
        if refused:
            print(f"\n{self.path.name} kept: {refused}; --record-durations needs the whole suite")
            return
        workers = session.config.getoption("numprocesses", None) or 0
        source = f"make durations: {len(self.ran)} modules, {workers} xdist workers"
        write(self.seconds, source, self.path)
        print(f"\n{self.path.name} rewritten: {len(self.ran)} modules")
