"""Every bad input of docs/errors.md is refused with an FxmegError that names the cause,
on real ranks, before any process group or collective (every public function of
torch.distributed that sends or makes a group is counted: COUNTED)."""

from __future__ import annotations

import os
import re
import types

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import fxmeg
from tests.harness.distributed import run_world
from tests.repo.refusals import ROWS, SET_UP

SENDS_NOTHING = {
    "supports_complex": "whether a reduce op takes complex tensors",
    "record_comm": "a context manager naming the collectives inside it for the profiler",
}
"""Public functions of torch.distributed that are neither collectives, point-to-point sends
nor group set-up, besides the ``get_*`` and ``is_*`` queries; each with what it does."""
COUNTED = sorted(
    name
    for name in c10d.__all__
    # type(), not inspect: reading the deprecated ``reduce_op`` as an object warns
    if type(getattr(c10d, name)) in (types.FunctionType, types.BuiltinFunctionType)
    and not name.startswith(("get_", "is_"))
    and name not in SENDS_NOTHING
)
"""Every other public function of torch.distributed, as torch lists it (a new one is counted
unless named above): collectives and their object and coalesced forms, sends and receives,
and what makes or ends a process group."""


def run(rank: int) -> dict:
    counts = {name: 0 for name in COUNTED}
    for name in COUNTED:
        original = getattr(c10d, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        # torch.distributed re-exports c10d's functions: a call through either is counted
        setattr(dist, name, counted)
        setattr(c10d, name, counted)
    out = {}
    for row, (make, _) in {**ROWS, **SET_UP}.items():
        call = make() if row in SET_UP else make
        for name in counts:
            counts[name] = 0
        try:
            call()
            out[row] = ("no error", {})
        except fxmeg.FxmegError as err:
            out[row] = (str(err), {k: v for k, v in counts.items() if v})
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(2, run)


@pytest.mark.parametrize("row", list(ROWS) + list(SET_UP))
def test_refused_with_its_cause_before_any_collective(results, row):
    expected = {**ROWS, **SET_UP}[row][1]
    for rank in results:
        message, calls = rank[row]
        assert expected in message, message
        assert calls == {}, f"{row}: {calls} before failing"


def test_every_collective_is_counted():
    """COUNTED is read from torch: it holds the collectives this test counted by hand before
    (and those it missed: all_to_all_single, reduce, gather_object, ...), and each name is
    torch.distributed's own function."""
    by_hand = {"new_group", "all_reduce", "broadcast", "barrier", "all_gather",
               "all_gather_object", "batch_isend_irecv", "isend", "irecv", "send", "recv",
               "reduce_scatter_tensor", "all_gather_into_tensor", "gather", "scatter",
               "broadcast_object_list", "all_to_all", "all_to_all_single", "reduce",
               "reduce_scatter", "gather_object", "scatter_object_list", "send_object_list",
               "recv_object_list", "monitored_barrier", "all_reduce_coalesced"}
    assert by_hand <= set(COUNTED), f"COUNTED lacks {sorted(by_hand - set(COUNTED))}"
    assert all(getattr(dist, name) is getattr(c10d, name) for name in COUNTED)
    assert set(SENDS_NOTHING) <= set(c10d.__all__), "a name torch no longer has: drop it"


def test_the_table_in_docs_lists_every_row():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "errors.md")
    # the first table; later sections' rows are collective checks, tested elsewhere
    with open(path) as f:
        first = f.read().split("\n## ")[0]
    documented = re.findall(r"^\| `([a-z0-9-]+)` \|", first, flags=re.M)
    assert sorted(documented) == sorted(list(ROWS) + list(SET_UP))
    assert len(documented) >= 15


