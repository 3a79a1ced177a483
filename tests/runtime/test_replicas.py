"""The parameter hash that replica checks compare (fxmeg/runtime/data_parallel/replicas.py)."""

import pytest
import torch

from fxmeg.runtime.data_parallel.replicas import BLOCK, PATTERN, hash_pattern, tensor_hash


def _reference(t: torch.Tensor) -> tuple[int, int]:
    """The definition, in plain int64: (sum of the int16 words, sum of word * weight)."""
    words = t.contiguous().reshape(-1).view(torch.int16).long()
    weights = hash_pattern("cpu").long()[torch.arange(words.numel()) % PATTERN]
    return int(words.sum()), int((words * weights).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equal_tensors_hash_equal_and_any_one_element_change_differs(dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(300, 77, generator=g).to(dtype)  # not a multiple of PATTERN words
    assert torch.equal(tensor_hash(t), tensor_hash(t.clone()))
    assert tensor_hash(t).tolist() == list(_reference(t))
    for index in [(0, 0), (123, 45), (299, 76)]:
        up, down = t.clone(), t.clone()
        up.view(torch.int32 if dtype == torch.float32 else torch.int16)[index] += 1  # one ulp
        down[index] = -t[index]  # the sign bit only
        assert not torch.equal(tensor_hash(up), tensor_hash(t)), index
        assert not torch.equal(tensor_hash(down), tensor_hash(t)), index


def test_compensating_word_changes_and_swaps_are_seen():
    t = torch.zeros(4, dtype=torch.float32)
    words = t.view(torch.int16)
    words[0], words[1] = 5, -5  # the plain sum of one element's two words is unchanged
    assert tensor_hash(t)[0] == 0 and tensor_hash(t)[1] != 0
    u = torch.tensor([1.0, 2.0, 3.0])
    assert not torch.equal(tensor_hash(u), tensor_hash(u.flip(0)))  # same values, other places


def test_large_tensors_hash_block_by_block_exactly():
    t = torch.randn(BLOCK // 2 + 12345)  # 2 words per element: one full block and a tail
    assert tensor_hash(t).tolist() == list(_reference(t))


def test_weights_are_small_and_neighbours_differ():
    c = hash_pattern("cpu")
    assert c.shape == (PATTERN,) and int(c.min()) >= 1 and int(c.max()) < 1 << 7
    assert bool((c[0::2] != c[1::2]).all())
