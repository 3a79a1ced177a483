import itertools

import pytest
import torch

from fxmeg.ir.layouts import Shard
from fxmeg.weights.sharding import flat_to_boxes, local_to_global, view


@pytest.mark.parametrize("shape", [(10,), (4, 6), (3, 4, 5), (2, 1, 3, 4)])
def test_flat_ranges_become_contiguous_boxes(shape):
    n = torch.Size(shape).numel()
    for lo, hi in itertools.combinations(range(0, n + 1, max(1, n // 9)), 2):
        marks = torch.zeros(shape, dtype=torch.int64)
        prev_end = lo
        for off, size in flat_to_boxes(shape, lo, hi):
            v = view(marks, (off, size))
            v += 1
            flat_start = sum(o * torch.Size(shape[d + 1:]).numel() for d, o in enumerate(off))
            assert flat_start == prev_end  # boxes come in order, each a contiguous range
            prev_end += v.numel()
        flat = marks.reshape(-1)
        assert flat[lo:hi].eq(1).all() and flat[:lo].eq(0).all() and flat[hi:].eq(0).all()


def test_local_boxes_land_in_each_block():
    full = torch.arange(12 * 3).reshape(12, 3)  # three blocks of 4 rows (a fused QKV)
    spec, tp = Shard(0, (4, 4, 4)), 2
    for rank in range(tp):
        local = torch.cat([full[b * 4 + rank * 2 : b * 4 + rank * 2 + 2] for b in range(3)])
        for lo, hi in [(0, 18), (2, 11), (5, 6)]:
            for box in flat_to_boxes(local.shape, lo, hi):
                for glob, loc in local_to_global(box, spec, tp, rank):
                    assert torch.equal(view(full, glob), view(local, loc))


def test_column_split_maps_columns():
    full = torch.arange(4 * 8).reshape(4, 8)
    for rank in range(2):
        local = full[:, rank * 4 : rank * 4 + 4]
        (pair,) = local_to_global(((1, 0), (2, 4)), Shard(1, (8,)), 2, rank)
        assert torch.equal(view(full, pair[0]), view(local, pair[1]))
