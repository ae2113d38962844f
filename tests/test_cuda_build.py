"""CUDA artifacts built on a machine without a GPU: every path, PTX per kernel, versions, ptxas, errors."""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import TEST_BUCKETS, TEST_IMAGE_PATCHES

from compiler import cuda
from compiler.build import BuildError, build
from compiler.cuda import CudaBuildError, cuda_target
from models.tiny import write_tiny_checkpoint
from runtime import GenerationError
from runtime.engine import CompiledModel

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None,
                                reason="no CUDA toolkit installed")


def nvrtc_available() -> bool:
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


PATHS = [
    ("qwen2", "sm_90", "ptx", None), ("llama", "sm_80", "ptx", "7.8"),
    ("qwen2", "sm_80", "nvcc", None), ("llama", "sm_90", "nvcc", "8.3"),
    pytest.param("qwen2", "sm_90", "nvrtc", "8.0",
                 marks=pytest.mark.skipif(not nvrtc_available(), reason="cuda-bindings (NVRTC) not installed")),
    pytest.param("llama", "sm_80", "nvrtc", None,
                 marks=pytest.mark.skipif(not nvrtc_available(), reason="cuda-bindings (NVRTC) not installed")),
    ("qwen3_5", "sm_90", "ptx", None), ("qwen3_5", "sm_80", "nvcc", "8.0"),
]
DEFAULT_VERSION = {("ptx", "sm_90"): "7.8", ("ptx", "sm_80"): "7.0", ("nvcc", "sm_80"): "9.0",
                   ("nvcc", "sm_90"): "9.0", ("nvrtc", "sm_80"): "9.0", ("nvrtc", "sm_90"): "9.0"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    return {arch: write_tiny_checkpoint(root / arch, arch=arch, dtype="bfloat16", **({"vision": True} if arch == "qwen3_5"
                                        else {})) for arch in ("qwen2", "llama", "qwen3_5")}  # Qwen3.5 with images


def _build(model_dir, out, **kw):
    vision = "vision_config" in json.loads((model_dir / "config.json").read_text())
    return build(model_dir, target="cuda", out=out, prefill_buckets=TEST_BUCKETS["prefill_tokens"],
                 max_context=TEST_BUCKETS["max_context"], quiet=True,
                 image_patches=TEST_IMAGE_PATCHES[:1] if vision else None, **kw)


def _embedded_device_code(library) -> tuple[str, str]:
    """(format, code) of the CUDA module packed inside an exported library."""
    lib = ctypes.CDLL(str(library))
    base = ctypes.addressof(ctypes.c_char.in_dll(lib, "__tvm_ffi__library_bin"))
    size = int.from_bytes(ctypes.string_at(base, 8), "little")
    found = []
    cuda.repack_cuda_modules(ctypes.string_at(base, size + 8), lambda fmt, code, names: found.append((fmt, code)) or code)
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("arch_name,arch,compiler,version", PATHS)
def test_cuda_build_emits_checked_ptx_for_every_kernel(checkpoints, tmp_path, arch_name, arch, compiler, version):
    out = _build(checkpoints[arch_name], tmp_path / "artifact", arch=arch, cuda_compiler=compiler, ptx_version=version).path
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == {"kind": "cuda", "arch": arch, "cuda_compiler": compiler, "ptx_version": version,
                                  "matmul_precision": "float32", "bf16_products": None}
    ptx = (out / "kernels.ptx").read_text()
    assert re.search(r"^\.version (\d+\.\d+)$", ptx, re.M).group(1) == (version or DEFAULT_VERSION[(compiler, arch)])
    assert re.search(r"^\.target (sm_\d+)", ptx, re.M).group(1) == arch
    entries = re.findall(r"^\.visible \.entry (\w+)\(", ptx, re.M)
    for kernel in manifest["kernels"]:
        assert any(e == f"{kernel}_kernel" or e.startswith(f"{kernel}_kernel_") for e in entries), kernel
    assembled = subprocess.run(["ptxas", "-v", f"-arch={arch}", str(out / "kernels.ptx"), "-o", "/dev/null"],
                               capture_output=True, text=True)
    assert assembled.returncode == 0, assembled.stderr
    assert len(re.findall(r"Compiling entry function '(\w+)'", assembled.stderr)) == len(entries)
    fmt, code = _embedded_device_code(out / "model.so")
    assert fmt == "ptx" and code == ptx  # the driver loads this PTX; nothing is compiled at load time


def test_environment_selects_path_and_version(monkeypatch):
    monkeypatch.setenv("RUDA_CUDA_COMPILER", "nvcc")
    monkeypatch.setenv("RUDA_PTX_VERSION", "8.0")
    assert cuda_target() == cuda.CudaTarget("sm_90", "nvcc", "8.0")
    assert cuda_target("sm_86", "ptx", "7.1") == cuda.CudaTarget("sm_86", "ptx", "7.1")  # flags win


@pytest.mark.parametrize("kwargs,message", [
    (dict(arch="sm_70"), "--arch 'sm_70' is not supported; valid: sm_80, sm_86, sm_89, sm_90"),
    (dict(compiler="clang"), "CUDA compiler 'clang' .* valid: ptx, nvrtc, nvcc"),
    (dict(ptx_version="6.4"), "PTX version '6.4' .* valid: 7.0, 7.1"),
    (dict(arch="sm_90", ptx_version="7.0"), "PTX version 7.0 cannot target sm_90; sm_90 needs PTX 7.8 or newer"),
    (dict(arch="sm_89", ptx_version="7.4"), "sm_89 needs PTX 7.8"),
])
def test_bad_cuda_options(kwargs, message):
    with pytest.raises(CudaBuildError, match=message):
        cuda_target(**kwargs)


def test_bad_environment_values(monkeypatch):
    monkeypatch.setenv("RUDA_CUDA_COMPILER", "hipcc")
    with pytest.raises(CudaBuildError, match="RUDA_CUDA_COMPILER"):
        cuda_target()


def test_options_of_the_other_target_are_refused(checkpoints, tmp_path):
    with pytest.raises(BuildError, match="--arch only apply to --target cuda"):
        build(checkpoints["qwen2"], target="llvm", arch="sm_90", out=tmp_path / "a", quiet=True)
    with pytest.raises(BuildError, match="--mcpu only applies to --target llvm"):
        build(checkpoints["qwen2"], target="cuda", mcpu="znver4", out=tmp_path / "a", quiet=True)
    with pytest.raises(BuildError, match="valid targets: llvm, cuda"):
        build(checkpoints["qwen2"], target="rocm", out=tmp_path / "a", quiet=True)


def test_direct_path_names_an_op_it_cannot_emit(checkpoints, tmp_path, monkeypatch):
    """A schedule that needs a barrier (a cross-thread reduction) cannot pass the NVPTX backend: the error names the op."""
    from schedules import gpu

    original = gpu.schedule

    def with_block_reduction(func, kind, attrs, target):
        if kind != "rms_norm":
            return original(func, kind, attrs, target)
        sch = gpu.s_tir.Schedule(func)
        block = sch.get_sblock("rms_norm_sumsq")
        row, _, col = sch.get_loops(block)  # rows, groups (one: the whole row), features
        sch.bind(row, "blockIdx.x")
        sch.bind(sch.split(col, [None, 64])[1], "threadIdx.x")
        gpu._thread_per_output(sch, sch.get_sblock("rms_norm"))
        return sch.mod["main"]

    monkeypatch.setattr(gpu, "schedule", with_block_reduction)
    with pytest.raises(CudaBuildError, match=r"direct PTX \(LLVM NVPTX\) path cannot emit op 'rms_norm'"):
        _build(checkpoints["qwen2"], tmp_path / "artifact", cuda_compiler="ptx")
    assert not (tmp_path / "artifact").exists()


def test_cuda_toolkit_root_is_found_from_nvcc(monkeypatch):
    monkeypatch.delenv("CUDA_PATH", raising=False)
    root = cuda.cuda_toolkit_root()
    assert (root / "nvvm" / "libdevice").is_dir()


@pytest.mark.skipif(__import__("tvm").cuda(0).exist, reason="this machine has a GPU")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error(checkpoints, tmp_path):
    from runtime.cuda import CudaUnavailable

    with pytest.raises(CudaUnavailable, match="--device cuda: .*(libcuda.so.1 cannot be loaded|no CUDA GPU is "
                                              "visible).*or use --device cpu"):  # no driver, or no GPU
        CompiledModel(checkpoints["qwen2"], tmp_path / "anything", device="cuda")
    with pytest.raises(GenerationError, match="device 'tpu' is not supported; valid: cpu, cuda"):
        CompiledModel(checkpoints["qwen2"], tmp_path / "anything", device="tpu")


def _t(shape, dtype="float32"):
    from ir import TensorType
    return TensorType(tuple(shape), dtype)


def _packed_linear(rows, group, bias, out=128, depth=256, kind="awq_int4", planes=1):
    """Types of a `linear` of `rows` rows by a packed INT4 weight [out, depth] (AWQ's, or `kind`, of `planes`;
    float16 scales), with or without bias."""
    from ir import Packing, TensorType
    weight = TensorType((out, depth), "float16", Packing(kind, group, planes))
    return [_t((rows, depth)), weight] + ([_t((out,), "float16")] if bias else [])


ATTN = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "scale": 0.25}
DELTA = {"num_k_heads": 2, "num_v_heads": 4, "k_dim": 16, "v_dim": 8, "chunk": 4}
OP_SAMPLES = {
    "embedding": ([_t((50, 32), "bfloat16"), _t((4,), "int32")], {}),
    "rms_norm": ([_t((4, 64)), _t((64,), "bfloat16")], {"eps": 1e-6}),
    "add_rms_norm": ([_t((4, 64)), _t((4, 64)), _t((64,))], {"eps": 1e-6}),
    "linear": ([_t((1, 128)), _t((96, 128), "bfloat16"), _t((96,), "bfloat16")], {}),
    "rope": ([_t((4, 64)), _t((4,), "int32")], {"head_dim": 16, "inv_freq": [1.0, 0.1, 0.01, 0.001]}),
    "silu_mul": ([_t((4, 64)), _t((4, 64))], {}),
    "add": ([_t((4, 64)), _t((4, 64))], {}),
    "paged_kv_append": ([_t((8, 4, 32)), _t((4, 32)), _t((4,), "int32")], {}),
    "paged_attention": ([_t((4, 64)), _t((8, 4, 32)), _t((8, 4, 32)), _t((2, 3), "int32"), _t((4,), "int32"),
                         _t((4,), "int32")], ATTN),
    "take_rows": ([_t((4, 64)), _t((2,), "int32")], {}),
    "slice_cols": ([_t((4, 64))], {"period": 32, "offset": 16, "width": 16}),
    "sigmoid_mul": ([_t((4, 64)), _t((4, 64))], {}),
    "delta_inputs": ([_t((4, 96)), _t((4, 4)), _t((4, 4)), _t((4,)), _t((4,), "bfloat16"), _t((1,), "int32")],
                     {"num_k_heads": 2, "k_dim": 16}),
    "batch_causal_conv1d": ([_t((8, 96)), _t((4, 3, 96)), _t((96, 1, 4), "bfloat16")] + [_t((3,), "int32")] * 4, {}),
    "batch_gated_delta_rule": ([_t((8, 64)), _t((8, 96)), _t((8, 4, 2)), _t((4, 4, 16, 8))] + [_t((3,), "int32")] * 4,
                               DELTA),
    "gather_pages": ([_t((8, 4, 32)), _t((2, 3), "int32")], {}),
    "padded_attention": ([_t((4, 64)), _t((2, 12, 32)), _t((2, 12, 32)), _t((4,), "int32"), _t((4,), "int32")], ATTN),
    "layer_norm": ([_t((4, 64)), _t((64,), "bfloat16"), _t((64,), "bfloat16")], {"eps": 1e-6}),
    "gelu": ([_t((4, 64))], {"approximate": "tanh"}),
    "image_attention": ([_t((8, 64))] * 3 + [_t((8,), "int32")], {"num_heads": 4, "head_dim": 16, "scale": 0.25}),
    "interpolated_embedding": ([_t((16, 64), "bfloat16"), _t((8, 4), "int32"), _t((8, 4))], {}),
    "merge_rows": ([_t((8, 64))], {"group": 4, "rows": 2}),
    "merge_embeddings": ([_t((4, 64)), _t((4, 64)), _t((4,), "int32")], {}),
}
GPU_CASES = [(kind, *OP_SAMPLES[kind]) for kind in sorted(OP_SAMPLES)] + [  # and the chunked form: one sequence
    ("batch_gated_delta_rule", [_t((8, 64)), _t((8, 96)), _t((8, 4, 2)), _t((4, 4, 16, 8))] + [_t((1,), "int32")] * 4,
     DELTA)] + [  # and packed weights: decode GEMVs, prefill GEMMs; groups of 32 rows or one of the whole depth
    ("linear", _packed_linear(rows, group, bias), {}) for rows in (1, 8, 64) for group in (32, 256) for bias in (0, 1)] + [
    ("linear", _packed_linear(rows, 32, True, kind="affine_int4"), {}) for rows in (1, 64)] + [  # float offsets
    ("linear", _packed_linear(rows, 16, False, planes=2), {}) for rows in (1, 64)] + [  # two planes
    ("gelu", [_t((4, 64))], {"approximate": "none"}),  # erf, and multimodal rotary positions
    ("rope", [_t((4, 64)), _t((4, 3), "int32")], {"head_dim": 16, "inv_freq": [1.0, 0.1, 0.01], "pos_axes": [0, 1, 2]})]


def direct_ptx(func) -> str:
    """The PTX the direct path (sm_90) makes of one scheduled kernel."""
    import tvm

    target = cuda_target("sm_90", "ptx")
    cuda.prepare_environment()
    return tvm.compile(func, target.tvm_target(), tir_pipeline=target.tir_pipeline()).mod.imports[0].inspect_source("ptx")


def test_every_op_has_a_gpu_sample():
    from ir import OPS
    assert set(OP_SAMPLES) == set(OPS)


@pytest.mark.parametrize("kind,types,attrs", GPU_CASES)
def test_every_op_compiles_to_ptx_through_the_direct_path(kind, types, attrs, tmp_path):
    from compiler.kernels import make_kernel
    from schedules import gpu

    ptx = cuda.finish_ptx(direct_ptx(gpu.schedule(make_kernel(kind, types, attrs).func, kind, attrs, None)), [], None)
    names = re.findall(r"^\.visible \.func (\w+_kernel(?:_\d+)?)\(", ptx, re.M)
    ptx_file = tmp_path / "k.ptx"
    ptx_file.write_text(cuda.finish_ptx(ptx, names, None))
    assembled = subprocess.run(["ptxas", "-v", "-arch=sm_90", str(ptx_file), "-o", "/dev/null"], capture_output=True,
                               text=True)
    assert assembled.returncode == 0, assembled.stderr
    assert len(re.findall(r"Compiling entry function", assembled.stderr)) == len(names) >= 1


@pytest.mark.parametrize("arch_name", ["qwen2", "qwen3_5"])
def test_batched_steps_build_for_cuda(checkpoints, tmp_path, arch_name):
    out = _build(checkpoints[arch_name], tmp_path / "artifact", batch_rows=(1, 4), kv_pages=32, kv_block=8,
                 legacy_attention=True).path
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"step_t1_r1", "step_t4_r4", "step_t16_r4", "step_gather_t16_r4"} <= set(manifest["functions"])
    kinds = {"paged_attention", "gather_pages", "padded_attention"} | (
        {"batch_causal_conv1d", "batch_gated_delta_rule", "image_attention", "layer_norm", "gelu",
         "interpolated_embedding", "merge_rows", "merge_embeddings"} if arch_name == "qwen3_5" else set())
    assert (f"encode_image_p{TEST_IMAGE_PATCHES[0]}" in manifest["functions"]) == (arch_name == "qwen3_5")
    assert all(any(k.startswith(kind + "_") for k in manifest["kernels"]) for kind in kinds)
    assembled = subprocess.run(["ptxas", "-arch=sm_90", str(out / "kernels.ptx"), "-o", "/dev/null"],
                               capture_output=True, text=True)
    assert assembled.returncode == 0, assembled.stderr


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rows,uses", [(1, "split"), (64, "tiles")])
def test_direct_path_reduces_across_threads_through_shared_memory(rows, uses, packed):
    """Decode GEMV: dot products split over threads, partial sums through shared memory and a block barrier;
    prefill GEMM: x and w tiles staged in shared memory between barriers. Both through the direct path, for a float
    weight and a packed one (unpacked into its tile)."""
    from compiler.kernels import make_kernel
    from schedules import gpu

    types = _packed_linear(rows, 32, False) if packed else [_t((rows, 256)), _t((128, 256), "bfloat16")]
    ptx = direct_ptx(gpu.schedule(make_kernel("linear", types, {}).func, "linear", {}, None))
    shared = re.findall(r"^\.(?:visible|extern) \.shared .*?\[(\d+)\];", ptx, re.M)
    assert shared and "bar.sync" in ptx and "st.shared" in ptx and "ld.shared" in ptx
    if uses == "tiles":  # an x tile (f32) and a w tile (bf16, or f32 unpacked) of DEPTH_STEP x TILE each
        assert sum(map(int, shared)) >= gpu.DEPTH_STEP * gpu.TILE * (4 + (4 if packed else 2))


def _serial_gpu_schedule(func, kind, attrs, monkeypatch):
    """The GPU schedule of a kernel replayed with thread bindings and memory scopes dropped (thread loops run serially,
    one order of the threads; block barriers only separate loop nests): it runs on the CPU."""
    from tvm import s_tir

    from schedules import gpu

    class SerialSchedule(s_tir.Schedule):
        def bind(self, loop, thread_axis):
            pass

        def set_scope(self, block, buffer_index, storage_scope):
            pass

        def cache_read(self, block, read_buffer_index, storage_scope, consumer_blocks=None):
            return super().cache_read(block, read_buffer_index, "global", consumer_blocks)

        def cache_write(self, block, write_buffer_index, storage_scope, consumer_blocks=None):
            return super().cache_write(block, write_buffer_index, "global", consumer_blocks)

    with monkeypatch.context() as patch:
        patch.setattr(s_tir, "Schedule", SerialSchedule)
        return gpu.schedule(func, kind, attrs, None)


def _run_on_cpu(kernel, args) -> list:
    import numpy as np
    import tvm

    tensors = [tvm.runtime.tensor(a, tvm.cpu()) if isinstance(a, np.ndarray) else a for a in args]
    tvm.compile(kernel, tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu"}))(*tensors)
    return [t.numpy() for t in tensors]


@pytest.mark.parametrize("rows,group,bias,kind", [
    (1, 32, True, "awq_int4"), (8, 256, False, "awq_int4"), (3, 64, False, "awq_int4"), (20, 32, True, "awq_int4"),
    (64, 32, True, "awq_int4"), (64, 256, False, "awq_int4"), (1, 32, True, "affine_int4"),
    (64, 32, False, "affine_int4"), (1, 16, False, "awq_int4x2"), (64, 32, True, "affine_int4x2")])
def test_packed_linear_schedules_keep_the_kernel_semantics(rows, group, bias, kind, monkeypatch):
    """The GPU schedules of a packed linear only rearrange its work: replayed serially on the CPU, they compute
    what the unscheduled kernel computes, on random packed words."""
    import numpy as np

    from compiler.kernels import make_kernel

    kind, _, planes = kind.partition("x")  # "x2": two planes
    func = make_kernel("linear", _packed_linear(rows, group, bias, kind=kind, planes=int(planes or 1)), {}).func
    scheduled = _serial_gpu_schedule(func, "linear", {}, monkeypatch)
    rng = np.random.default_rng(rows)
    shapes = [(tuple(int(d) for d in p.shape), str(p.dtype)) for p in func.params]
    args = [rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32) if dtype == "int32"
            else rng.standard_normal(shape).astype(dtype) for shape, dtype in shapes]
    np.testing.assert_allclose(_run_on_cpu(scheduled, args)[-1], _run_on_cpu(func, args)[-1], rtol=1e-5, atol=1e-3)


def _ints(*values) -> list:
    import numpy as np

    return [np.asarray(v, np.int32) for v in values]


FUSED_CASES = {  # ops the GPU schedule keeps in few kernels: (kind, types, attrs, kernels, int inputs)
    "rope-decode": ("rope", [_t((1, 896)), _t((1,), "int32")],
                    {"head_dim": 64, "inv_freq": [10000 ** (-i / 32) for i in range(32)]}, 1, None),
    "rope-multimodal": ("rope", [_t((16, 512)), _t((16, 3), "int32")],
                        {"head_dim": 128, "inv_freq": [10000 ** (-i / 32) for i in range(32)],
                         "pos_axes": [i % 3 for i in range(32)]}, 1, None),
    "linear-bias-bf16": ("linear", [_t((1, 896)), _t((128, 896), "bfloat16"), _t((128,), "bfloat16")], {}, 2, None),
    "linear-bias-f32": ("linear", [_t((4, 256)), _t((96, 256)), _t((96,))], {}, 2, None),
    "add-norm-decode": ("add_rms_norm", [_t((1, 896)), _t((1, 896)), _t((896,), "bfloat16")], {"eps": 1e-6}, 1, None),
    "add-norm-prefill": ("add_rms_norm", [_t((5, 1536)), _t((5, 1536)), _t((1536,))], {"eps": 1e-5}, 1, None),
    "norm-grouped": ("rms_norm", [_t((3, 512)), _t((128,), "bfloat16")],
                     {"eps": 1e-6, "group": 128, "weight_offset": 1.0}, 1, None),
    "norm-odd-width": ("rms_norm", [_t((2, 48)), _t((48,))], {"eps": 1e-6}, 1, None),
    "add-norm-one-step": ("add_rms_norm", [_t((4, 64)), _t((4, 64)), _t((64,))], {"eps": 1e-6}, 1,
                          None),  # a term a thread
    "attention-images": ("image_attention", [_t((8, 32))] * 3 + [_t((8,), "int32")],
                         {"num_heads": 2, "head_dim": 16, "scale": 0.25}, 5, _ints([0, 0, 0, 1, 1, 1, 1, 1])),
    "attention-legacy": ("padded_attention", [_t((3, 32)), _t((2, 12, 16)), _t((2, 12, 16)), _t((3,), "int32"),
                                              _t((3,), "int32")], {"num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                                                                   "scale": 0.25}, 5, _ints([0, 1, 1], [5, 9, 11])),
}


REGISTER_CASES = {**{name: case[:3] for name, case in FUSED_CASES.items()},
                  "gemv-bias-narrow": ("linear", [_t((1, 64)), _t((32, 64), "bfloat16"), _t((32,), "bfloat16")], {}),
                  "gemv-rows-bias": ("linear", [_t((8, 64)), _t((64, 64), "bfloat16"), _t((64,), "bfloat16")], {}),
                  "norm-narrow": ("rms_norm", [_t((16, 64)), _t((64,), "bfloat16")], {"eps": 1e-6}),
                  "packed-gemv-bias": ("linear", _packed_linear(1, 32, True), {})}


@pytest.mark.parametrize("case", sorted(REGISTER_CASES))
def test_no_gpu_schedule_reads_a_register_its_thread_did_not_write(case):
    """A stage that writes a register (a "local" buffer) under a thread predicate is read only under that predicate.
    Two such reads raced on an H200 and no serial CPU replay shows them (TVM sizes a stage placed under a
    predicated loop from the unpredicated loop): RMSNorm's thread-0 sum written back by every thread, and a fused
    bias add run by threads past the block's outputs."""
    import tvm_ffi
    from tvm import s_tir

    from compiler.kernels import make_kernel
    from schedules import gpu

    kind, types, attrs = REGISTER_CASES[case]
    realizes = []
    tvm_ffi.structural_map(gpu.schedule(make_kernel(kind, types, attrs).func, kind, attrs, None),
                           [(s_tir.SBlockRealize, lambda r: realizes.append(r) or r)])
    predicated = {w.source.name: str(r.predicate) for r in realizes for w in r.block.writes
                  if w.source.scope() == "local" and str(r.predicate) != "T.bool(True)"}
    for r in realizes:
        for read in r.block.reads:
            condition = predicated.get(read.source.name)
            assert condition is None or condition in str(r.predicate), (
                f"{r.block.name_hint} reads register {read.source.name} without the predicate ({condition}) under "
                f"which it was written")


def test_a_vocabulary_head_gemv_splits_each_dot_product():
    """A decode GEMV with more outputs than any other reduction splits (Qwen2.5's 151,936-row head): each output's
    dot product is spread over a warp's lanes, partial sums through shared memory, not a thread per output (which
    would read 32 weight rows a warp load)."""
    from compiler.kernels import make_kernel
    from schedules import gpu

    types = [_t((1, 896)), _t((151936, 896), "bfloat16")]
    script = gpu.schedule(make_kernel("linear", types, {}).func, "linear", {}, None).script()
    assert 'scope="shared"' in script and 'T.thread_binding(256, thread="threadIdx.x")' in script


@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_gpu_schedules_keep_the_semantics_in_fewer_kernels(case, monkeypatch, tmp_path):
    """Rotary embedding (its cos and sin inlined) and RMSNorm with its residual sum (a thread block per row or group)
    are one GPU kernel each; a decode GEMV and its bias add two (see schedules.gpu._linear); the image and legacy
    attention's seven stages are five kernels (the mask and the exponentials computed where they are read).
    Replayed serially on the CPU, each computes what the kernel does, every output of it."""
    import numpy as np
    import tvm

    from compiler.kernels import make_kernel
    from schedules import gpu

    kind, types, attrs, kernels, ints = FUSED_CASES[case]
    kernel = make_kernel(kind, types, attrs)
    target = cuda_target("sm_90", "ptx")
    cuda.prepare_environment()
    lib = tvm.compile(gpu.schedule(kernel.func, kind, attrs, target), target.tvm_target(),
                      tir_pipeline=target.tir_pipeline())
    (ptx,) = cuda.export_with_ptx(lib, tmp_path / "kernel.so", target)
    assert ptx.count(".entry") == kernels
    rng = np.random.default_rng(0)
    given = iter(ints) if ints else None  # else random ints (positions)
    args = [(next(given) if given else rng.integers(0, 4000, t.shape).astype(np.int32)) if t.dtype == "int32"
            else rng.standard_normal(t.shape).astype(np.float32).astype(t.dtype) for t in types]
    args += list(kernel.constants)
    inputs = len(args)
    args += [np.zeros(tuple(int(d) for d in p.shape), str(p.dtype)) for p in kernel.func.params[inputs:]]
    scheduled = _serial_gpu_schedule(kernel.func, kind, attrs, monkeypatch)
    for got, want in zip(_run_on_cpu(scheduled, args)[inputs:], _run_on_cpu(kernel.func, args)[inputs:], strict=True):
        assert np.isfinite(want).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


PAGED = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "scale": 0.25}
PAGED_CASES = {  # (q rows, pages, block, attrs, block table, row_of, pos_of)
    "decode-two-sequences": (2, 12, 8, PAGED, [[7, 2, 9, -1], [0, 11, 3, 5]], [0, 1], [21, 29]),
    "decode-and-a-row-of-nothing": (2, 12, 8, PAGED, [[7, 2, 9, -1]], [0, 0], [21, -1]),  # no visible position: 0
    "prefill-one-sequence": (6, 12, 8, PAGED, [[4, 1, -1, -1]], [0] * 6, list(range(3, 9))),
    "decode-three-chunks": (1, 40, 16, {"num_heads": 2, "num_kv_heads": 1, "head_dim": 256, "scale": 0.0625},
                            [list(range(39, 19, -1))], [0], [300]),  # head_dim over the block's threads too
    "decode-qwen2.5-heads": (1, 40, 16, {"num_heads": 14, "num_kv_heads": 2, "head_dim": 64, "scale": 0.125},
                             [list(range(20))], [0], [127]),  # exactly one chunk
}


@pytest.mark.parametrize("case", sorted(PAGED_CASES))
def test_paged_attention_is_one_kernel_over_the_visible_positions(case, tmp_path):
    """Paged attention on the GPU is one written kernel (a block per row and head, an online softmax over chunks of
    the row's visible positions). Its emulated form (the same loops on the CPU, each barrier-separated phase a loop
    nest of its own) equals the unscheduled seven-stage kernel; the GPU form is one PTX entry that ptxas takes."""
    import numpy as np
    import tvm

    from compiler.kernels import make_kernel
    from schedules import gpu
    from schedules.gpu_attention import paged_attention

    rows, pages, block, attrs, table, row_of, pos_of = PAGED_CASES[case]
    width, kv = attrs["num_heads"] * attrs["head_dim"], attrs["num_kv_heads"] * attrs["head_dim"]
    ints = _ints(table, row_of, pos_of)
    types = [_t((rows, width)), _t((pages, block, kv)), _t((pages, block, kv))] + [
        _t(a.shape, "int32") for a in ints]
    func = make_kernel("paged_attention", types, attrs).func
    rng = np.random.default_rng(rows)
    args = [rng.standard_normal(t.shape).astype(np.float32) for t in types[:3]] + ints + [
        np.zeros((rows, width), np.float32)]
    want = _run_on_cpu(func, args)[-1]
    assert np.isfinite(want).all()
    np.testing.assert_allclose(_run_on_cpu(paged_attention(func, attrs, emulate=True), args)[-1], want, rtol=1e-5,
                               atol=1e-5)
    target = cuda_target("sm_90", "ptx")
    cuda.prepare_environment()
    lib = tvm.compile(gpu.schedule(func, "paged_attention", attrs, target), target.tvm_target(),
                      tir_pipeline=target.tir_pipeline())
    (ptx,) = cuda.export_with_ptx(lib, tmp_path / "kernel.so", target)
    assert ptx.count(".entry") == 1 and ptx.count("bar.sync") >= 5
    (tmp_path / "k.ptx").write_text(ptx)
    assert subprocess.run(["ptxas", "-arch=sm_90", str(tmp_path / "k.ptx"), "-o", "/dev/null"]).returncode == 0


@pytest.mark.parametrize("compiler", ["ptx", "nvcc"])
def test_awq_model_builds_for_cuda(tmp_path, compiler):
    """A model of AWQ INT4 projections (packed decode GEMVs, prefill GEMMs) builds for CUDA through the direct path and
    CUDA C++, and ptxas accepts every kernel."""
    model = write_tiny_checkpoint(tmp_path / "awq", dtype="float16", awq_group_size=32)
    out = _build(model, tmp_path / "artifact", cuda_compiler=compiler).path
    assert json.loads((out / "manifest.json").read_text())["quantization"]["packed_params"] > 0
    assembled = subprocess.run(["ptxas", "-arch=sm_90", str(out / "kernels.ptx"), "-o", "/dev/null"],
                               capture_output=True, text=True)
    assert assembled.returncode == 0, assembled.stderr


def test_direct_path_refuses_a_warp_synchronous_reduction():
    from tvm import s_tir

    from compiler.kernels import make_kernel

    sch = s_tir.Schedule(make_kernel("linear", [_t((1, 256)), _t((8, 256))], {}).func)
    _, j, k = sch.get_loops(sch.get_sblock("matmul"))
    sch.bind(j, "blockIdx.x")
    sch.bind(sch.split(k, [None, 32])[1], "threadIdx.x")  # TVM lowers this to a warp-synchronous tree
    with pytest.raises(Exception, match="needs a warp-synchronous reduction"):
        direct_ptx(sch.mod["main"])


def test_direct_path_refuses_a_barrier_other_than_the_block_one():
    from tvm.script import tirx as T

    @T.prim_func
    def grid_sync(a: T.Buffer((64,), "float32")):
        for i in T.thread_binding(64, thread="threadIdx.x"):
            a[i] = T.float32(1)
            T.tvm_storage_sync("global")

    with pytest.raises(Exception, match="needs a 'global' barrier, which the NVPTX backend cannot emit"):
        direct_ptx(grid_sync)


GRAPH_SCRIPT = r"""
import json, re, sys, tvm
from runtime.cuda import load_cuda_libraries
from benchmarks.gpu_check import host_launches
load_cuda_libraries()
text = tvm.runtime.load_module(sys.argv[1])["as_text"]()
void = len(re.findall(r"call\s+vm\.builtin\.cuda_graph\.run_or_capture .* dst: %void", text))
print(json.dumps({"void_replays": void, **{name: host_launches(text, name) for name in sys.argv[2:]}}))
"""


@pytest.mark.parametrize("arch_name", ["qwen2", "qwen3_5"])
def test_a_cuda_step_is_one_graph_launch(checkpoints, tmp_path, arch_name):
    """Every step function of a CUDA artifact (each token and row bucket) is one host launch: the replay of one
    CUDA graph of all its kernels, the product that writes the logits (into the caller's buffer) and Qwen3.5's reads
    of the step's token count (a device tensor) included. No replay's result goes to the VM's void register: the
    pinned TVM's VM fails the first call of such a step on a GPU (the replay returns from a VM function into it).
    Loaded here through the stand-in driver: the module's VM code, not a GPU run."""
    import sys

    from cuda_standin import tvm_cuda_loader, write_standin

    artifact = _build(checkpoints[arch_name], tmp_path / "a", batch_rows=(1, 4), kv_pages=32).path
    manifest = json.loads((artifact / "manifest.json").read_text())
    steps = [f for f in manifest["functions"] if f.startswith("step_")]
    assert {"step_t1_r1", "step_t4_r4", "step_t16_r4"} <= set(steps)  # decode and prefill, one row and a batch
    standin = write_standin(tmp_path / "driver", tvm_cuda_loader()).parent
    env = {"LD_LIBRARY_PATH": str(standin), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", GRAPH_SCRIPT, str(artifact / "model.so"), *steps], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    launches = json.loads(done.stdout)
    assert launches == {"void_replays": 0, **{name: {"graphs": 1, "kernels_outside_graphs": 0} for name in steps}}
    counts = cuda.kernel_launches(artifact)
    assert all(counts[name] > 10 for name in steps)  # what the graph saves: that many host launches a step


# tensor-core prefill products (--matmul-precision bfloat16)

@pytest.mark.parametrize("rows,cols,depth,bias", [(16, 64, 32, True), (32, 192, 96, False), (64, 128, 64, True),
                                                  (128, 64, 64, False)])
def test_tensor_core_kernel_computes_the_bf16_rounded_product(rows, cols, depth, bias):
    """The WMMA kernel's tiling, replayed on the CPU (its loops serial, the four WMMA calls as loops over plain
    fragment buffers), gives the product of the activations rounded to bfloat16 (to nearest, ties to even) and the
    bfloat16 weights, summed in float32: numpy's, for each warp layout (16, 32, 64 rows a block)."""
    import ml_dtypes
    import numpy as np

    from compiler.kernels import make_kernel
    from schedules.gpu_wmma import wmma_gemm

    types = [_t((rows, depth)), _t((cols, depth), "bfloat16")] + ([_t((cols,), "bfloat16")] if bias else [])
    rng = np.random.default_rng(rows + cols)
    x = (rng.standard_normal((rows, depth)) * 4).astype(np.float32)
    w = rng.standard_normal((cols, depth)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(cols).astype(ml_dtypes.bfloat16)
    args = [x, w] + ([b] if bias else []) + [np.zeros((rows, cols), np.float32)]
    got = _run_on_cpu(wmma_gemm(make_kernel("linear", types, {}).func, emulate=True), args)[-1]
    bias_values = b.astype(np.float64) if bias else 0
    want = x.astype(ml_dtypes.bfloat16).astype(np.float64) @ w.astype(np.float64).T + bias_values
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.abs(x @ w.astype(np.float32).T - want).max() > 1e-2  # the rounding shows: a float32 product would fail


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_bf16_products_build_prefill_on_tensor_cores(checkpoints, tmp_path, arch):
    """`--matmul-precision bfloat16` with nvcc: the prefill products of bfloat16 weights are WMMA kernels (bf16
    mma.sync in the PTX, which ptxas accepts for the arch), the decode GEMVs stay float32, and the manifest and the
    rebuild options record it; the default build has no tensor-core instruction."""
    artifact = _build(checkpoints["qwen2"], tmp_path / "bf16", arch=arch, cuda_compiler="nvcc",
                      matmul_precision="bfloat16").path
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["target"]["matmul_precision"] == "bfloat16" and manifest["target"]["bf16_products"] == "wmma"
    assert manifest["build_options"][-2:] == ["--matmul-precision", "bfloat16"]
    ptx = (artifact / "kernels.ptx").read_text()
    assert re.search(r"wmma\.mma\.sync\.aligned\.row\.col\.m16n16k16\.f32\.bf16\.bf16\.f32", ptx)
    assert subprocess.run(["ptxas", f"-arch={arch}", str(artifact / "kernels.ptx"), "-o", "/dev/null"]).returncode == 0
    plain = _build(checkpoints["qwen2"], tmp_path / "f32", arch=arch, cuda_compiler="nvcc").path
    assert "mma.sync" not in (plain / "kernels.ptx").read_text()
    assert json.loads((plain / "manifest.json").read_text())["target"]["bf16_products"] is None


def test_bf16_products_need_a_cuda_cpp_path_and_auto_picks_them_where_it_can():
    from compiler.build import make_target

    with pytest.raises(CudaBuildError, match="direct PTX path .* cannot emit; add --cuda-compiler nvcc"):
        make_target("cuda", cuda_compiler="ptx", matmul_precision="bfloat16")
    with pytest.raises(CudaBuildError, match="'float16' is not one of float32, bfloat16, auto"):
        make_target("cuda", cuda_compiler="nvcc", matmul_precision="float16")
    auto = make_target("cuda", cuda_compiler="nvcc", matmul_precision="auto")
    assert auto.for_weights("bfloat16").bf16_products == "wmma"
    assert auto.for_weights("float32").matmul_precision == "float32"
    assert make_target("cuda", cuda_compiler="ptx", matmul_precision="auto").for_weights("bfloat16").bf16_products \
        is None
    assert make_target("cuda").bf16_products is None  # the default: float32
