"""What a CPU process needs before its kernels run: AMX tile state and huge pages from Linux, TVM threads on every
core."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_LIBC = ctypes.CDLL(None, use_errno=True)
HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page
SLOT_ALIGNMENT = 4096  # bytes: every slot starts on a page


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


class HugePageMemory:
    """Page-aligned slots, handed out in order, in private anonymous mappings advised into huge pages before anything
    touches them. A model's weights placed here lie in huge pages, the small ones too: an allocation of its own gets
    huge pages only for the whole 2 MiB pages inside it, so a weight under 4 MiB (every product of a 0.5B model,
    most of an AWQ one) got none. A mapping is never freed while a slot of it is alive."""

    def __init__(self, chunk: int = 256 << 20):
        self.chunk = chunk
        self._free = np.empty(0, np.uint8)  # the untouched rest of the newest mapping

    def place(self, array: np.ndarray) -> np.ndarray:
        """A copy of `array` in a slot of this memory."""
        size = -(-array.nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        if size > self._free.size:
            self._free = _huge_page_mapping(max(size, self.chunk))
        slot = self._free[:array.nbytes].view(array.dtype).reshape(array.shape)
        slot[...] = array
        self._free = self._free[size:]
        return slot


def _huge_page_mapping(size: int) -> np.ndarray:
    """At least `size` bytes from a fresh private anonymous mapping, starting on a huge page and all advised into huge
    pages."""
    size = -(-size // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mapping, np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    ask_huge_pages(whole.ctypes.data + start, size)
    return whole[start:start + size]
