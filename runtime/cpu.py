"""What a CPU process needs before its kernels run: AMX tile state and huge pages from Linux, TVM threads on every
core, memory for weights and caches in huge pages."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import ml_dtypes
import numpy as np
import tvm

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
    """CPU tensors in page-aligned slots, handed out in order, of private anonymous mappings advised into huge pages
    before anything touches them. A model's weights and its caches' KV pages and recurrent states live here, the
    small weights too: an allocation of its own gets huge pages only for the whole 2 MiB pages inside it, so a
    weight under 4 MiB (every product of a 0.5B model, most of an AWQ one) got none, and TVM's own allocations none
    at all. A decode step streams every weight, and in 4 KiB pages each page costs a TLB miss (alone and
    alternating, on AMD EPYC: the 248320 x 1024 vocabulary head of Qwen3.5 1.02-1.12x faster in huge pages, a 2048
    x 5632 product 1.08-1.18x; on Intel Xeon with AMX, TinyLlama AWQ decode 1.06x once its small weights joined the
    large ones there). A mapping is never freed while a tensor in it is alive. Threads may copy at once (slots are
    handed out under a lock): a fresh page's first touch is most of a copy's time, 2.3 s a GiB on a KVM guest of
    docs/performance.md, and the cores take their faults side by side."""

    def __init__(self, chunk: int = 256 << 20):
        self.chunk = chunk
        self._free = np.empty(0, np.uint8)  # the untouched rest of the newest mapping
        self._lock = threading.Lock()

    def copy(self, array: np.ndarray) -> tvm.runtime.Tensor:
        """A CPU tensor holding a copy of `array`."""
        slot = self._slot(array.shape, array.dtype)
        slot[...] = array
        return _tensor(slot)

    def empty(self, shape: tuple[int, ...], dtype: str) -> tvm.runtime.Tensor:
        """A CPU tensor of zeros (its pages untouched until written)."""
        return _tensor(self._slot(shape, ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)))

    def _slot(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """The next slot, for an array of this shape and dtype."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        size = -(-nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        with self._lock:
            if size > self._free.size:
                self._free = _huge_page_mapping(max(size, self.chunk))
            slot = self._free[:nbytes]
            self._free = self._free[size:]
        return slot.view(dtype).reshape(shape)


class DeviceMemory:
    """Tensors from a device's own allocator (a GPU's), with HugePageMemory's interface; copies one at a time."""

    def __init__(self, device: tvm.runtime.Device):
        self.device = device
        self._lock = threading.Lock()

    def copy(self, array: np.ndarray) -> tvm.runtime.Tensor:
        """A tensor on the device holding a copy of `array`."""
        with self._lock:
            return tvm.runtime.tensor(array, self.device)

    def empty(self, shape: tuple[int, ...], dtype: str) -> tvm.runtime.Tensor:
        """A tensor on the device, uninitialised."""
        return tvm.runtime.empty(shape, dtype, self.device)


def tensor_memory(device: tvm.runtime.Device) -> HugePageMemory | DeviceMemory:
    """Where a model's weights or a cache's tensors on `device` go: fresh huge-page memory on the CPU, the device's
    allocator elsewhere."""
    return HugePageMemory() if device.dlpack_device_type() == tvm.cpu().dlpack_device_type() else DeviceMemory(device)


def _tensor(slot: np.ndarray) -> tvm.runtime.Tensor:
    """A CPU tensor over `slot`'s memory."""
    if slot.dtype != ml_dtypes.bfloat16:
        return tvm.runtime.from_dlpack(slot)
    # numpy's DLPack export has no bfloat16: the slot crosses as uint16 and is viewed as bfloat16, the same bytes
    return tvm.runtime.from_dlpack(slot.view(np.uint16))._create_view(slot.shape, "bfloat16")


def _huge_page_mapping(size: int) -> np.ndarray:
    """At least `size` bytes from a fresh private anonymous mapping, starting on a huge page and all advised into huge
    pages."""
    size = -(-size // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mapping, np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    ask_huge_pages(whole.ctypes.data + start, size)
    return whole[start:start + size]
