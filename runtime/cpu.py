"""What a CPU process needs before its kernels run: AMX tile state and huge pages from Linux, TVM threads on every
core."""

from __future__ import annotations

import ctypes
import mmap
import os

_LIBC = ctypes.CDLL(None, use_errno=True)
HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page


def enable_amx() -> None:
    """Ask Linux for this process's AMX tile state, which it grants only on request (else AMX code dies of SIGILL)."""
    arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64 syscall number, request, feature bit
    if _LIBC.syscall(arch_prctl, req_xcomp_perm, xtiledata) != 0:
        raise OSError(ctypes.get_errno(), f"Linux refused this process AMX tile state (arch_prctl "
                      f"ARCH_REQ_XCOMP_PERM: {os.strerror(ctypes.get_errno())}); it needs Linux 5.16 or newer")


def use_all_cores() -> None:
    """Let TVM's thread pool use every core this process may run on (unless TVM_NUM_THREADS says otherwise).

    Without it TVM starts half of them, and the kernels, memory-bound at decode, want all.
    Takes effect before the first parallel kernel runs.
    """
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))


def ask_huge_pages(address: int, size: int) -> None:
    """Ask Linux to back the whole huge pages within [address, address + size) with transparent huge pages, which
    in its common "madvise" mode it grants only on request (a refusal leaves 4 KiB pages: nothing to report)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + size) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_HUGEPAGE)
