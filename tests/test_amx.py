"""bfloat16 prefill products on AMX tiles (`--matmul-precision bfloat16`), of bfloat16 and of AWQ weights: the
kernels against numpy on bfloat16-rounded activations, the option's errors, and a whole model against
transformers."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import tvm
from bf16_cases import (assert_bf16_prefill_tracks, assert_chunk_rounded_and_rows_float32, awq_product_case,
                        chunk_after_history)

from compiler.build import build
from compiler.kernels import make_kernel
from compiler.target import cpu_target
from ir import TensorType
from ir.packing import KQ_BLOCK, Packing
from models.tiny import write_tiny_checkpoint
from runtime import CompiledModel
from ir.contract import ArtifactError
from ir.cpu_features import host_cpu_flags
from runtime.cpu import enable_amx
from schedules import cpu
from schedules.amx import amx_awq_gemm, amx_gemm
from schedules.cpu_attention import paged_attention

HAS_AMX = {"amx_tile", "amx_bf16"} <= host_cpu_flags()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16 tiles")
RNG = np.random.default_rng(5)


def run_bf16_kernel(kind: str, inputs: list[np.ndarray], attrs: dict, out_shape) -> tuple[np.ndarray, str]:
    """The kernel of `kind` as a bfloat16 build schedules it, run on these arrays; (its float32 output, its
    assembly)."""
    target = cpu_target(matmul_precision="bfloat16")
    kernel = make_kernel(kind, [TensorType(a.shape, str(a.dtype)) for a in inputs], attrs)
    lib = tvm.compile(cpu.schedule(kernel.func, kind, attrs, target), target.tvm_target())
    enable_amx()
    out = tvm.runtime.empty(out_shape, "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
    return out.numpy(), lib.mod.inspect_source("asm")


def run_linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, str]:
    """The linear kernel of a bfloat16 build on these arrays; (output, its assembly)."""
    inputs = [x, w] + ([bias] if bias is not None else [])
    return run_bf16_kernel("linear", inputs, {}, (x.shape[0], w.shape[0]))


@needs_amx
@pytest.mark.parametrize("rows,depth,cols", [(32, 32, 32), (64, 96, 160), (128, 896, 128), (32, 2048, 64)])
@pytest.mark.parametrize("bias", [None, "bfloat16", "float32"])
def test_amx_products_match_numpy_on_rounded_activations(rows, depth, cols, bias, rng=RNG):
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    w = (rng.standard_normal((cols, depth)) * depth ** -0.5).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(cols).astype(bias) if bias else None
    got, asm = run_linear(x, w, b)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float64) @ w.astype(np.float64).T
    want += b.astype(np.float64) if bias else 0
    assert "tdpbf16ps" in asm
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
    exact = x.astype(np.float64) @ w.astype(np.float64).T + (b.astype(np.float64) if bias else 0)
    assert np.abs(got - exact).max() > 1e-4 * float(np.abs(exact).max())  # the activations really were rounded


@needs_amx
@pytest.mark.parametrize("rows,depth,cols", [(16, 64, 64), (48, 96, 160)])
@pytest.mark.parametrize("bias", [None, "bfloat16"])
def test_amx_products_of_16_row_blocks_match_numpy(rows, depth, cols, bias):
    """Token rows in blocks of 16 (a prefill chunk of 16, a step of 16 or 48 rows): one activation tile a block."""
    test_amx_products_match_numpy_on_rounded_activations(rows, depth, cols, bias, np.random.default_rng(rows))


@needs_amx
def test_activations_round_to_nearest_bfloat16_ties_to_even():
    one_ulp = 2.0 ** -7  # of bfloat16 at 1.0
    values = [1 + one_ulp / 2, 1 + 3 * one_ulp / 2, 1 + one_ulp / 2 + 2 ** -20, -(1 + one_ulp / 2), 3.0e38, 1.2345e-3]  # (AMX flushes subnormals to 0)
    x = np.zeros((32, 32), np.float32)
    x[0, :len(values)] = values
    got, _ = run_linear(x, np.eye(32, dtype=ml_dtypes.bfloat16), None)  # y = bfloat16(x) exactly
    np.testing.assert_array_equal(got[0, :len(values)], x[0, :len(values)].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert got[0, 0] == 1.0 and got[0, 1] == 1 + 2 * one_ulp


@needs_amx
@pytest.mark.parametrize("rows,depth,cols,group", [(32, 64, 64, 32), (64, 256, 192, 64), (128, 512, 128, 128),
                                                  (32, 128, 64, 128), (32, 64, 64, 16), (64, 96, 192, 16)])
@pytest.mark.parametrize("bias", [None, "float16"])
@pytest.mark.parametrize("kind,planes", [("awq_int4_pairs", 1), ("affine_int4_pairs", 1), ("awq_int4_pairs", 2),
                                         ("affine_int4_pairs", 2)])
def test_amx_awq_products_are_exact_in_the_weights(rows, depth, cols, group, bias, kind, planes):
    """AWQ prefill on AMX tiles: the 4-bit values enter as their exact bfloat16, zero points (or an affine kind's
    offsets) and scales are applied per group in float32, so only the activations are rounded; a weight of planes
    sums each group's planes; groups of 16 rows take dot products of half the depth."""
    kernel, inputs, want = awq_product_case(RNG, rows, depth, cols, group, bias, kind, planes)
    target = cpu_target(matmul_precision="bfloat16")
    lib = tvm.compile(cpu.schedule(kernel, "linear", {}, target), target.tvm_target())
    enable_amx()
    out = tvm.runtime.empty((rows, cols), "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
    assert "tdpbf16ps" in lib.mod.inspect_source("asm")
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=2e-6 * float(np.abs(want).max()))


@needs_amx
@pytest.mark.parametrize("kind,planes,group", [("affine_int4_pairs", 1, 32), ("awq_int4_pairs", 2, 32),
                                               ("affine_int4_pairs", 2, 32), ("awq_int4_pairs", 1, 16),
                                               ("affine_int4_pairs", 1, 16), ("awq_int4_pairs", 2, 16)])
def test_amx_awq_products_with_two_level_scales_are_exact_in_the_weights(kind, planes, group):
    """A GGUF K-quant's two-level scales and offsets (ir.packing) on AMX tiles: two blocks of eight groups of 32
    (Q4_K, Q5_K) or sixteen of 16 (Q3_K, Q2_K, Q6_K); in tdpbf16ps, not the float32 fallback."""
    kernel, inputs, want = awq_product_case(RNG, 32, 512, 64, group, "float16", kind, planes, KQ_BLOCK)
    target = cpu_target(matmul_precision="bfloat16")
    lib = tvm.compile(cpu.schedule(kernel, "linear", {}, target), target.tvm_target())
    enable_amx()
    out = tvm.runtime.empty((32, 64), "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
    assert "tdpbf16ps" in lib.mod.inspect_source("asm")
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=2e-6 * float(np.abs(want).max()))


def test_awq_shapes_that_do_not_fill_the_tiles_keep_float32_products():
    for rows, depth, cols, group in [(16, 64, 64, 32), (16, 64, 64, 16), (32, 64, 32, 32), (32, 64, 32, 16),
                                     (32, 48, 64, 16)]:  # three groups of 16: no whole 32s of depth
        types = [TensorType((rows, depth), "float32"),
                 TensorType((cols, depth), "float16", Packing("awq_int4_pairs", group))]
        assert amx_awq_gemm(make_kernel("linear", types, {}).func) is None


def test_shapes_that_do_not_fill_the_tiles_keep_float32_products():
    for rows, depth, cols, dtype in [(8, 64, 64, "bfloat16"), (24, 64, 64, "bfloat16"), (32, 48, 64, "bfloat16"),
                                     (32, 64, 48, "bfloat16"), (32, 64, 64, "float16"), (32, 64, 64, "float32"),
                                     (1, 64, 64, "bfloat16")]:
        kernel = make_kernel("linear", [TensorType((rows, depth), "float32"), TensorType((cols, depth), dtype)], {})
        assert amx_gemm(kernel.func) is None


@needs_amx
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (14, 2, 64), (2, 1, 256), (4, 4, 128)])
def test_amx_prefill_attention_matches_numpy_on_rounded_operands(heads, kv_heads, head_dim):
    """Two 32-row blocks of a prefill chunk deep in a sequence on AMX tiles, against numpy with the operands rounded
    to bfloat16; a third block of decode rows of other sequences and padding stays float32."""
    inputs, attrs, chunk = chunk_after_history(RNG, heads, kv_heads, head_dim)
    got, asm = run_bf16_kernel("paged_attention", inputs, attrs, inputs[0].shape)
    assert "tdpbf16ps" in asm
    assert_chunk_rounded_and_rows_float32(got, inputs, attrs, chunk)


def test_attention_blocks_that_do_not_fill_the_tiles_keep_float32_products():
    """Head dimensions that are not whole tile depths, and 16-row blocks (rows not a multiple of 32), stay on the
    float32 block kernel in a bfloat16 build."""
    for rows, head_dim in [(64, 48), (48, 64)]:
        cache = TensorType((4, 16, 2 * head_dim), "float32")
        types = [TensorType((rows, 4 * head_dim), "float32"), cache, cache, TensorType((1, 4), "int32"),
                 TensorType((rows,), "int32"), TensorType((rows,), "int32")]
        attrs = {"num_heads": 4, "num_kv_heads": 2, "head_dim": head_dim, "scale": head_dim ** -0.5}
        written = paged_attention(make_kernel("paged_attention", types, attrs).func, attrs, 16, "amx")
        assert "tdpbf16ps" not in written.script()


@needs_amx
def test_whole_model_with_amx_prefill_tracks_transformers(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_dir = write_tiny_checkpoint(tmp_path / "model", arch="qwen2", dtype="bfloat16", seed=4, head_dim=32)
    artifact = build(model_dir, out=tmp_path / "amx", prefill_buckets=(32,), max_context=64,
                     matmul_precision="bfloat16", quiet=True).path
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["target"]["matmul_precision"] == "bfloat16" and "amx-bf16" in manifest["target"]["features"]
    ours = CompiledModel(model_dir, artifact)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # 40 tokens: a 32-row chunk whose attention runs on tiles too (head_dim 32), then 8 rows and padding
    assert_bf16_prefill_tracks(ours, hf, [int(t) for t in RNG.integers(0, ours.config.vocab_size, 40)])

    def refuse():
        raise OSError(1, "Linux refused this process AMX tile state (test)")
    monkeypatch.setattr("runtime.artifact.enable_amx", refuse)
    with pytest.raises(ArtifactError, match="runs its prefill products on AMX tiles, but Linux refused.*rebuild without"):
        CompiledModel(model_dir, artifact)
