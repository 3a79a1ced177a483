"""Fixtures shared by the trainer and checkpoint tests; every test (and every rank it
spawns) checks each pass's Ensures after the pass (fxmeg.passes.verify)."""

import os

import pytest

from fxmeg.data import ByteTokenizer, prepare
from fxmeg.data.corpus import read_documents

os.environ["FXMEG_VERIFY"] = "1"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small real-text corpus (Python's pydoc topics, byte tokens); its path prefix."""
    prefix = str(tmp_path_factory.mktemp("data") / "topics")
    prepare(read_documents(["pydoc:topics"]), prefix, ByteTokenizer())
    return prefix
