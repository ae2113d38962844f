"""`compiler build`: model directory -> IR -> scheduled kernels -> Relax VM module -> artifact directory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import tvm
from tqdm import tqdm

import models
from ir import format_program, stable_hash, to_json
from ir.errors import RudaError
from runtime.artifact import FORMAT, MANIFEST, MODULE, config_hash, default_artifact_dir
from schedules import cpu, gpu

from .cuda import CudaBuildError, CudaTarget, check_with_ptxas, cuda_target, export_with_ptx, prepare_environment
from .lower import Buckets, kernel_signatures, lower_program
from .target import CpuTarget, cpu_target

TARGETS = ("llvm", "cuda")
PTX_FILE = "kernels.ptx"
DEFAULT_PREFILL_BUCKETS = (16, 64, 256)
DEFAULT_CONTEXT_BUCKETS = (512, 2048, 4096)
_SOURCE_PACKAGES = ("ir", "models", "compiler", "schedules")


class BuildError(RudaError):
    """Bad build options."""


@dataclass(frozen=True)
class BuildResult:
    """Where the artifact is and whether it was reused unchanged."""

    path: Path
    reused: bool
    seconds: float


def code_hash() -> str:
    """Hash of the compiler's own source, so a changed schedule or kernel invalidates old artifacts."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in _SOURCE_PACKAGES:
        for path in sorted((root / pkg).glob("*.py")):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def resolve_buckets(prefill: tuple[int, ...] | None, context: tuple[int, ...] | None, max_positions: int,
                    batch_rows: tuple[int, ...] | None = None, kv_pages: int | None = None,
                    kv_block: int | None = None) -> Buckets:
    """Validated buckets; context capacities above the model's max_position_embeddings are capped.

    Batched execution is built only when `batch_rows` is given; the KV arena then defaults to enough
    pages for the largest row count at the largest context.
    """
    prefill = tuple(sorted(set(prefill or DEFAULT_PREFILL_BUCKETS)))
    if context is None:
        context = tuple(c for c in DEFAULT_CONTEXT_BUCKETS if c <= max_positions) or (max_positions,)
    context = tuple(sorted(set(context)))
    for name, values in (("--prefill-buckets", prefill), ("--context-buckets", context)):
        if not values or any(v <= 0 for v in values):
            raise BuildError(f"{name} must be positive integers, got {list(values)}")
    if context[-1] > max_positions:
        raise BuildError(f"--context-buckets {context[-1]} exceeds the model's max_position_embeddings ({max_positions})")
    if prefill[0] > context[0]:
        raise BuildError(f"--context-buckets {context[0]} is smaller than the smallest prefill bucket {prefill[0]}; "
                         "every KV cache must hold at least one prefill chunk")
    if not batch_rows:
        if kv_pages is not None or kv_block is not None:
            raise BuildError("--kv-pages and --kv-block-size need --batch-rows (batched execution)")
        return Buckets(prefill, context)
    rows = tuple(sorted(set(batch_rows)))
    block = 16 if kv_block is None else kv_block
    for name, values in (("--batch-rows", rows), ("--kv-block-size", (block,))):
        if any(not isinstance(v, int) or v <= 0 for v in values):
            raise BuildError(f"{name} must be positive integers, got {list(values)}")
    if rows[-1] > prefill[-1]:
        raise BuildError(f"--batch-rows {rows[-1]} exceeds the largest prefill bucket {prefill[-1]} (tokens per step)")
    buckets = Buckets(prefill, context, rows, 0, block)
    pages = rows[-1] * buckets.pages_per_row if kv_pages is None else kv_pages
    if pages < buckets.pages_per_row:
        raise BuildError(f"--kv-pages {pages} cannot hold one sequence of {context[-1]} tokens "
                         f"({buckets.pages_per_row} pages of {block})")
    return Buckets(prefill, context, rows, pages, block)


def make_target(target: str, *, mcpu: str | None = None, arch: str | None = None,
                cuda_compiler: str | None = None, ptx_version: str | None = None,
                matmul_precision: str | None = None) -> CpuTarget | CudaTarget:
    """The validated target for `--target` and the options that belong to it."""
    if target not in TARGETS:
        raise BuildError(f"--target {target!r} is not supported; valid targets: {', '.join(TARGETS)}")
    if target == "llvm":
        stray = [flag for flag, v in (("--arch", arch), ("--cuda-compiler", cuda_compiler),
                                      ("--ptx-version", ptx_version)) if v is not None]
        if stray:
            raise BuildError(f"{', '.join(stray)} only apply to --target cuda")
        return cpu_target(mcpu, matmul_precision or "float32")
    stray = [flag for flag, v in (("--mcpu", mcpu), ("--matmul-precision", matmul_precision)) if v is not None]
    if stray:
        raise BuildError(f"{', '.join(stray)} only apply to --target llvm")
    return cuda_target(arch, cuda_compiler, ptx_version)


def build(model_dir: str | Path, *, target: str = "llvm", out: str | Path | None = None,
          prefill_buckets: tuple[int, ...] | None = None, context_buckets: tuple[int, ...] | None = None,
          mcpu: str | None = None, arch: str | None = None, cuda_compiler: str | None = None,
          ptx_version: str | None = None, batch_rows: tuple[int, ...] | None = None, kv_pages: int | None = None,
          kv_block: int | None = None, matmul_precision: str | None = None, force: bool = False,
          quiet: bool = False) -> BuildResult:
    """Compile a model directory into an artifact directory (reusing it when nothing changed)."""
    start = time.perf_counter()
    tgt = make_target(target, mcpu=mcpu, arch=arch, cuda_compiler=cuda_compiler, ptx_version=ptx_version,
                      matmul_precision=matmul_precision)
    raw, config, _, program = models.load_checkpoint_program(model_dir)
    buckets = resolve_buckets(prefill_buckets, context_buckets, config.max_position_embeddings, batch_rows, kv_pages,
                              kv_block)
    out = Path(out) if out is not None else default_artifact_dir(model_dir, target)
    signatures = kernel_signatures(program, buckets)
    manifest = {
        "format": FORMAT,
        "built_from": str(Path(model_dir).resolve()),
        "model_type": program.model_type,
        "config_hash": config_hash(raw),
        "ir_hash": stable_hash(program),
        "target": tgt.describe(),
        "buckets": {"prefill_tokens": list(buckets.prefill_tokens), "context": list(buckets.context),
                    **({"batch_rows": list(buckets.batch_rows), "kv_pages": buckets.kv_pages,
                        "kv_block": buckets.kv_block, "pages_per_row": buckets.pages_per_row}
                       if buckets.batch_rows else {})},
        "tvm_version": tvm.__version__,
        "code_hash": code_hash(),
        "params": [{"name": p.name, "dtype": p.type.dtype, "shape": list(p.type.shape)} for p in program.params.values()],
        "cache": _state_tensors(program.entries["decode"], {}),
        "vocab_size": config.vocab_size,
        "functions": [name for name, _, _ in buckets.functions()],
        "kernels": [sig.name for sig in signatures],
    }
    if buckets.batch_rows:
        step = program.entries["step"]
        manifest["batch_state"] = _state_tensors(step, buckets.arena_dims())
        manifest["step_inputs"] = [name for name in step.inputs if step.types[name].dtype == "int32"]
    if isinstance(tgt, CudaTarget):
        manifest["ptx_file"] = PTX_FILE
    if not force and _up_to_date(out, manifest):
        return BuildResult(out, True, time.perf_counter() - start)

    progress = (lambda it: it) if quiet else (lambda it: tqdm(it, desc="scheduling kernels", unit="kernel"))
    scan_lanes = tgt.lanes if isinstance(tgt, CpuTarget) else 1
    module = lower_program(program, buckets, signatures, _scheduler(tgt), progress, scan_lanes)
    if not quiet:
        print(f"compiling {len(manifest['kernels'])} kernels and {len(manifest['functions'])} step functions "
              f"for {_describe(tgt)}...", flush=True)
    executable = _compile(module, tgt)
    _write_atomically(out, manifest, program, lambda tmp: _export(executable, tgt, tmp))
    return BuildResult(out, False, time.perf_counter() - start)


def _state_tensors(graph, dims: dict[str, int]) -> list[dict]:
    """The state an entry carries across calls (its float inputs: KV caches or pages, recurrent states), with
    `dims` bound (the runtime binds the rest, e.g. the context capacity)."""
    return [{"name": name, "shape": list(graph.types[name].bind(dims).shape), "dtype": graph.types[name].dtype}
            for name in graph.inputs if graph.types[name].dtype == "float32"]


def _describe(tgt: CpuTarget | CudaTarget) -> str:
    if isinstance(tgt, CpuTarget):
        return f"CPU {tgt.mcpu} with LLVM" + (", bfloat16 prefill products on AMX" if tgt.amx else "")
    path = "direct PTX (LLVM NVPTX)" if tgt.compiler == "ptx" else f"CUDA C++ via {tgt.compiler}"
    return f"CUDA {tgt.arch} through {path}"


def _scheduler(tgt: CpuTarget | CudaTarget):
    def schedule(kernel, kind, attrs):
        kernel.func = cpu.schedule(kernel.func, kind, tgt.lanes, tgt.amx, attrs) if isinstance(tgt, CpuTarget) \
            else gpu.schedule(kernel.func, kind)
        return kernel
    return schedule


def _compile(module: tvm.IRModule, tgt: CpuTarget | CudaTarget):
    """The compiled executable; a kernel the direct PTX path cannot emit is named in the error."""
    if isinstance(tgt, CpuTarget):
        return tvm.compile(module, tgt.tvm_target(), relax_pipeline="default_build")
    prepare_environment()
    try:
        return tvm.compile(module, tgt.tvm_target(), relax_pipeline="default_build", tir_pipeline=tgt.tir_pipeline())
    except Exception as e:  # TVM raises bare errors from codegen; find and name the kernel behind it
        for name, func in module.functions.items():
            if isinstance(func, tvm.tirx.PrimFunc):
                try:
                    tvm.compile(func, tgt.tvm_target(), tir_pipeline=tgt.tir_pipeline())
                except Exception as kernel_error:
                    detail = str(kernel_error).strip().splitlines()[-1]
                    raise CudaBuildError(
                        f"the {_describe(tgt)} path cannot emit op {name.name_hint.rsplit('_', 1)[0]!r} "
                        f"(kernel {name.name_hint}): {detail}") from None
        raise CudaBuildError(f"CUDA build through {_describe(tgt)} failed: {str(e).strip().splitlines()[-1]}") from None


def _export(executable, tgt: CpuTarget | CudaTarget, directory: Path) -> None:
    """Write the compiled module (and, for CUDA, its PTX, checked by ptxas) into `directory`."""
    if isinstance(tgt, CpuTarget):
        executable.export_library(str(directory / MODULE))
        return
    modules = export_with_ptx(executable, directory / MODULE, tgt)
    if len(modules) != 1:
        raise CudaBuildError(f"expected one PTX device module, got {len(modules)}")
    ptx_path = directory / PTX_FILE
    ptx_path.write_text(modules[0])
    check_with_ptxas(ptx_path, tgt.arch)


def _up_to_date(out: Path, manifest: dict) -> bool:
    try:
        old = json.loads((out / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    informational = ("built_from",)
    same = all(old.get(k) == v for k, v in manifest.items() if k not in informational)
    files = [MODULE] + ([manifest["ptx_file"]] if "ptx_file" in manifest else [])
    return same and set(old) == set(manifest) and all((out / f).is_file() for f in files)


def _write_atomically(out: Path, manifest: dict, program, export) -> None:
    """Write into a temp dir beside `out`, then swap it in, so no half-built artifact is ever visible."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        export(tmp)
        (tmp / "ir.json").write_text(to_json(program))
        (tmp / "ir.txt").write_text(format_program(program) + "\n")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            out.rename(old)
        try:
            tmp.rename(out)
        except OSError:
            if old.exists():
                old.rename(out)  # keep the previous artifact rather than none
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
