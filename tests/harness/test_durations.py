"""The slow-first order (tests/harness/durations.py): known modules by recorded seconds,
unknown ones after them in their usual order, the file's round trip, and which runs may
rewrite it."""

import json

from tests.harness import durations


def test_known_modules_run_slowest_first_and_unknown_ones_after_in_their_order():
    collected = ["tests/a.py", "tests/b.py", "tests/c.py", "tests/d.py", "tests/e.py"]
    seconds = {"tests/d.py": 5.0, "tests/b.py": 90.0, "tests/gone.py": 500.0}
    order = durations.slowest_first(collected, seconds)
    assert order == ["tests/b.py", "tests/d.py", "tests/a.py", "tests/c.py", "tests/e.py"]


def test_ties_and_repeats_keep_the_collection_order():
    collected = ["tests/x.py", "tests/y.py", "tests/x.py", "tests/z.py", "tests/y.py"]
    order = durations.slowest_first(collected, {"tests/z.py": 3.0, "tests/y.py": 3.0})
    assert order == ["tests/y.py", "tests/z.py", "tests/x.py"]
    assert durations.slowest_first(collected, {}) == ["tests/x.py", "tests/y.py", "tests/z.py"]


def test_the_file_round_trips_slowest_first_in_tenths(tmp_path):
    path = tmp_path / "durations.json"
    assert durations.read(path) == {}
    durations.write({"tests/a.py": 1.04, "tests/b.py": 7.36}, "by hand", path)
    assert list(json.loads(path.read_text())["seconds"]) == ["tests/b.py", "tests/a.py"]
    assert durations.read(path) == {"tests/b.py": 7.4, "tests/a.py": 1.0}


def test_only_a_run_of_every_test_of_every_module_may_rewrite_it():
    on_disk = ["tests/a.py", "tests/b.py"]
    assert durations.whole_run({"tests/a.py": 2, "tests/b.py": 3}, 5, on_disk) is None
    assert "tests/b.py" in durations.whole_run({"tests/a.py": 2}, 2, on_disk)  # a subset
    assert "4 of 5" in durations.whole_run({"tests/a.py": 1, "tests/b.py": 3}, 5, on_disk)  # -x
    assert "1 tests failed" in durations.whole_run(
        {"tests/a.py": 2, "tests/b.py": 3}, 5, on_disk, 1
    )


def test_the_committed_file_names_only_modules_that_exist():
    root = durations.FILE.parents[1]
    recorded = durations.read()
    assert recorded, "tests/durations.json is missing or empty: run make durations"
    gone = [m for m in recorded if not (root / m).is_file()]
    assert not gone, f"tests/durations.json names {gone}: rename them there or run make durations"
