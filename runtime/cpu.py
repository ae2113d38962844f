"""What this machine's CPU can run: the flags /proc/cpuinfo reports."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

# LLVM feature names and the /proc/cpuinfo flags that prove the host has them.
CHECKED_FEATURES = {
    "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
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


def enable_amx() -> None:
    """Ask Linux for this process's AMX tile state, which it grants only on request (else AMX code dies of SIGILL)."""
    arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64 syscall number, request, feature bit
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(arch_prctl, req_xcomp_perm, xtiledata) != 0:
        raise OSError(ctypes.get_errno(), f"Linux refused this process AMX tile state (arch_prctl "
                      f"ARCH_REQ_XCOMP_PERM: {os.strerror(ctypes.get_errno())}); it needs Linux 5.16 or newer")


def use_all_cores() -> None:
    """Let TVM's thread pool use every core this process may run on (unless TVM_NUM_THREADS says otherwise).

    Without it TVM starts half of them, and the kernels, memory-bound at decode, want all.
    Takes effect before the first parallel kernel runs.
    """
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
