"""Weights on the CPU: large ones asked into transparent huge pages, every one copied exactly."""

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


def anon_huge_bytes() -> int:
    """Bytes of this process's anonymous memory in transparent huge pages."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="this Linux grants no transparent huge pages")
def test_a_large_weight_lives_in_huge_pages():
    array = np.random.default_rng(0).standard_normal((8192, 1024)).astype(ml_dtypes.bfloat16)  # 16 MiB
    before = anon_huge_bytes()
    tensor = _on_device(array, tvm.cpu())
    grown = anon_huge_bytes() - before
    assert grown >= array.nbytes // 2, f"only {grown >> 20} MiB of a {array.nbytes >> 20} MiB weight in huge pages"
    assert np.array_equal(tensor.numpy().view(np.uint16), array.view(np.uint16))


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), ((2 * HUGE_PAGE // 4 + 7,), np.float32),
                                         ((1024, 2049), ml_dtypes.bfloat16), ((64, 33), np.int32)])
def test_every_weight_is_copied_exactly(shape, dtype):
    array = (np.random.default_rng(1).standard_normal(shape) * 100).astype(dtype)
    tensor = _on_device(array, tvm.cpu())
    assert tensor.shape == array.shape and str(tensor.dtype) == str(array.dtype)
    assert np.array_equal(tensor.numpy().view(np.uint8), array.view(np.uint8))
