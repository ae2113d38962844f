"""Weights on the CPU: large ones advised into transparent huge pages, every one copied exactly."""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tvm

from runtime.cpu import HUGE_PAGE
from runtime.weights import _on_device

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """Linux's transparent huge page mode (always, madvise, never), or None when it has none."""
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def advised_huge(address: int, size: int) -> bool:
    """Whether every whole huge page in [address, address + size) lies in a mapping advised MADV_HUGEPAGE (flag `hg`
    in /proc/self/smaps). The advice is ours to give; whether Linux grants the pages depends on the host's free memory."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + size) // HUGE_PAGE * HUGE_PAGE
    covered, low, high = 0, 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(bound, 16) for bound in head.split("-"))
        elif head == "VmFlags:" and "hg" in line.split()[1:]:
            covered += max(0, min(high, end) - max(low, start))
    return end > start and covered == end - start


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="this Linux grants no transparent huge pages")
def test_a_large_weight_is_advised_into_huge_pages():
    array = np.random.default_rng(0).standard_normal((8192, 1024)).astype(ml_dtypes.bfloat16)  # 16 MiB
    tensor = _on_device(array, tvm.cpu())
    assert advised_huge(tensor.data_ptr(), array.nbytes), "the weight's memory was not advised MADV_HUGEPAGE"
    assert np.array_equal(tensor.numpy().view(np.uint16), array.view(np.uint16))


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), ((2 * HUGE_PAGE // 4 + 7,), np.float32),
                                         ((1024, 2049), ml_dtypes.bfloat16), ((64, 33), np.int32)])
def test_every_weight_is_copied_exactly(shape, dtype):
    array = (np.random.default_rng(1).standard_normal(shape) * 100).astype(dtype)
    tensor = _on_device(array, tvm.cpu())
    assert tensor.shape == array.shape and str(tensor.dtype) == str(array.dtype)
    assert np.array_equal(tensor.numpy().view(np.uint8), array.view(np.uint8))
