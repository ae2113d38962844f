"""What machine a benchmark ran on: every speed figure names its CPU."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def cpu_description() -> str:
    """The CPU's model name, LLVM's name for it, its float32 SIMD lanes and the paths of bfloat16 products, of
    prompt chunks' attention products in a bfloat16 build and of AWQ decode products (16-bit integer pairs,
    schedules.cpu_awq) on it."""
    from compiler.target import BF16_PATH_NAMES, cpu_target
    from schedules.cpu_awq import pair_dot

    target = cpu_target(None, "auto")
    path = BF16_PATH_NAMES.get(target.bf16_path, "none (float32 products only)")
    attention = BF16_PATH_NAMES.get(target.for_weights("bfloat16").bf16_attention, "float32")
    pairs = pair_dot(target.lanes, "avx512vnni" in target.features)
    return (f"{cpu_name()} (LLVM mcpu {target.mcpu}, {target.lanes} float32 lanes, bfloat16 products: {path}, "
            f"attention in a bfloat16 build: {attention}, AWQ decode products: {pairs})")
