"""What a CUDA process needs before its kernels run: the NVIDIA driver (new enough), the CUDA runtime library and
TVM's CUDA module loader, each loaded explicitly, so that a missing piece is an error that names it.

TVM loads its CUDA loader (`libtvm_runtime_cuda.so`) only when its compiler library is present too, and
swallows the failure when it cannot; a runtime-only install (a deploy bundle) never loads it. Either way
a CUDA artifact would fail later as "no GPU" or "no loader registered". Here every piece is loaded in
order, globally, before the first CUDA call.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ir.contract import CUDA_LIBRARY_FOLDERS, CUDA_RUNTIME_LIBRARY
from ir.errors import RudaError

CUDART = CUDA_RUNTIME_LIBRARY
CUDA_VERSION = int(CUDART.rsplit(".", 1)[1])
DRIVER = "libcuda.so.1"
MIN_DRIVER_API = CUDA_VERSION * 1000  # what cuDriverGetVersion reports for a driver that runs CUDA 13.0 code
MIN_DRIVER_RELEASE = "580"  # the first NVIDIA driver release for CUDA 13.0
CUDA_ERROR_NO_DEVICE = 100
TVM_CUDA_LOADER = "libtvm_runtime_cuda.so"
CUDART_DIR_ENV = "RUDA_CUDART_DIR"
TOOLKIT_ROOTS = ("/usr/local/cuda",)  # searched after $CUDA_PATH


class CudaUnavailable(RudaError):
    """This machine cannot run a CUDA artifact: no driver, a driver too old, no CUDA runtime, no GPU."""

    exit_code = 7


def load_cuda() -> None:
    """Load the driver, the CUDA runtime and TVM's CUDA loader, and check a GPU is there; or raise CudaUnavailable."""
    check_gpu(load_cuda_libraries())


def load_cuda_libraries() -> ctypes.CDLL:
    """Load the driver (checking its version), the CUDA runtime and TVM's CUDA loader, each globally; returns the
    driver. After it, CUDA artifacts load; running them needs a GPU (check_gpu)."""
    driver = _driver()
    _check_driver_version(driver)
    _load_global(_find_cudart(), "the CUDA runtime")
    _load_tvm_cuda_loader()
    return driver


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL(DRIVER, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise CudaUnavailable(f"--device cuda: the NVIDIA driver library {DRIVER} cannot be loaded ({e}); install "
                              f"an NVIDIA driver >= {MIN_DRIVER_RELEASE} (CUDA {CUDA_VERSION}), or use --device cpu") \
            from None


def _check_driver_version(driver: ctypes.CDLL) -> None:
    version = ctypes.c_int(0)
    if driver.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < MIN_DRIVER_API:
        have = f"CUDA {version.value // 1000}.{version.value % 1000 // 10}" if version.value else "an unknown CUDA"
        raise CudaUnavailable(f"--device cuda: this NVIDIA driver supports {have}; the artifact's kernels need CUDA "
                              f"{CUDA_VERSION}.0, which needs driver >= {MIN_DRIVER_RELEASE}: update the driver, or "
                              "use --device cpu")


def cudart_search_path() -> list[Path]:
    """Folders searched for the CUDA runtime, in order: $RUDA_CUDART_DIR, TVM's own library folder (where a bundle
    keeps it), then the CUDA toolkit ($CUDA_PATH, /usr/local/cuda); the loader's default search comes last."""
    folders = [Path(os.environ[CUDART_DIR_ENV])] if os.environ.get(CUDART_DIR_ENV) else []
    folders.append(_tvm_library_dir())
    for root in (os.environ.get("CUDA_PATH"), *TOOLKIT_ROOTS):
        if root:
            folders += [Path(root) / folder for folder in CUDA_LIBRARY_FOLDERS]
    return folders


def _find_cudart() -> str:
    folders = cudart_search_path()
    for folder in folders:
        if (folder / CUDART).is_file():
            return str(folder / CUDART)
    try:
        ctypes.CDLL(CUDART)  # the loader's own search: LD_LIBRARY_PATH, ldconfig's cache
        return CUDART
    except OSError:
        pass
    searched = ", ".join(str(f) for f in folders)
    raise CudaUnavailable(f"--device cuda: the CUDA runtime {CUDART} is not in {searched} nor on the library path; "
                          f"set {CUDART_DIR_ENV} to the folder that holds it (a CUDA {CUDA_VERSION} toolkit's lib64), "
                          "or run the artifact from its bundle (python -m compiler bundle), which carries it")


def _load_global(path: str, what: str) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise CudaUnavailable(f"--device cuda: {what} ({path}) cannot be loaded: {e}") from None


def _tvm_library_dir() -> Path:
    import tvm.base

    return Path(tvm.base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent


def _load_tvm_cuda_loader() -> None:
    """TVM's CUDA module loader, which registers how a CUDA artifact's kernels are loaded."""
    import tvm.base

    if "tvm_runtime_cuda" not in tvm.base._LOADED_LIBS:
        path = _tvm_library_dir() / TVM_CUDA_LOADER
        if not path.is_file():
            raise CudaUnavailable(f"--device cuda: TVM's CUDA loader {path} is missing; reinstall apache-tvm, or "
                                  "rebuild the bundle from an install that has it")
        tvm.base._LOADED_LIBS["tvm_runtime_cuda"] = _load_global(str(path), "TVM's CUDA loader")


def check_gpu(driver: ctypes.CDLL) -> None:
    """The driver must start and see a GPU."""
    status = driver.cuInit(0)
    count = ctypes.c_int(0)
    if status == 0:
        status = driver.cuDeviceGetCount(ctypes.byref(count))
    if status == CUDA_ERROR_NO_DEVICE or (status == 0 and count.value == 0):
        raise CudaUnavailable("--device cuda: no CUDA GPU is visible on this machine (the driver finds none; check "
                              "CUDA_VISIBLE_DEVICES); run on a machine with an NVIDIA GPU, or use --device cpu")
    if status != 0:
        name = ctypes.c_char_p()
        driver.cuGetErrorName(status, ctypes.byref(name))
        raise CudaUnavailable(f"--device cuda: the NVIDIA driver failed to start (cuInit: "
                              f"{(name.value or b'error').decode()} {status}); check the driver with nvidia-smi")
