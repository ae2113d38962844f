"""CUDA builds without a GPU: options, the three code paths, and packaging PTX into the artifact.

Paths (`--cuda-compiler` / RUDA_CUDA_COMPILER):
- `ptx` (default): TensorIR -> TVM's LLVM NVPTX backend -> PTX, no CUDA C++ anywhere.
- `nvrtc`, `nvcc`: TensorIR -> CUDA C++ -> NVRTC or nvcc -> PTX.

Either way the artifact's device module holds PTX (format "ptx"), which the CUDA driver loads
directly: nothing is compiled by TVM at load time. Two quirks of the pinned TVM (0.27, LLVM 22)
are handled here: its NVPTX backend declares kernels as `.func` instead of `.entry` (LLVM 22 no
longer reads the kernel annotation TVM emits), so kernel names are restored to entries; and it
calls LLVM 22's block-barrier intrinsic without its barrier-id argument (the call does not
verify), so the direct path's TIR pipeline (`NVPTX_PIPELINE`) emits that call itself. Warp-level
barriers have no NVPTX lowering at all, so a kernel that needs one (TVM's warp-synchronous
cross-thread reduction) is refused on that path: `schedules.gpu` reduces across threads through
shared memory and block barriers only.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import tvm
import tvm_ffi
from tvm import tirx
from tvm.tirx import compilation_pipeline

from ir.contract import IR_FILE, PTX_FILE, TargetSpec, read_manifest
from ir.errors import RudaError

from .options import ARCHS, COMPILER_ENV, COMPILERS, MATMUL_PRECISIONS, PTX_VERSION_ENV

PTX_VERSIONS = ("7.0", "7.1", "7.2", "7.3", "7.4", "7.5", "7.6", "7.7", "7.8",
                "8.0", "8.1", "8.2", "8.3", "8.4", "8.5", "8.6", "8.7", "8.8", "9.0")
# The oldest PTX ISA that can target each architecture.
MIN_PTX_VERSION = {"sm_80": "7.0", "sm_86": "7.1", "sm_89": "7.8", "sm_90": "7.8"}
NVPTX_PIPELINE = "ruda_nvptx"
BLOCK_BARRIER = "llvm.nvvm.barrier.cta.sync.aligned.all"


class CudaBuildError(RudaError):
    """A bad CUDA build option, a missing toolkit, or a kernel a path cannot compile."""

    exit_code = 6


def _version_key(version: str) -> tuple[int, int]:
    major, minor = version.split(".")
    return int(major), int(minor)


@dataclass(frozen=True)
class CudaTarget:
    """A CUDA build: architecture, code path, the PTX ISA version to emit (None: the compiler's own), and the
    precision of prefill products of bfloat16 weights (`auto` until `for_weights` resolves it; `bfloat16`: on
    tensor cores, schedules.gpu_wmma)."""

    arch: str
    compiler: str
    ptx_version: str | None
    matmul_precision: str = "float32"

    @property
    def bf16_products(self) -> str | None:
        """Where prefill products of bfloat16 weights run in bfloat16 (wmma: tensor cores), or None: float32."""
        return "wmma" if self.matmul_precision == "bfloat16" else None

    def for_weights(self, dtype: str) -> CudaTarget:
        """The target with `auto` precision resolved for a checkpoint whose matrices are `dtype`: tensor-core
        products for bfloat16 weights where the path can emit them (nvrtc, nvcc), float32 ones otherwise."""
        if self.matmul_precision != "auto":
            return self
        bf16 = dtype == "bfloat16" and self.compiler != "ptx"
        return replace(self, matmul_precision="bfloat16" if bf16 else "float32")

    def tvm_target(self) -> tvm.target.Target:
        """The TVM target: NVPTX for the direct path, CUDA C++ for nvrtc/nvcc."""
        host = {"kind": "llvm", "mtriple": "x86_64-linux-gnu"}
        if self.compiler == "ptx":
            return tvm.target.Target({"kind": "nvptx", "mcpu": self.arch}, host=host)
        return tvm.target.Target({"kind": "cuda", "arch": self.arch}, host=host)

    def tir_pipeline(self) -> str:
        """The TIR lowering pipeline: TVM's own, with the barrier fix on the direct path."""
        return NVPTX_PIPELINE if self.compiler == "ptx" else "default"

    def describe(self) -> TargetSpec:
        """The target as the manifest records it."""
        return TargetSpec("cuda", arch=self.arch, cuda_compiler=self.compiler, ptx_version=self.ptx_version,
                          matmul_precision=self.matmul_precision, bf16_products=self.bf16_products)


@tirx.transform.prim_func_pass(opt_level=0, name="NvptxBarriers")
def _nvptx_barriers(func, mod, ctx):
    """Block barriers as the NVVM intrinsic call LLVM 22 verifies; any other barrier is an error naming the kernel."""
    sync = tvm.ir.Op.get("tirx.tvm_storage_sync")

    def rewrite(call):
        if not call.op.same_as(sync):
            return call
        scope = call.args[0].value
        if scope in ("shared", "shared.dyn"):
            return tirx.call_llvm_intrin("void", BLOCK_BARRIER, tirx.const(0, "int32"))
        what = "a warp-synchronous reduction" if scope == "warp" else f"a {scope!r} barrier"
        raise CudaBuildError(f"kernel {func.attrs['global_symbol']} needs {what}, which the NVPTX backend cannot "
                             "emit (reduce across threads through shared memory instead)")

    return tvm_ffi.structural_map(func, [(tvm.ir.expr.Call, rewrite)])


def _nvptx_pipeline(**kwargs):
    """TVM's default TIR pipeline with `_nvptx_barriers` run last on device functions."""
    lower, finalize_host, finalize_device = compilation_pipeline.get_tir_pipeline("s_tir", **kwargs)
    return lower, finalize_host, lambda: tvm.ir.transform.Sequential([finalize_device(), _nvptx_barriers])


compilation_pipeline.register_tir_pipeline(NVPTX_PIPELINE, _nvptx_pipeline)


def cuda_target(arch: str | None = None, compiler: str | None = None, ptx_version: str | None = None,
                matmul_precision: str = "float32") -> CudaTarget:
    """Validated CUDA options; flags win over the RUDA_CUDA_COMPILER / RUDA_PTX_VERSION environment."""
    arch = arch or "sm_90"
    if arch not in ARCHS:
        raise CudaBuildError(f"--arch {arch!r} is not supported; valid: {', '.join(ARCHS)}")
    compiler = compiler or os.environ.get(COMPILER_ENV) or "ptx"
    if compiler not in COMPILERS:
        raise CudaBuildError(f"CUDA compiler {compiler!r} (--cuda-compiler or {COMPILER_ENV}) is not supported; "
                             f"valid: {', '.join(COMPILERS)}")
    ptx_version = ptx_version or os.environ.get(PTX_VERSION_ENV) or None
    if ptx_version is not None:
        if ptx_version not in PTX_VERSIONS:
            raise CudaBuildError(f"PTX version {ptx_version!r} (--ptx-version or {PTX_VERSION_ENV}) is not supported; "
                                 f"valid: {', '.join(PTX_VERSIONS)}")
        if _version_key(ptx_version) < _version_key(MIN_PTX_VERSION[arch]):
            raise CudaBuildError(f"PTX version {ptx_version} cannot target {arch}; {arch} needs PTX "
                                 f"{MIN_PTX_VERSION[arch]} or newer")
    if matmul_precision not in MATMUL_PRECISIONS:
        raise CudaBuildError(f"--matmul-precision {matmul_precision!r} is not one of {', '.join(MATMUL_PRECISIONS)}")
    if matmul_precision == "bfloat16" and compiler == "ptx":
        raise CudaBuildError("--matmul-precision bfloat16 runs prefill products on tensor cores through CUDA's WMMA "
                             "API, which the direct PTX path (LLVM NVPTX) cannot emit; add --cuda-compiler nvcc "
                             "(or nvrtc), or leave the precision at float32")
    return CudaTarget(arch, compiler, ptx_version, matmul_precision)


def cuda_toolkit_root() -> Path:
    """The CUDA toolkit root: $CUDA_PATH, else where `nvcc` really lives (it may be a wrapper script)."""
    env = os.environ.get("CUDA_PATH")
    if env and (Path(env) / "nvvm" / "libdevice").is_dir():
        return Path(env)
    if shutil.which("nvcc") is None:
        raise CudaBuildError("no CUDA toolkit found: put nvcc on PATH or set CUDA_PATH to the toolkit root")
    dryrun = subprocess.run(["nvcc", "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True)
    here = re.search(r"^#\$ _HERE_=(.+)$", dryrun.stderr + dryrun.stdout, re.MULTILINE)
    if here is None:
        raise CudaBuildError("cannot locate the CUDA toolkit from nvcc; set CUDA_PATH to the toolkit root")
    return Path(here.group(1).strip()).resolve().parent


def prepare_environment() -> None:
    """Point TVM (libdevice, NVRTC headers) at the toolkit."""
    os.environ["CUDA_PATH"] = str(cuda_toolkit_root())


def compile_source(source: str, target: CudaTarget) -> str:
    """CUDA C++ -> PTX with NVRTC or nvcc."""
    from tvm.support import nvcc

    try:
        with target.tvm_target():
            ptx = nvcc.compile_cuda(source, target_format="ptx", arch=target.arch, compiler=target.compiler)
    except (RuntimeError, ImportError) as e:
        hint = " (install the project's `cuda` extra for NVRTC)" if target.compiler == "nvrtc" else ""
        raise CudaBuildError(f"{target.compiler} could not compile the CUDA C++ kernels{hint}: {e}") from None
    return bytes(ptx).decode().rstrip("\x00")


def finish_ptx(ptx: str, kernels: list[str], version: str | None) -> str:
    """Kernels declared as entries, and the requested PTX ISA version."""
    names = set(kernels)

    def declare(m: re.Match) -> str:
        return f"{m.group(1)}.entry{m.group(2)}" if m.group(3) in names else m.group(0)

    ptx = re.sub(r"^(\.visible\s+)\.func(\s+(\w+)\()", declare, ptx, flags=re.MULTILINE)
    if version is not None:
        ptx, count = re.subn(r"^\.version\s+\d+\.\d+", f".version {version}", ptx, count=1, flags=re.MULTILINE)
        if count != 1:
            raise CudaBuildError("generated PTX has no .version directive")
    return ptx


# --- the serialized module tree of an exported library ("__tvm_ffi__library_bin") ---

class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return value

    def raw(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def string(self) -> bytes:
        return self.raw(self.u64())


def _string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _read_function_names(r: _Reader) -> list[str]:
    """Read a serialized CUDA function-info map at the reader's position; returns the kernel names."""
    names = []
    for _ in range(r.u64()):
        r.string()  # map key
        names.append(r.string().decode())
        r.raw(4 * r.u64())  # argument dtypes
        for _ in range(r.u64()):
            r.string()  # launch parameter tags
        r.raw(4 * r.u64())  # argument extra tags
    return names


def repack_cuda_modules(blob: bytes, to_ptx) -> bytes:
    """The module-tree blob with every CUDA module's code replaced by `to_ptx(fmt, code, kernel_names)`."""
    r = _Reader(blob)
    if r.u64() != len(blob) - 8:
        raise CudaBuildError("unexpected module blob header from this TVM version; the packer needs updating")
    start = r.pos
    for _ in range(2):  # the import tree: row pointers, then child indices
        r.raw(8 * r.u64())
    out = blob[start:r.pos]
    while r.pos < len(blob):
        key = r.string()
        out += _string(key)
        if key == b"_lib":  # the host library itself: no payload
            continue
        payload = r.string()
        if key == b"cuda":
            p = _Reader(payload)
            fmt = p.string().decode()
            fmap_start = p.pos
            names = _read_function_names(p)
            fmap = payload[fmap_start:p.pos]
            code = p.string()
            if p.pos != len(payload):
                raise CudaBuildError("unexpected CUDA module layout from this TVM version; the packer needs updating")
            payload = _string(b"ptx") + fmap + _string(to_ptx(fmt, code.decode(), names).encode())
        out += _string(payload)
    return struct.pack("<Q", len(out)) + out


def blob_as_c(blob: bytes, symbol: str) -> str:
    """C source defining the exported module-tree symbol, as TVM's own packer writes it."""
    rows = ",\n".join("  " + ",".join(f"0x{b:02x}" for b in blob[i:i + 20]) for i in range(0, len(blob), 20))
    return ("#ifdef __cplusplus\nextern \"C\" {\n#endif\n"
            f"__attribute__((visibility(\"default\"))) extern const unsigned char {symbol}[];\n"
            f"const unsigned char {symbol}[{len(blob)}] = {{\n{rows}\n}};\n"
            "#ifdef __cplusplus\n}\n#endif\n")


def check_with_ptxas(ptx_file: Path, arch: str) -> bool:
    """Assemble the PTX with ptxas (when installed); a rejection is a build error. Returns whether it ran."""
    if shutil.which("ptxas") is None:
        return False
    result = subprocess.run(["ptxas", f"-arch={arch}", str(ptx_file), "-o", os.devnull], capture_output=True, text=True)
    if result.returncode != 0:
        raise CudaBuildError(f"ptxas rejected the generated PTX for {arch}: {result.stderr.strip()[-2000:]}")
    return True


def export_with_ptx(executable, path: Path, target: CudaTarget) -> list[str]:
    """Export the library with PTX device code; returns the PTX of each device module."""
    modules: list[str] = []

    def to_ptx(fmt: str, code: str, names: list[str]) -> str:
        if fmt == "cuda":
            code = compile_source(code, target)
        elif fmt != "ptx":
            raise CudaBuildError(f"device module has format {fmt!r}; expected CUDA C++ or PTX")
        ptx = finish_ptx(code, names, target.ptx_version)
        modules.append(ptx)
        return ptx

    def pack(module, is_system_lib, prefix, workspace_dir):
        blob = bytes(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(module).numpy())
        c_path = os.path.join(workspace_dir, "devc.c")
        Path(c_path).write_text(blob_as_c(repack_cuda_modules(blob, to_ptx), f"{prefix}__tvm_ffi__library_bin"))
        return c_path

    executable.mod.export_library(str(path), fpack_imports=pack)
    return modules


def kernel_launches(artifact: Path) -> dict[str, int]:
    """The GPU kernels each VM function of a CUDA artifact launches per call: every op of its entry is one kernel
    function, which launches each of its device kernels (`NAME_kernel`, `NAME_kernel_1`, ... in the PTX) once."""
    from ir.serialize import from_json

    from .lower import op_signature

    manifest = read_manifest(artifact, f"python -m compiler build MODEL_DIR --target cuda --out {artifact}")
    program = from_json((artifact / IR_FILE).read_text())
    entries = collections.Counter(re.findall(r"\.entry\s+(\w+?)_kernel(?:_\d+)?\(", (artifact / PTX_FILE).read_text()))
    launches = {}
    for name, entry, dims in manifest.buckets.functions(program):
        graph = program.entries[entry]
        launches[name] = sum(entries[op_signature(graph, program, op, dims).name] for op in graph.ops)
    return launches
