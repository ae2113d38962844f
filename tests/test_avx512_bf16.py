"""bfloat16 prefill products as AVX512-BF16 dot products (`--matmul-precision bfloat16` on CPUs without AMX), decode
products along the depth on them, and prompt chunks' attention products on them where the CPU issues them at its
FMA rate, the choice between the two bfloat16 paths, `--matmul-precision auto`, and their errors.

The kernel runs here on any x86 CPU with `PORTABLE_DOT`: the instruction's arithmetic (each lane adds its odd
pair's product, then its even pair's, in float32; bfloat16 products are exact in float32) in plain LLVM IR, so
the layout, tiling and depth blocks are checked against numpy everywhere. The instruction itself runs where the
host has AVX512-BF16, and every machine checks that the kernel compiles to it for such CPUs.
"""

from __future__ import annotations

import json
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import tvm
from bf16_cases import (assert_bf16_prefill_tracks, assert_chunk_rounded_and_rows_float32, awq_product_case,
                        chunk_after_history)

from compiler.build import BuildError, build, make_target
from compiler.kernels import make_kernel
from compiler.target import TargetError, cpu_target
from ir import TensorType
from ir.contract import ArtifactError
from ir.cpu_features import host_cpu_flags
from ir.packing import KQ_BLOCK
from models.tiny import write_tiny_checkpoint
from runtime import CompiledModel
from schedules import cpu
from schedules.avx512_bf16 import DOT, DPBF16PS_IR, dpbf16_awq_gemm, dpbf16_gemm
from schedules.cpu_attention import paged_attention
from schedules.cpu_awq import awq_linear

HAS_AVX512_BF16 = {"avx512f", "avx512_bf16"} <= host_cpu_flags()
needs_avx512_bf16 = pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU has no AVX512-BF16 dot products")
HOST = cpu_target().tvm_target()
RNG = np.random.default_rng(19)

PORTABLE_DOT = f"""
define linkonce_odr <16 x float> @{DOT}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {{
  %a_even = shl <16 x i32> %a, splat (i32 16)
  %a_odd = and <16 x i32> %a, splat (i32 -65536)
  %b_even = shl <16 x i32> %b, splat (i32 16)
  %b_odd = and <16 x i32> %b, splat (i32 -65536)
  %fa_even = bitcast <16 x i32> %a_even to <16 x float>
  %fa_odd = bitcast <16 x i32> %a_odd to <16 x float>
  %fb_even = bitcast <16 x i32> %b_even to <16 x float>
  %fb_odd = bitcast <16 x i32> %b_odd to <16 x float>
  %odd = fmul <16 x float> %fa_odd, %fb_odd
  %with_odd = fadd <16 x float> %acc, %odd
  %even = fmul <16 x float> %fa_even, %fb_even
  %sum = fadd <16 x float> %with_odd, %even
  ret <16 x float> %sum
}}
"""


def linear_kernel(rows: int, depth: int, cols: int, bias: str | None = None):
    """The `linear` compute definition for these shapes and bfloat16 weights."""
    types = [TensorType((rows, depth), "float32"), TensorType((cols, depth), "bfloat16")]
    return make_kernel("linear", types + ([TensorType((cols,), bias)] if bias else []), {}).func


def run(func, inputs: list[np.ndarray], rows: int, cols: int) -> np.ndarray:
    """Compile `func` for this host and run it on `inputs`."""
    lib = tvm.compile(func, HOST)
    out = tvm.runtime.empty((rows, cols), "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
    return out.numpy()


def random_inputs(rows: int, depth: int, cols: int, bias: str | None, rng=RNG) -> list[np.ndarray]:
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    w = (rng.standard_normal((cols, depth)) * depth ** -0.5).astype(ml_dtypes.bfloat16)
    return [x, w] + ([rng.standard_normal(cols).astype(bias)] if bias else [])


def reference(inputs: list[np.ndarray], rounded: bool = True) -> np.ndarray:
    """x @ w.T + b in float64, with x rounded to bfloat16 first (`rounded`) as the kernel rounds it."""
    x, w, *bias = inputs
    x = x.astype(ml_dtypes.bfloat16) if rounded else x
    return x.astype(np.float64) @ w.astype(np.float64).T + (bias[0].astype(np.float64) if bias else 0)


@pytest.mark.parametrize("rows,depth,cols", [
    (32, 64, 64),  # 2 token vectors x 8 weight rows per tile, 16-column tasks (each one 16 x 16 block of y)
    (64, 896, 128),  # 4 x 4 tiles, 16-column tasks
    (256, 2816, 64),  # 1408 depth pairs: blocks of 352, the sums carried between blocks; 16 x 16 blocks of y
    (48, 130, 16),  # 3 token vectors (1 per tile), 65 pairs (one block)
    (16, 4106, 32),  # 2053 depth pairs (prime): no block size divides it, one pass over the whole depth
    (32, 64, 1024),  # 64-column tasks: four blocks of y across
])
@pytest.mark.parametrize("bias", [None, "bfloat16", "float32"])
def test_kernel_matches_numpy_on_rounded_activations(rows, depth, cols, bias):
    inputs = random_inputs(rows, depth, cols, bias)
    got = run(dpbf16_gemm(linear_kernel(rows, depth, cols, bias), PORTABLE_DOT), inputs, rows, cols)
    want = reference(inputs)
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-6 * float(np.abs(want).max()))  # float32 sums of 4106
    exact = reference(inputs, rounded=False)
    assert np.abs(got - exact).max() > 1e-4 * float(np.abs(exact).max())  # the activations really were rounded


@pytest.mark.parametrize("rows,depth,cols,group", [
    (32, 64, 64, 32),  # 2 token vectors x 8 columns a register tile, one column tile
    (64, 256, 192, 64),  # 4 x 4 tiles, three column tiles (tasks)
    (128, 512, 128, 128),  # 8 token vectors, groups of 128 (64 pairs unpacked at a time)
    (48, 128, 64, 16),  # 3 token vectors, one a tile; groups of 16
])
@pytest.mark.parametrize("bias", [None, "float16"])
@pytest.mark.parametrize("kind,planes", [("awq_int4_pairs", 1), ("affine_int4_pairs", 1), ("awq_int4_pairs", 2),
                                         ("affine_int4_pairs", 2)])
def test_awq_products_are_exact_in_the_weights(rows, depth, cols, group, bias, kind, planes):
    """AWQ prefill on dot products: the 4-bit values enter as their exact bfloat16, zero points (or an affine
    kind's offsets) and scales are applied per group in float32, so only the activations are rounded; a weight of
    two planes enters as its 8-bit values 16 h + l, exact too."""
    kernel, inputs, want = awq_product_case(RNG, rows, depth, cols, group, bias, kind, planes)
    got = run(dpbf16_awq_gemm(kernel, PORTABLE_DOT), inputs, rows, cols)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(np.abs(want).max()))


@pytest.mark.parametrize("rows,depth,cols,group", [(32, 512, 64, 32), (48, 256, 128, 16)])
@pytest.mark.parametrize("kind,planes", [("affine_int4_pairs", 1), ("awq_int4_pairs", 1), ("awq_int4_pairs", 2),
                                         ("affine_int4_pairs", 2)])
def test_awq_products_with_two_level_scales_are_exact_in_the_weights(rows, depth, cols, group, kind, planes):
    """A GGUF K-quant's scales and offsets as its two levels (ir.packing: a block's float times a group's byte),
    over several blocks and several words of bytes a block: exact in the weights as above."""
    kernel, inputs, want = awq_product_case(RNG, rows, depth, cols, group, "float16", kind, planes, KQ_BLOCK)
    got = run(dpbf16_awq_gemm(kernel, PORTABLE_DOT), inputs, rows, cols)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(np.abs(want).max()))


def test_awq_shapes_that_do_not_fit_the_dot_product_gemm_keep_their_other_kernel():
    for rows, cols in [(24, 64), (32, 32)]:  # token rows no multiple of 16; 4-word column tiles, not 16
        kernel, _, _ = awq_product_case(RNG, rows, 64, cols, 32, None, "awq_int4_pairs", 1)
        assert dpbf16_awq_gemm(kernel) is None


@needs_avx512_bf16
def test_awq_products_on_the_instruction_as_on_the_portable_dot():
    kernel, inputs, want = awq_product_case(RNG, 64, 256, 192, 64, "float16", "awq_int4_pairs", 1)
    lib = tvm.compile(dpbf16_awq_gemm(kernel), HOST)
    assert "vdpbf16ps" in lib.mod.inspect_source("asm")
    got = tvm.runtime.empty((64, 192), "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in inputs], got)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2e-6 * float(np.abs(want).max()))


@pytest.mark.parametrize("rows,depth,cols,group", [
    (1, 256, 128, 64),  # one row: two 16-word tiles a task
    (3, 512, 64, 128),  # one tile, three rows
    (8, 256, 192, 32),  # eight sequences' decode, 32-row groups (blocks of x as long)
    (24, 256, 64, 64),  # a prompt chunk of no multiple of 16 rows
])
@pytest.mark.parametrize("kind,planes", [("awq_int4_pairs", 1), ("affine_int4_pairs", 1), ("awq_int4_pairs", 2)])
def test_awq_decode_rows_on_dot_products_are_exact_in_the_weights(rows, depth, cols, group, kind, planes):
    """AWQ decode in a bf16 build on AVX512-BF16: x rounded once, each 4-bit value entering as the bfloat16 of 128
    + q and the 128 taken off with x's sum, so the products are those of the rounded x and the exact weights, to
    the float32 rounding of sums that carry 128 x sum of x (some 17 times the values' own: 1e-5 of the largest
    output, where a wrong value or scale is off by 1e-2)."""
    kernel, inputs, want = awq_product_case(RNG, rows, depth, cols, group, "float16", kind, planes)
    got = run(awq_linear(kernel, 16, True, PORTABLE_DOT), inputs, rows, cols)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


@needs_avx512_bf16
def test_awq_decode_rows_on_the_instruction_as_on_the_portable_dot():
    kernel, inputs, want = awq_product_case(RNG, 1, 512, 256, 128, "float16", "awq_int4_pairs", 1)
    lib = tvm.compile(awq_linear(kernel, 16, True, DPBF16PS_IR), HOST)
    assert "vdpbf16ps" in lib.mod.inspect_source("asm")
    got = tvm.runtime.empty((1, 256), "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in inputs], got)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def test_activations_round_to_nearest_bfloat16_ties_to_even():
    one_ulp = 2.0 ** -7  # of bfloat16 at 1.0
    values = [1 + one_ulp / 2, 1 + 3 * one_ulp / 2, 1 + one_ulp / 2 + 2 ** -20, -(1 + one_ulp / 2), 3.0e38, 1.2345e-3]
    x = np.zeros((16, 32), np.float32)
    x[0, :len(values)] = values
    got = run(dpbf16_gemm(linear_kernel(16, 32, 32), PORTABLE_DOT), [x, np.eye(32, dtype=ml_dtypes.bfloat16)], 16, 32)
    rounded = x[0, :len(values)].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got[0, :len(values)], rounded)
    assert got[0, 0] == 1.0 and got[0, 1] == 1 + 2 * one_ulp


@needs_avx512_bf16
@pytest.mark.parametrize("rows,depth,cols", [(32, 64, 64), (64, 896, 128), (256, 2816, 64)])
def test_the_instruction_computes_what_the_portable_dot_does(rows, depth, cols):
    inputs = random_inputs(rows, depth, cols, "float32")
    got = run(dpbf16_gemm(linear_kernel(rows, depth, cols, "float32")), inputs, rows, cols)
    portable = run(dpbf16_gemm(linear_kernel(rows, depth, cols, "float32"), PORTABLE_DOT), inputs, rows, cols)
    np.testing.assert_allclose(got, portable, rtol=1e-6, atol=1e-6 * float(np.abs(portable).max()))
    want = reference(inputs)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(np.abs(want).max()))


def rows_kernel(rows: int, depth: int, cols: int, bias: str | None = None, prefetching: bool | None = None,
                dot_ir: str = PORTABLE_DOT, mcpu: str = "znver4"):
    """The few-row product on dot products for these shapes (`dot_ir`: the portable one, or the instruction)."""
    return cpu._rows_gemv(linear_kernel(rows, depth, cols, bias), cpu_target(mcpu, "bfloat16"), prefetching, dot_ir)


@pytest.mark.parametrize("rows,depth,cols", [
    (1, 64, 16),  # one step of the depth a row
    (1, 896, 128),  # short rows: runs of two per task
    (1, 5632, 96),  # long rows: one per task
    (1, 128, 7),  # a prime number of weight rows
    (3, 896, 24),  # a group of three x rows over each weight row
    (8, 1792, 48),  # x rows of 28 KiB in bfloat16: one pass, where in float32 they outgrow L1
    (16, 3072, 48),  # they outgrow it: tasks of 16 weight rows in 4-row tiles, several depth blocks
    (1, 9216, 48),  # one x row and its weight row outgrow L1: the same, two depth blocks
])
@pytest.mark.parametrize("bias", [None, "bfloat16", "float32"])
@pytest.mark.parametrize("prefetching", [False, True])
def test_decode_rows_match_numpy_on_their_rounded_activations(rows, depth, cols, bias, prefetching):
    inputs = random_inputs(rows, depth, cols, bias, np.random.default_rng(depth))  # RNG's draws stay the others'
    got = run(rows_kernel(rows, depth, cols, bias, prefetching), inputs, rows, cols)
    want = reference(inputs)
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-6 * float(np.abs(want).max()))
    exact = reference(inputs, rounded=False)
    assert np.abs(got - exact).max() > 1e-4 * float(np.abs(exact).max())  # x really was rounded


@needs_avx512_bf16
@pytest.mark.parametrize("rows,depth,cols", [(1, 896, 128), (1, 5632, 96), (8, 2048, 48), (16, 3072, 48)])
def test_the_instruction_computes_the_decode_rows_as_the_portable_dot_does(rows, depth, cols):
    inputs = random_inputs(rows, depth, cols, "float32", np.random.default_rng(depth))
    got = run(rows_kernel(rows, depth, cols, "float32", dot_ir=DPBF16PS_IR, mcpu=None), inputs, rows, cols)
    portable = run(rows_kernel(rows, depth, cols, "float32", mcpu=None), inputs, rows, cols)
    np.testing.assert_allclose(got, portable, rtol=1e-6, atol=1e-6 * float(np.abs(portable).max()))


@pytest.mark.parametrize("mcpu,rows,depth,dots,prefetches", [
    ("znver5", 1, 5632, True, True), ("znver5", 1, 2048, True, True),  # Zen 5, one row of a page or more: dot
    ("cooperlake", 1, 896, True, True),  # products with software prefetches, as at every depth on other CPUs
    ("znver5", 1, 1024, False, True), ("znver5", 1, 896, False, True),  # shorter: the widening form, eager ones
    ("znver5", 4, 1024, True, True),  # several rows: dot products
    ("znver4", 1, 5632, True, False), ("znver4", 1, 2112, True, False),  # Zen 4, one row longer than a page: dot
    # products, prefetching left to the hardware
    ("znver4", 1, 2048, False, False), ("znver4", 1, 1024, False, False),  # ... a page or less: the widening form,
    ("znver4", 1, 896, False, False),  # without prefetches either
    ("znver4", 4, 5632, True, True), ("znver4", 4, 1024, True, True),  # several rows: dot products, prefetches
    ("znver4", 1, 9216, True, True)])  # one row in depth blocks (x and a weight row outgrow L1): prefetches
def test_decode_rows_take_dot_products_and_software_prefetches_where_they_stream_faster(mcpu, rows, depth, dots,
                                                                                       prefetches):
    kernel = cpu.schedule(linear_kernel(rows, depth, 256), "linear", {}, cpu_target(mcpu, "bfloat16"))
    assert (DOT in kernel.script()) == dots
    assert ("llvm.prefetch" in kernel.script()) == prefetches



@pytest.mark.parametrize("depth", [896, 1024, 5632])
def test_an_intel_core_with_amx_off_keeps_short_decode_rows_on_dot_products(depth):
    """An Intel core whose host turned AMX off builds bf16 products on AVX512-BF16 dot products; its one-row decode
    products take them at every depth (the widening form for short rows was measured faster on Zen 5 only), though
    its widening form, where the float32 build runs it, prefetches eagerly."""
    target = replace(cpu_target("sapphirerapids", "bfloat16"), bf16_path="avx512bf16")
    assert target.bf16_products == "avx512bf16" and target.eager_prefetch and not target.short_rows_widened
    kernel = cpu.schedule(linear_kernel(1, depth, 256), "linear", {}, target)
    assert DOT in kernel.script()

def test_decode_shapes_that_do_not_fit_keep_float32_products():
    for rows, depth, dtype in [(1, 96, "bfloat16"), (2, 48, "bfloat16"), (17, 64, "bfloat16"), (2, 64, "float16"),
                               (1, 64, "float32")]:
        assert cpu._rows_gemv(make_kernel("linear", [TensorType((rows, depth), "float32"),
                                                     TensorType((32, depth), dtype)], {}).func,
                              cpu_target("znver4", "bfloat16"), dot_ir=PORTABLE_DOT) is None


def run_attention(inputs: list[np.ndarray], attrs: dict, monkeypatch, dot_ir: str | None) -> tuple[np.ndarray, str]:
    """The paged-attention kernel with its prompt chunks' products as dot products (`dot_ir`: the portable one;
    None: the instruction), compiled for this host and run on `inputs`; (its output, its assembly)."""
    if dot_ir is not None:
        monkeypatch.setattr("schedules.avx512_bf16_attention.DPBF16PS_IR", dot_ir)
    kernel = make_kernel("paged_attention", [TensorType(a.shape, str(a.dtype)) for a in inputs], attrs)
    lib = tvm.compile(paged_attention(kernel.func, attrs, 16, "avx512bf16").with_attr("tirx.noalias", True), HOST)
    out = tvm.runtime.empty(inputs[0].shape, "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
    return out.numpy(), lib.mod.inspect_source("asm")


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (14, 2, 64), (2, 1, 256), (4, 4, 128), (6, 2, 48)])
def test_attention_on_dot_products_matches_numpy_on_rounded_operands(heads, kv_heads, head_dim, monkeypatch):
    """Two 32-row blocks of a prompt chunk deep in a sequence (an odd number of positions seen by its first
    rows, 48 = three vectors of head dimensions) as dot products of pairs, against numpy with q, keys,
    probabilities and values rounded to bfloat16; decode rows of other sequences and padding stay float32."""
    inputs, attrs, chunk = chunk_after_history(RNG, heads, kv_heads, head_dim)
    got, _ = run_attention(inputs, attrs, monkeypatch, PORTABLE_DOT)
    assert_chunk_rounded_and_rows_float32(got, inputs, attrs, chunk)


@needs_avx512_bf16
def test_attention_on_the_instruction_matches_numpy_on_rounded_operands(monkeypatch):
    inputs, attrs, chunk = chunk_after_history(RNG, 14, 2, 64)
    got, asm = run_attention(inputs, attrs, monkeypatch, None)
    assert asm.count("vdpbf16ps") >= 14 + 16  # both products' register tiles, unrolled
    assert_chunk_rounded_and_rows_float32(got, inputs, attrs, chunk)


def test_attention_runs_on_dot_products_only_where_they_issue_at_the_fma_rate():
    """AMD Zen 4 and 5 issue vdpbf16ps as fast as their FMAs: their bfloat16 builds' attention runs on it. Intel's
    issue it slower (Cooper Lake; a Xeon with AMX, where tiles take the attention anyway): float32 attention."""
    assert cpu_target("znver5", "bfloat16").bf16_attention == "avx512bf16"
    assert cpu_target("znver4", "auto").for_weights("bfloat16").bf16_attention == "avx512bf16"
    assert cpu_target("cooperlake", "bfloat16").bf16_attention is None
    assert cpu_target("sapphirerapids", "bfloat16").bf16_attention == "amx"
    assert cpu_target("znver5", "float32").bf16_attention is None
    types = [TensorType((64, 4 * 64), "float32"), TensorType((4, 16, 128), "float32"),
             TensorType((4, 16, 128), "float32"), TensorType((1, 4), "int32"), TensorType((64,), "int32"),
             TensorType((64,), "int32")]
    attrs = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "scale": 0.125}
    for mcpu, dots in [("znver5", True), ("cooperlake", False)]:
        target = cpu_target(mcpu, "bfloat16")
        kernel = cpu.schedule(make_kernel("paged_attention", types, attrs).func, "paged_attention", attrs, target)
        asm = tvm.compile(kernel, target.tvm_target()).mod.inspect_source("asm")
        assert ("vdpbf16ps" in asm) == dots


def test_shapes_that_do_not_fit_keep_float32_products():
    for rows, depth, cols, dtype in [(24, 64, 64, "bfloat16"), (32, 63, 64, "bfloat16"), (32, 64, 63, "bfloat16"),
                                     (32, 64, 40, "bfloat16"), (32, 64, 64, "float16"), (32, 64, 64, "float32")]:
        types = [TensorType((rows, depth), "float32"), TensorType((cols, depth), dtype)]
        assert dpbf16_gemm(make_kernel("linear", types, {}).func) is None


@pytest.mark.parametrize("mcpu", ["znver4", "znver5", "cooperlake"])
def test_cpus_with_avx512_bf16_and_no_amx_compile_prefill_and_decode_products_to_vdpbf16ps(mcpu):
    """Prefill and decode products of bfloat16 and of AWQ weights."""
    target = cpu_target(mcpu, "bfloat16")
    assert target.bf16_products == "avx512bf16" and "avx512bf16" in target.features
    assert "amx-tile" not in target.features
    prefill, decode = linear_kernel(64, 896, 128), linear_kernel(1, 4864, 128)  # Zen 4: decode rows beyond a page
    asm = tvm.compile(cpu.schedule(prefill, "linear", {}, target), target.tvm_target()).mod.inspect_source("asm")
    assert asm.count("vdpbf16ps") >= 16  # the 4 x 4 register tile, unrolled
    asm = tvm.compile(cpu.schedule(decode, "linear", {}, target), target.tvm_target()).mod.inspect_source("asm")
    assert asm.count("vdpbf16ps") >= 2  # one-row decode: two dot products a step
    asm = tvm.compile(cpu.schedule(linear_kernel(8, 896, 128), "linear", {}, target),
                      target.tvm_target()).mod.inspect_source("asm")
    assert asm.count("vdpbf16ps") >= 8  # eight sequences' decode: one dot product per row a step
    for rows, unpacking in [(64, "vpermw"), (1, "vpternlogd")]:  # AWQ prefill, AWQ decode: values to bfloat16
        awq, _, _ = awq_product_case(RNG, rows, 256, 128, 128, None, "awq_int4_pairs", 1)
        asm = tvm.compile(cpu.schedule(awq, "linear", {}, target), target.tvm_target()).mod.inspect_source("asm")
        assert asm.count("vdpbf16ps") >= 8 and unpacking in asm and "vpdpwssd" not in asm


def test_the_path_each_cpu_gets_and_what_auto_resolves_to():
    assert cpu_target("sapphirerapids", "bfloat16").bf16_products == "amx"  # AMX first where both exist
    assert {"amx-tile", "amx-bf16"} <= set(cpu_target("sapphirerapids", "bfloat16").features)
    assert "amx-tile" not in cpu_target("sapphirerapids").features  # float32 builds do not require AMX hosts
    auto = cpu_target("znver5", "auto")
    assert auto.for_weights("bfloat16").bf16_products == "avx512bf16"
    assert auto.for_weights("bfloat16").matmul_precision == "bfloat16"
    assert auto.for_weights("float32").matmul_precision == "float32"
    assert auto.for_weights("float32").bf16_products is None
    amx = cpu_target("sapphirerapids", "auto").for_weights("bfloat16")
    assert amx.bf16_products == "amx" and {"amx-tile", "amx-bf16"} <= set(amx.features)
    plain = cpu_target("znver3", "auto").for_weights("bfloat16")
    assert plain.matmul_precision == "float32" and plain.bf16_products is None


def test_matmul_precision_errors_name_the_fix():
    with pytest.raises(TargetError, match="AMX tiles or AVX512-BF16 dot products, and CPU 'skylake-avx512' has "
                                          "neither.*--matmul-precision float32 \\(or auto"):
        cpu_target("skylake-avx512", "bfloat16")
    with pytest.raises(TargetError, match="'float16' is not one of float32, bfloat16, auto"):
        cpu_target(None, "float16")
    with pytest.raises(BuildError, match="--mcpu only applies to --target llvm"):
        make_target("cuda", mcpu="znver5", matmul_precision="auto")


def ours_path(artifact) -> str | None:
    """The bfloat16 product path an artifact's manifest records."""
    return json.loads((artifact / "manifest.json").read_text())["target"]["bf16_products"]


def test_whole_model_build_records_the_path_and_a_host_without_it_is_told_to_rebuild(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "model", arch="qwen2", dtype="bfloat16", seed=4)
    artifact = build(model_dir, out=tmp_path / "zen5", prefill_buckets=(32,), max_context=64, mcpu="znver5",
                     matmul_precision="auto", quiet=True).path
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["target"]["matmul_precision"] == "bfloat16"
    assert manifest["target"]["bf16_products"] == "avx512bf16" and "avx512bf16" in manifest["target"]["features"]
    assert manifest["build_options"][-2:] == ["--matmul-precision", "bfloat16"]
    if HAS_AVX512_BF16:
        CompiledModel(model_dir, artifact)
    else:
        with pytest.raises(ArtifactError, match="CPU 'znver5', which uses .*avx512bf16.* that this machine lacks; "
                                                "rebuild here: python -m compiler build") as e:
            CompiledModel(model_dir, artifact)
        assert "--mcpu" not in str(e.value) and "--matmul-precision" not in str(e.value)  # this CPU's own build


@needs_avx512_bf16
def test_whole_model_with_dot_product_prefill_and_attention_tracks_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_dir = write_tiny_checkpoint(tmp_path / "model", arch="qwen2", dtype="bfloat16", seed=4, head_dim=32)
    target = cpu_target(None, "bfloat16")
    # Another host builds for Zen 4 (AVX512-BF16 dot products for the products and attention, no AMX; of the
    # features an artifact checks, an AMX Xeon has all of Zen 4's).
    mcpu = target.mcpu if target.bf16_attention == "avx512bf16" else "znver4"
    artifact = build(model_dir, out=tmp_path / "dot", prefill_buckets=(32,), max_context=64, mcpu=mcpu,
                     matmul_precision="bfloat16", quiet=True).path
    assert ours_path(artifact) == "avx512bf16"
    ours = CompiledModel(model_dir, artifact)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # 40 tokens: a 32-row chunk whose attention runs on dot products too (head_dim 32), then 8 rows and padding
    assert_bf16_prefill_tracks(ours, hf, [int(t) for t in RNG.integers(0, ours.config.vocab_size, 40)])


SAPPHIRE_RAPIDS_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                         "avx512_fp16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags,path", [(SAPPHIRE_RAPIDS_FLAGS, "amx"),
                                        (SAPPHIRE_RAPIDS_FLAGS - {"amx_tile", "amx_bf16"}, "avx512bf16")])
def test_the_host_keeps_the_features_its_flags_show_when_llvm_names_it_an_older_cpu(monkeypatch, flags, path):
    # A virtual Sapphire Rapids whose model number LLVM reads as Rocket Lake (seen on a cloud host): the flags, not
    # the name, say what it has, and the TVM target passes them on so the products compile to their instructions.
    monkeypatch.setattr("compiler.target.codegen.llvm_get_system_cpu", lambda: "rocketlake")
    monkeypatch.setattr("compiler.target.host_cpu_flags", lambda: flags)
    target = cpu_target(None, "bfloat16")
    assert target.mcpu == "rocketlake" and target.bf16_products == path and "avx512bf16" in target.features
    assert "+avx512bf16" in target.tvm_target().attrs["mattr"]
    asm = tvm.compile(cpu.schedule(linear_kernel(64, 896, 128), "linear", {}, target),
                      target.tvm_target()).mod.inspect_source("asm")
    assert ("tdpbf16ps" if path == "amx" else "vdpbf16ps") in asm
