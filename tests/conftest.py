"""Fixtures shared by the trainer and checkpoint tests; every test (and, in a spawn, the rank
that transforms: tests/harness/shared_transform.py) checks each pass's Ensures after the pass
(fxmeg.passes.verify)."""

import gc
import os

import pytest

from fxmeg.data.corpus import prepare, read_documents
from fxmeg.data.tokenizer import ByteTokenizer
from tests.harness import durations

os.environ["FXMEG_VERIFY"] = "1"


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="rewrite tests/durations.json from this run if it ran every test "
                          "(make durations)")


def pytest_collection_modifyitems(config, items):
    """Slowest modules first, by tests/durations.json (tests/harness/durations.py)."""
    modules = [durations.module(item.nodeid) for item in items]
    rank = {m: i for i, m in enumerate(durations.slowest_first(modules, durations.read()))}
    items.sort(key=lambda item: rank[durations.module(item.nodeid)])  # stable within a module


def pytest_configure(config):
    if config.getoption("record_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(durations.Recorder(), "fxmeg-record-durations")


def pytest_collection_finish(session):
    """Every module is imported: freeze what exists, so the garbage collections the tests
    cause (fxmeg collects once per engine it builds, runtime/release.py) skip the
    interpreter's imports instead of walking them each time (tests/harness/distributed.py
    does the same in each rank)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small real-text corpus (Python's pydoc topics, byte tokens); its path prefix."""
    prefix = str(tmp_path_factory.mktemp("data") / "topics")
    prepare(read_documents(["pydoc:topics"]), prefix, ByteTokenizer())
    return prefix
