"""Where the test suite's time goes: a pytest plugin that records, per test, its wall time
and the CPU seconds of the test process and of the children it reaped (a spawn's ranks are
reaped when it joins), appending one JSON line per test to ``$TEST_CPU_OUT``
(default ``test_cpu.jsonl``); run as a script, it sums them by module.

CPU seconds are what a loaded machine does not inflate: they rank spawns fairly while
other work runs. pytest's ``--durations`` gives wall time only, and a module's spawn
lands in its first test's setup.

Usage:
  PYTHONPATH=.:tools python -m pytest tests -p test_cpu     # records test_cpu.jsonl
  python tools/test_cpu.py [test_cpu.jsonl] [N]             # the N costliest modules"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

import pytest


def _cpu() -> float:
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.monotonic()
    yield
    row = {"id": item.nodeid, "cpu": _cpu() - cpu, "wall": time.monotonic() - wall}
    with open(os.environ.get("TEST_CPU_OUT", "test_cpu.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def main(path: str = "test_cpu.jsonl", n: int = 30) -> None:
    cpu, wall, tests = collections.Counter(), collections.Counter(), collections.Counter()
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            module = row["id"].split("::")[0]
            cpu[module] += row["cpu"]
            wall[module] += row["wall"]
            tests[module] += 1
    print(f"{len(cpu)} modules, {sum(tests.values())} tests: {sum(cpu.values()):.0f} CPU s, "
          f"{sum(wall.values()):.0f} s wall")
    for module, seconds in cpu.most_common(n):
        print(f"{seconds:8.1f} CPU s {wall[module]:8.1f} s wall {tests[module]:5d} tests  {module}")


if __name__ == "__main__":
    main(*sys.argv[1:2], *(int(a) for a in sys.argv[2:3]))
