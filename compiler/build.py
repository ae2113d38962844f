"""`compiler build`: model directory -> IR -> scheduled kernels -> Relax VM module -> artifact directory."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import tvm
from tqdm import tqdm

import models
from models.checkpoint import SAFETENSORS_DTYPES
from ir import format_program, packed_as, stable_hash, to_json
from ir.contract import (
    ATTENTION_ENTRIES,
    IR_FILE,
    IR_TEXT,
    MANIFEST,
    MODEL_PACKAGES,
    MODULE,
    PTX_FILE,
    ArtifactError,
    Buckets,
    InputSpec,
    Manifest,
    OutputSpec,
    ParamSpec,
    QuantizationSpec,
    config_hash,
    default_artifact_dir,
    file_digest,
    hidden_entry,
    read_manifest,
    source_hash,
    verify_files,
)
from ir.errors import RudaError, storage_error
from ir.packing import CPU_PACKINGS
from schedules import cpu, gpu

from .cuda import CudaBuildError, CudaTarget, check_with_ptxas, cuda_target, export_with_ptx, prepare_environment
from .cuda_graphs import relax_pipeline
from .lower import kernel_signatures, lower_program
from .options import (
    DEFAULT_BATCH_ROWS,
    DEFAULT_IMAGE_PATCH_BUCKETS,
    DEFAULT_MAX_CONTEXT,
    DEFAULT_PREFILL_BUCKETS,
    TARGETS,
)
from .output import OutputError, locked_output
from .target import BF16_PATH_NAMES, CpuTarget, cpu_target

COMPILER_PACKAGES = MODEL_PACKAGES + ("compiler", "schedules")  # a change to any of them rebuilds


class BuildError(RudaError):
    """Bad build options."""

    exit_code = 6


@dataclass(frozen=True)
class BuildResult:
    """Where the artifact is and whether it was reused unchanged."""

    path: Path
    reused: bool
    seconds: float


def resolve_buckets(prefill: tuple[int, ...] | None, max_context: int | None, max_positions: int,
                    batch_rows: tuple[int, ...] | None = None, kv_pages: int | None = None,
                    kv_block: int | None = None) -> Buckets:
    """Validated buckets. The longest sequence defaults to DEFAULT_MAX_CONTEXT capped at the model's
    max_position_embeddings; the KV arena to enough pages for the largest row count at that length."""
    prefill = tuple(sorted(set(prefill or DEFAULT_PREFILL_BUCKETS)))
    rows = tuple(sorted(set(batch_rows or DEFAULT_BATCH_ROWS)))
    context = min(DEFAULT_MAX_CONTEXT, max_positions) if max_context is None else max_context
    block = 16 if kv_block is None else kv_block
    for name, values in (("--prefill-buckets", prefill), ("--batch-rows", rows), ("--max-context", (context,)),
                         ("--kv-block-size", (block,))):
        if any(not isinstance(v, int) or v <= 0 for v in values):
            raise BuildError(f"{name} must be positive integers, got {list(values)}")
    if context > max_positions:
        raise BuildError(f"--max-context {context} exceeds the model's max_position_embeddings ({max_positions})")
    if rows[-1] > prefill[-1]:
        raise BuildError(f"--batch-rows {rows[-1]} exceeds the largest prefill bucket {prefill[-1]} (tokens per step)")
    buckets = Buckets(prefill, rows, context, 0, block)
    pages = rows[-1] * buckets.pages_per_row if kv_pages is None else kv_pages
    if not isinstance(pages, int) or pages < buckets.pages_per_row:
        raise BuildError(f"--kv-pages {pages} cannot hold one sequence of {context} tokens "
                         f"({buckets.pages_per_row} pages of {block})")
    return replace(buckets, kv_pages=pages)


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
    if mcpu is not None:
        raise BuildError("--mcpu only applies to --target llvm")
    return cuda_target(arch, cuda_compiler, ptx_version, matmul_precision or "float32")


def build(model_dir: str | Path, *, target: str = "llvm", out: str | Path | None = None,
          prefill_buckets: tuple[int, ...] | None = None, max_context: int | None = None,
          mcpu: str | None = None, arch: str | None = None, cuda_compiler: str | None = None,
          ptx_version: str | None = None, batch_rows: tuple[int, ...] | None = None, kv_pages: int | None = None,
          kv_block: int | None = None, image_patches: tuple[int, ...] | None = None, legacy_attention: bool = False,
          matmul_precision: str | None = None, force: bool = False, quiet: bool = False) -> BuildResult:
    """Compile a model directory into an artifact directory (reusing it when nothing changed)."""
    start = time.perf_counter()
    if out is not None and (not isinstance(out, (str, os.PathLike)) or not str(out)):
        raise OutputError(f"--out must be a directory path, got {out!r}")
    tgt = make_target(target, mcpu=mcpu, arch=arch, cuda_compiler=cuda_compiler, ptx_version=ptx_version,
                      matmul_precision=matmul_precision)
    raw, config, tensors, program = models.load_checkpoint_program(model_dir)
    tgt = tgt.for_weights(_matrix_dtype(program))
    if isinstance(tgt, CpuTarget):
        program = packed_as(program, CPU_PACKINGS)  # packed weights in the layout the CPU kernels read
    buckets = replace(resolve_buckets(prefill_buckets, max_context, config.max_position_embeddings, batch_rows,
                                      kv_pages, kv_block),
                      entries=_entries(program, _LEGACY_ENTRIES if legacy_attention else ()),
                      image_patches=_image_patches(image_patches, config))
    out = Path(out) if out is not None else default_artifact_dir(model_dir, target)
    signatures = kernel_signatures(program, buckets)
    manifest = Manifest(
        built_from=str(Path(model_dir).resolve()),
        model_type=program.model_type,
        config_hash=config_hash(raw),
        ir_hash=stable_hash(program),
        model_code_hash=source_hash(MODEL_PACKAGES),
        code_hash=source_hash(COMPILER_PACKAGES),
        target=tgt.describe(),
        buckets=buckets,
        tvm_version=tvm.__version__,
        params=tuple(ParamSpec(p.name, p.type.shape, p.type.dtype, p.source_tensors, tuple(
            SAFETENSORS_DTYPES[tensors[s].dtype] for s in p.source_tensors), p.transform,
            p.type.packing and str(p.type.packing)) for p in program.params.values()),
        quantization=_quantization(config.quantization, program),
        inputs=_entry_inputs(program, buckets),
        vocab_size=config.vocab_size,
        functions=_function_outputs(program, buckets),
        kernels=tuple(sig.name for sig in signatures),
        build_options=_options(tgt, buckets, mcpu),
    )
    with locked_output(out, Path(model_dir)) as output:
        if not force and _up_to_date(out, manifest):
            return BuildResult(out, True, time.perf_counter() - start)
        progress = (lambda it: it) if quiet else (lambda it: tqdm(it, desc="scheduling kernels", unit="kernel"))
        scan_lanes = tgt.scan_lanes if isinstance(tgt, CpuTarget) else 1
        module = lower_program(program, buckets, signatures, _scheduler(tgt), progress, scan_lanes,
                               cuda_graphs=isinstance(tgt, CudaTarget))
        if not quiet:
            print(f"compiling {len(manifest.kernels)} kernels and {len(manifest.functions)} step functions "
                  f"for {_describe(tgt)}...", file=sys.stderr, flush=True)
        executable = _compile(module, tgt)
        output.commit(lambda folder: _write_artifact(folder, manifest, program, executable, tgt))
    return BuildResult(out, False, time.perf_counter() - start)


def _image_patches(sizes: tuple[int, ...] | None, config) -> tuple[int, ...]:
    """The vision encoder's patch buckets: each a whole number of merged image tokens (none without an encoder)."""
    encoder = getattr(config, "vision", None)
    if encoder is None:
        if sizes is not None:
            raise BuildError(f"--image-patch-buckets: {config.model_type} has no vision encoder (config.json declares "
                             "no vision_config); leave the option out")
        return ()
    sizes = tuple(sorted(set(sizes or DEFAULT_IMAGE_PATCH_BUCKETS)))
    if any(not isinstance(v, int) or v <= 0 or v % encoder.merge_unit for v in sizes):
        raise BuildError(f"--image-patch-buckets must be positive multiples of {encoder.merge_unit} (the patches "
                         f"merged into one image token), got {list(sizes)}")
    return sizes


def _matrix_dtype(program) -> str:
    """The dtype of the checkpoint's float matrices (bfloat16 if any is: what `--matmul-precision auto` asks)."""
    dtypes = {p.type.dtype for p in program.params.values() if len(p.type.shape) == 2}
    return "bfloat16" if "bfloat16" in dtypes else "float32"


def _quantization(quant, program) -> QuantizationSpec | None:
    """The manifest's record of the checkpoint's quantisation."""
    if quant is None:
        return None
    packed = sum(p.type.packing is not None for p in program.params.values())
    return QuantizationSpec(quant.quant_method, quant.bits, quant.version, quant.group_size, packed)


def _options(tgt: CpuTarget | CudaTarget, buckets: Buckets, mcpu: str | None) -> tuple[str, ...]:
    """The `compiler build` options (besides MODEL_DIR and --out) that reproduce this build."""
    sizes = lambda values: ",".join(map(str, values))  # noqa: E731
    options = ["--target", "llvm" if isinstance(tgt, CpuTarget) else "cuda",
               "--prefill-buckets", sizes(buckets.prefill_tokens), "--max-context", str(buckets.max_context),
               "--batch-rows", sizes(buckets.batch_rows), "--kv-pages", str(buckets.kv_pages),
               "--kv-block-size", str(buckets.kv_block)]
    options += ["--image-patch-buckets", sizes(buckets.image_patches)] if buckets.image_patches else []
    options += ["--legacy-paged-attention"] if ATTENTION_ENTRIES["legacy"] in buckets.entries else []
    if isinstance(tgt, CudaTarget):
        options += ["--arch", tgt.arch, "--cuda-compiler", tgt.compiler]
        options += ["--ptx-version", tgt.ptx_version] if tgt.ptx_version else []
    else:
        options += ["--mcpu", mcpu] if mcpu else []
    options += ["--matmul-precision", "bfloat16"] if tgt.bf16_products else []
    return tuple(options)


_LEGACY_ENTRIES = (ATTENTION_ENTRIES["legacy"], hidden_entry(ATTENTION_ENTRIES["legacy"]))


def _entries(program, optional: tuple[str, ...]) -> tuple[str, ...]:
    """The entries to build: the model's non-optional ones, and the optional ones asked for."""
    missing = [name for name in optional if name not in program.entries or not program.entries[name].optional]
    if missing:
        raise BuildError(f"{program.model_type} has no optional entry {missing[0]!r}")
    return tuple(name for name, graph in program.entries.items() if not graph.optional or name in optional)


def _entry_inputs(program, buckets: Buckets) -> dict[str, tuple[InputSpec, ...]]:
    """The runtime inputs of each entry built, by role, in call order, with the arena dims bound (the bucket dims
    stay symbolic: they differ per function)."""
    return {name: tuple(InputSpec(v, graph.roles[v].kind, graph.roles[v].layer, graph.types[v].bind(
        buckets.arena_dims()).shape, graph.types[v].dtype) for v in graph.inputs)
        for name, graph in program.entries.items() if name in buckets.entries}


def _function_outputs(program, buckets: Buckets) -> dict[str, OutputSpec]:
    """Each VM function's output: its entry's output at the function's dims."""
    out = {}
    for name, entry, dims in buckets.functions(program):
        graph = program.entries[entry]
        t = graph.types[graph.outputs[0]].bind(dims)
        out[name] = OutputSpec(t.shape, t.dtype)
    return out


def _describe(tgt: CpuTarget | CudaTarget) -> str:
    if isinstance(tgt, CpuTarget):
        path = tgt.bf16_products
        return f"CPU {tgt.mcpu} with LLVM" + (f", bfloat16 prefill products on {BF16_PATH_NAMES[path]}" if path else "")
    path = "direct PTX (LLVM NVPTX)" if tgt.compiler == "ptx" else f"CUDA C++ via {tgt.compiler}"
    return f"CUDA {tgt.arch} through {path}"


def _scheduler(tgt: CpuTarget | CudaTarget):
    def schedule(kernel, kind, attrs):
        kernel.func = (cpu if isinstance(tgt, CpuTarget) else gpu).schedule(kernel.func, kind, attrs, tgt)
        return kernel
    return schedule


def _compile(module: tvm.IRModule, tgt: CpuTarget | CudaTarget):
    """The compiled executable; a kernel the direct PTX path cannot emit is named in the error."""
    if isinstance(tgt, CpuTarget):
        return tvm.compile(module, tgt.tvm_target(), relax_pipeline="default_build")
    prepare_environment()
    try:
        with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):  # see lower_program
            return tvm.compile(module, tgt.tvm_target(), relax_pipeline=relax_pipeline(),
                               tir_pipeline=tgt.tir_pipeline())
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


def _write_artifact(folder: Path, manifest: Manifest, program, executable, tgt: CpuTarget | CudaTarget) -> None:
    """Write the compiled module (and, for CUDA, its PTX, checked by ptxas), the IR and the manifest with the
    module files' checksums into `folder`."""
    try:
        if isinstance(tgt, CpuTarget):
            executable.export_library(str(folder / MODULE), workspace_dir=tempfile.mkdtemp())
        else:
            modules = export_with_ptx(executable, folder / MODULE, tgt)
            if len(modules) != 1:
                raise CudaBuildError(f"expected one PTX device module, got {len(modules)}")
            (folder / PTX_FILE).write_text(modules[0])
            check_with_ptxas(folder / PTX_FILE, tgt.arch)
        (folder / IR_FILE).write_text(to_json(program))
        (folder / IR_TEXT).write_text(format_program(program) + "\n")
        files = [MODULE] + ([PTX_FILE] if isinstance(tgt, CudaTarget) else [])
        manifest = replace(manifest, files={name: file_digest(folder / name) for name in files})
        (folder / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
    except OSError as e:
        raise storage_error(e, f"writing the artifact (in {folder})") from None
    except tvm.error.TVMError as e:  # the exporter's own I/O failures (e.g. the linker on a full disk)
        raise BuildError(f"writing the artifact into {folder} failed: {_last_line(e)}; check the free disk space "
                         "and that the folder is writable") from None


def _last_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _up_to_date(out: Path, manifest: Manifest) -> bool:
    """Whether `out` is an intact artifact of exactly this build."""
    try:
        old = read_manifest(out, "")
        verify_files(out, old, "")
    except ArtifactError:
        return False
    return old.same_build(manifest) and set(old.files) == ({MODULE, PTX_FILE} if manifest.target.kind == "cuda"
                                                          else {MODULE})
