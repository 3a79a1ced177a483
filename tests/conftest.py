"""Fixtures shared by the trainer and checkpoint tests; every test (and, in a spawn, the rank
that transforms: tests/harness/shared_transform.py) checks each pass's Ensures after the pass
(fxmeg.passes.verify)."""

import gc
import os

import pytest

from fxmeg.data import ByteTokenizer, prepare
from fxmeg.data.corpus import read_documents

os.environ["FXMEG_VERIFY"] = "1"

SLOWEST_FIRST = (
    "tests/parity/test_expert_parallel.py", "tests/parity/test_zoo.py", "tests/train/test_cli.py",
    "tests/repo/test_docs.py", "tests/parity/test_zoo_axes.py", "tests/parity/test_context_parallel.py",
    "tests/parity/test_hugging_face.py", "tests/parity/test_mixed_precision.py",
    "tests/parity/test_variable_lengths.py", "tests/repo/test_examples.py", "tests/parity/test_zero_bubble.py",
    "tests/parity/test_pipeline.py", "tests/parity/test_tensor_parallel.py", "tests/parity/test_checkpoint.py",
)
"""The modules that take longest (wall time under `make test`'s two workers, 2 cores), slowest
first: each worker takes a whole module at a time (``--dist loadfile``), and starting the
longest ones first keeps one worker from running a long module alone at the end. Only an
order: a module missing here runs after these, in its usual order."""


def pytest_collection_modifyitems(config, items):
    first = {module: i for i, module in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable


def pytest_collection_finish(session):
    """Every module is imported: freeze what exists, so the garbage collections the tests
    cause (fxmeg collects once per engine it builds, runtime/release.py) skip the
    interpreter's imports instead of walking them each time (tests/harness/distributed.py does the
    same in each rank)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small real-text corpus (Python's pydoc topics, byte tokens); its path prefix."""
    prefix = str(tmp_path_factory.mktemp("data") / "topics")
    prepare(read_documents(["pydoc:topics"]), prefix, ByteTokenizer())
    return prefix
