"""A stand-in for the NVIDIA driver library (libcuda.so.1), for machines without a GPU.

It exports every driver function that TVM's CUDA loader links against, so that the loader and a CUDA artifact
load as they would on a GPU machine; it reports the driver version $RUDA_STANDIN_DRIVER_VERSION (default 13000,
CUDA 13.0) and finds no GPU (every other call answers CUDA_ERROR_NO_DEVICE). Everything up to the first call that
needs a GPU can be rehearsed with it on LD_LIBRARY_PATH.

    python tests/cuda_standin.py DIR      # writes DIR/libcuda.so.1 (needs gcc and nm)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VERSION_ENV = "RUDA_STANDIN_DRIVER_VERSION"
DEVICES_ENV = "RUDA_STANDIN_DEVICES"  # how many GPUs cuInit and cuDeviceGetCount claim (default 0)
ALWAYS = ("cuInit", "cuDeviceGetCount", "cuGetErrorName", "cuGetErrorString")  # what runtime/cuda.py calls
SPECIAL = {
    "cuInit": 'int cuInit(unsigned f) { const char *e = getenv("%s"); return e && atoi(e) > 0 ? 0 : 100; }'
              % DEVICES_ENV,
    "cuDeviceGetCount": 'int cuDeviceGetCount(int *n) { const char *e = getenv("%s"); *n = e ? atoi(e) : 0; '
                        "return 0; }" % DEVICES_ENV,
    "cuDriverGetVersion": 'int cuDriverGetVersion(int *v) { const char *e = getenv("%s"); *v = e ? atoi(e) : 13000; '
                          "return 0; }" % VERSION_ENV,
    "cuGetErrorName": 'int cuGetErrorName(int e, const char **s) { *s = e == 100 ? "CUDA_ERROR_NO_DEVICE" : '
                      '"CUDA_ERROR_UNKNOWN"; return 0; }',
    "cuGetErrorString": 'int cuGetErrorString(int e, const char **s) { *s = "no CUDA-capable device is detected '
                        '(stand-in driver)"; return 0; }',
}


def driver_functions(loader: Path) -> list[str]:
    """The driver functions (cu*) that the shared library `loader` needs, with the ones runtime/cuda.py calls."""
    symbols = subprocess.run(["nm", "-D", "--undefined-only", str(loader)], capture_output=True, text=True,
                             check=True).stdout.split()
    return sorted({s.split("@")[0] for s in symbols if s.startswith("cu") and s[2:3].isupper()} | set(ALWAYS)
                  | {"cuDriverGetVersion"})


def write_standin(folder: Path, loader: Path) -> Path:
    """Compile the stand-in libcuda.so.1 for `loader` (TVM's libtvm_runtime_cuda.so) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    source = ["#include <stdlib.h>"]
    source += [SPECIAL.get(name, f"int {name}(void) {{ return 100; }}") for name in driver_functions(loader)]
    (folder / "standin_cuda.c").write_text("\n".join(source) + "\n")
    library = folder / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(library),
                    str(folder / "standin_cuda.c")], check=True)
    return library


def tvm_cuda_loader() -> Path:
    """TVM's CUDA loader in this environment."""
    import tvm

    return Path(tvm.__file__).resolve().parent / "lib" / "libtvm_runtime_cuda.so"


if __name__ == "__main__":
    print(write_standin(Path(sys.argv[1]), tvm_cuda_loader()))
