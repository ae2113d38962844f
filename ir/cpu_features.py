"""CPU features an artifact relies on (recorded by the compiler, checked by the runtime) and what this host has."""

from __future__ import annotations

from pathlib import Path

# LLVM feature names and the /proc/cpuinfo flags that prove the host has them.
CHECKED_FEATURES = {
    "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
    "amx-tile": "amx_tile", "amx-bf16": "amx_bf16",
}
AMX_FEATURES = ("amx-bf16", "amx-tile")  # what bfloat16 matrix products on AMX tiles need


def host_cpu_flags() -> set[str]:
    """The CPU flags the kernel reports for this machine (empty if unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_host_features(features: list[str]) -> list[str]:
    """Those of the LLVM `features` this machine lacks (none when /proc/cpuinfo cannot be read)."""
    flags = host_cpu_flags()
    return [f for f in features if flags and CHECKED_FEATURES.get(f, f) not in flags]
