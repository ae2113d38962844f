"""Weights and caches on the CPU: every weight, small ones too, and every KV page and recurrent state in memory
advised into transparent huge pages; weights copied exactly."""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tvm

from runtime.cpu import HUGE_PAGE, SLOT_ALIGNMENT, HugePageMemory, tensor_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """Linux's transparent huge page mode (always, madvise, never), or None when it has none."""
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)
    except (OSError, AttributeError):
        return None


HUGE = pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="this Linux grants no transparent huge pages")


def advised_huge(address: int, size: int) -> bool:
    """Whether all of [address, address + size) lies in mappings advised MADV_HUGEPAGE (flag `hg` in
    /proc/self/smaps). The advice is ours to give; whether Linux grants the pages depends on the host's free memory."""
    covered, low, high = 0, 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(bound, 16) for bound in head.split("-"))
        elif head == "VmFlags:" and "hg" in line.split()[1:]:
            covered += max(0, min(high, address + size) - max(low, address))
    return covered == size


def on_cpu(arrays: list[np.ndarray], memory: HugePageMemory | None = None) -> list[tvm.runtime.Tensor]:
    """The arrays as the loader places CPU weights (in `memory`, else the memory it takes for the CPU)."""
    memory = memory or tensor_memory(tvm.cpu())
    return [memory.copy(array) for array in arrays]


def weights(*shapes: tuple[int, ...], dtype=np.float32) -> list[np.ndarray]:
    """Random arrays of these shapes."""
    rng = np.random.default_rng(len(shapes))
    return [(rng.standard_normal(shape) * 100).astype(dtype) for shape in shapes]


def assert_exact(tensors: list[tvm.runtime.Tensor], arrays: list[np.ndarray]) -> None:
    """Each tensor holds its array's shape, dtype and bytes."""
    for tensor, array in zip(tensors, arrays):
        assert tensor.shape == array.shape and str(tensor.dtype) == str(array.dtype)
        assert np.array_equal(tensor.numpy().view(np.uint8), array.view(np.uint8))


@HUGE
def test_every_weight_small_ones_too_is_advised_into_huge_pages():
    arrays = weights((8192, 1024), (896, 112), (3, 5), (896,), dtype=ml_dtypes.bfloat16)  # 16 MiB down to 2 bytes
    tensors = on_cpu(arrays)
    for tensor, array in zip(tensors, arrays):
        assert advised_huge(tensor.data_ptr(), array.nbytes), f"a {array.shape} weight is not in huge-page memory"
    assert_exact(tensors, arrays)


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), ((2 * HUGE_PAGE // 4 + 7,), np.float32),
                                         ((1024, 2049), ml_dtypes.bfloat16), ((64, 33), np.int32)])
def test_every_weight_is_copied_exactly(shape, dtype):
    arrays = weights(shape, dtype=dtype)
    assert_exact(on_cpu(arrays), arrays)


def test_weights_get_their_own_page_aligned_slots_and_new_mappings_when_one_is_full():
    arrays = weights((300_000,), (7,), (300_000,), (1,), (600_000,))  # 1.2 MB, 28 B, ... against 2 MiB mappings
    memory = HugePageMemory(chunk=HUGE_PAGE)
    tensors = on_cpu(arrays, memory)
    starts = [t.data_ptr() for t in tensors]
    assert all(start % SLOT_ALIGNMENT == 0 for start in starts)
    spans = sorted((start, start + a.nbytes) for start, a in zip(starts, arrays))
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), "two weights overlap"
    assert starts[1] == starts[0] + 1_200_128, "a small weight did not follow the one before it in its mapping"
    assert starts[2] // HUGE_PAGE != starts[0] // HUGE_PAGE, "a weight that did not fit was not given a new mapping"
    assert_exact(tensors, arrays)  # the later copies overwrote nothing


@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16"])
def test_an_empty_tensor_is_zero_page_aligned_and_in_huge_page_memory(dtype):
    memory = tensor_memory(tvm.cpu())
    memory.copy(np.ones(7, np.float32))
    tensor = memory.empty((3, 1000), dtype)
    assert tensor.shape == (3, 1000) and str(tensor.dtype) == dtype and tensor.data_ptr() % SLOT_ALIGNMENT == 0
    assert not tensor.numpy().view(np.uint8).any()
    if thp_mode() in ("always", "madvise"):
        assert advised_huge(tensor.data_ptr(), tensor.numpy().nbytes)


@HUGE
@pytest.mark.parametrize("options", [{"arch": "qwen2"}, {"arch": "qwen3_5_text", "num_hidden_layers": 2}])
def test_a_batch_caches_kv_pages_and_states_are_in_huge_page_memory(tiny_factory, options):
    from runtime import CompiledModel

    model = CompiledModel(*tiny_factory(**options))
    cache = model.new_batch_cache()
    assert cache.tensors, "the cache has no state tensors"
    for spec, tensor in zip(cache.specs, cache.tensors):
        size = int(np.prod(tensor.shape)) * np.dtype(tensor.dtype).itemsize
        assert advised_huge(tensor.data_ptr(), size), f"{spec.name} is not in huge-page memory"
