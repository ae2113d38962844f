"""The CPU linear schedules (GEMM for prefill, GEMV otherwise) at shapes that do and do not divide their tiles."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm

from compiler.kernels import make_kernel
from compiler.target import cpu_target
from ir import TensorType
from schedules import cpu

TARGET = cpu_target()
RNG = np.random.default_rng(1)
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """Run the scheduled linear kernel on these arrays."""
    inputs = [x, w] + ([bias] if bias is not None else [])
    kernel = make_kernel("linear", [TensorType(a.shape, str(a.dtype)) for a in inputs], {})
    lib = tvm.compile(cpu.schedule(kernel.func, "linear", {}, TARGET), TARGET.tvm_target())
    dev = tvm.cpu()
    out = tvm.runtime.empty((x.shape[0], w.shape[0]), "float32", dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in inputs], out)
    return out.numpy()


@pytest.mark.parametrize("rows,depth,cols", [
    (1, 48, 20), (3, 40, 24), (17, 64, 36), (16, 40, 20), (16, 64, 128), (32, 56, 72), (48, 40, 8),
    (64, 2176, 96), (128, 96, 1088), (32, 24, 3),
    (1, 9216, 48),  # one x row and its weight row outgrow L1: depth blocks (three of 3072)
])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_numpy(rows, depth, cols, dtype, bias):
    x = RNG.standard_normal((rows, depth)).astype(np.float32)
    w = (RNG.standard_normal((cols, depth)) * depth ** -0.5).astype(NP_DTYPES[dtype])
    b = RNG.standard_normal(cols).astype(NP_DTYPES[dtype]) if bias else None
    want = x.astype(np.float64) @ w.astype(np.float64).T + (b.astype(np.float64) if bias else 0)
    got = linear(x, w, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("rows,depth,blocked", [(1, 896, False), (1, 4864, False), (1, 5632, True), (1, 8192, True),
                                                (8, 896, False), (2, 3072, False), (2, 4096, True), (4, 5632, True),
                                                (16, 896, True)])
def test_decode_products_stream_one_weight_row_at_a_time_while_x_fits_in_l1(rows, depth, blocked):
    """While the float32 x rows and a bfloat16 weight row fit in L1 together a tile is one weight row, so a core
    reads its weights as one stream; a blocked product (x read a depth block at a time) takes the tile with the
    fewest loads per product instead."""
    halves = 2 if rows == 1 else 1
    block = cpu.depth_block(rows, 4864, depth, halves * 16, x_bytes=4, w_bytes=2, l1_bytes=32 * 1024)
    assert (block < depth) == blocked and depth % block == 0
    group, cols = cpu.gemv_tile(rows, 4864, halves, budget=16, blocked=blocked)
    assert cols == (4 if blocked else 1) and group * cols * halves <= 16 and rows % group == 0


@pytest.mark.parametrize("rows,depth,x_bytes,block", [
    (1, 8192, 4, 4096), (1, 8960, 4, 2240), (1, 11008, 4, 2752),  # a float32 x row: blocks of at most 16 KiB of it
    (1, 18944, 2, 4736), (16, 3072, 4, 256),  # x rounded to bfloat16; 16 x rows
    (1, 5536, 4, 5536)])  # 32 x 173: no block of at least 4 KiB of x divides it, so one pass
def test_depth_blocks_are_the_widest_divisors_within_half_of_l1_or_none(rows, depth, x_bytes, block):
    step = (32 if rows == 1 else 16) * (2 if x_bytes == 2 else 1)
    assert cpu.depth_block(rows, 4864, depth, step, x_bytes, w_bytes=2, l1_bytes=32 * 1024) == block


@pytest.mark.parametrize("mcpu,depth,blocked", [
    ("znver4", 5632, True), ("skylake-avx512", 5632, True),  # 32 KiB of L1: x (22 KiB) and a row (11) outgrow it
    ("znver5", 5632, False), ("sapphirerapids", 5632, False), ("icelake-server", 5632, False),  # 48 KiB: they fit
    ("znver5", 9216, True),  # 36 + 18 KiB outgrow 48 too
    ("sapphirerapids", 9216, False), ("icelake-server", 18944, False)])  # Intel from Ice Lake: one pass, x from L2
def test_depth_blocks_follow_each_cpus_l1_size(mcpu, depth, blocked):
    """One float32 x row of bfloat16 weights is read in depth blocks (a tile of four weight rows) only where x and a
    weight row outgrow that CPU's L1 data cache: 32 KiB on AMD Zen 4 and older Intel, 48 on Zen 5; Intel cores from
    Ice Lake on (48 KiB) read one row's weights in one pass at any depth."""
    target = cpu_target(mcpu)
    assert target.l1_bytes == (32 if mcpu in ("znver4", "skylake-avx512") else 48) * 1024
    kernel = make_kernel("linear", [TensorType((1, depth), "float32"), TensorType((256, depth), "bfloat16")], {})
    script = cpu._rows_gemv(kernel.func, target).script()
    assert f"acc = T.alloc_buffer((1, {4 if blocked else 1}, 2, 16))" in script


@pytest.mark.parametrize("mcpu,rows,depth,prefetches", [
    ("znver4", 1, 896, False), ("znver4", 1, 2048, False),  # x row and weight row fit in half of L1: the hardware's
    ("znver4", 1, 4864, True), ("znver4", 2, 896, True),  # they do not; several x rows (not measured without)
    ("znver4", 1, 9216, True),  # depth blocks (x and a weight row outgrow L1): faster with them
    ("znver5", 1, 896, True), ("sapphirerapids", 1, 896, True)])
def test_one_row_products_leave_prefetching_to_the_hardware_only_where_it_suffices(mcpu, rows, depth, prefetches):
    """On AMD Zen 4 a decode product of one x row whose x and weight rows fit in half of L1 has no software prefetch
    (they cost it 1.1x there); long rows, several rows and other CPUs keep them."""
    kernel = make_kernel("linear", [TensorType((rows, depth), "float32"), TensorType((256, depth), "bfloat16")], {})
    written = cpu._rows_gemv(kernel.func, cpu_target(mcpu))
    assert ("llvm.prefetch" in written.script()) == prefetches


@pytest.mark.parametrize("mcpu,rows,depth,dtype,eager,tasks", [
    ("znver5", 1, 896, "bfloat16", True, 128),  # Zen 5, one row of bf16 weights: unbounded prefetches...
    ("znver5", 1, 1536, "bfloat16", True, 256),  # ... and streams of half a page (3 KiB rows: one a task, not two)
    ("znver5", 1, 9216, "bfloat16", True, 16),  # one row in depth blocks
    ("znver5", 1, 1536, "float16", False, 128), ("znver5", 2, 1536, "bfloat16", False, 128),  # slower so on Zen 5
    ("sapphirerapids", 1, 1536, "bfloat16", True, 256), ("sapphirerapids", 1, 9216, "bfloat16", True, 256),  # Intel
    ("sapphirerapids", 2, 1536, "bfloat16", False, 128), ("sapphirerapids", 1, 1536, "float16", False, 128),
    ("skylake-avx512", 1, 1536, "bfloat16", False, 128), ("znver4", 1, 4864, "bfloat16", False, 256)])
def test_one_bf16_row_prefetches_eagerly_on_zen_5_and_intel(mcpu, rows, depth, dtype, eager, tasks):
    """On AMD Zen 5 and Intel cores from Ice Lake on, one x row of bfloat16 weights in the widening form prefetches
    without bounding the addresses to w, in streams of half a page (from memory, Zen 5: 1.15-1.28x at depths 896 and
    1536; the Xeon with AMX: 1.04-1.07x), and still matches numpy, the last rows' prefetches reaching past w (in one
    pass or in depth blocks); other weights, several rows and other CPUs keep bounded ones."""
    target = cpu_target(mcpu)
    assert target.eager_prefetch == (mcpu in ("znver5", "sapphirerapids"))
    x = RNG.standard_normal((rows, depth)).astype(np.float32)
    w = (RNG.standard_normal((256, depth)) * depth ** -0.5).astype(NP_DTYPES[dtype])
    kernel = make_kernel("linear", [TensorType(x.shape, "float32"), TensorType(w.shape, dtype)], {})
    script = cpu._rows_gemv(kernel.func, target).script()
    assert "llvm.prefetch" in script and ("T.min(" not in script) == eager
    assert f"for task in T.parallel({tasks}):" in script
    lib = tvm.compile(cpu.schedule(kernel.func, "linear", {}, target), TARGET.tvm_target())  # this host's code
    out = tvm.runtime.empty((rows, 256), "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
    np.testing.assert_allclose(out.numpy(), x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mcpu,dtype,halves", [("znver4", "float16", 4), ("znver4", "bfloat16", 2),
                                               ("znver5", "float16", 2), ("sapphirerapids", "float16", 2)])
def test_one_float16_row_takes_four_accumulators_where_its_depth_loop_has_no_prefetches(mcpu, dtype, halves):
    """On Zen 4 (no software prefetches in a one-row product of 896-deep rows) one x row of float16 weights is
    summed into four accumulators a weight row, and still matches numpy; other dtypes and CPUs keep two."""
    target = cpu_target(mcpu)
    x = RNG.standard_normal((1, 896)).astype(np.float32)
    w = (RNG.standard_normal((256, 896)) / 30).astype(NP_DTYPES[dtype])
    kernel = make_kernel("linear", [TensorType(x.shape, "float32"), TensorType(w.shape, dtype)], {})
    written = cpu._rows_gemv(kernel.func, target)
    assert f"acc = T.alloc_buffer((1, 1, {halves}, {target.lanes}))" in written.script()
    if mcpu == "znver4":
        lib = tvm.compile(cpu.schedule(kernel.func, "linear", {}, target), target.tvm_target())
        out = tvm.runtime.empty((1, 256), "float32", tvm.cpu())
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
        np.testing.assert_allclose(out.numpy(), x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mcpu,accumulators,tile", [
    ("znver4", 8, "(4, 2, 1, 16)"),  # 512-bit FMAs as two halves: 4 x rows by 2 weight rows
    ("znver5", 16, "(4, 4, 1, 16)"), ("sapphirerapids", 16, "(4, 4, 1, 16)"),
    ("x86-64-v3", 8, "(4, 2, 1, 8)")])  # AVX2: 16 registers
def test_cpus_that_split_512_bit_fmas_take_register_tiles_of_half_the_accumulators(mcpu, accumulators, tile):
    """Eight x rows of 2048 float32 (past L1: depth blocks, a tile of weight rows): the register tile each CPU gets."""
    target = cpu_target(mcpu)
    assert target.gemv_accumulators == accumulators
    kernel = make_kernel("linear", [TensorType((8, 2048), "float32"), TensorType((256, 2048), "bfloat16")], {})
    assert f"acc = T.alloc_buffer({tile})" in cpu._rows_gemv(kernel.func, target).script()


@pytest.mark.parametrize("mcpu", [None, "x86-64-v3", "znver4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 8, 12, 16])  # 6 and up: groups of rows take turns over the weights
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("depth,cols", [(64, 36), (3072, 48)])  # the second: tasks of 16 rows, several depth blocks
def test_multi_row_gemv_reads_each_weight_once_for_every_row(mcpu, rows, dtype, bias, depth, cols):
    """Decode steps of a few sequences: the weight-streaming kernel (all rows per weight read) is the one used."""
    target = cpu_target(mcpu) if mcpu else TARGET
    x = RNG.standard_normal((rows, depth)).astype(np.float32)
    w = (RNG.standard_normal((cols, depth)) * depth ** -0.5).astype(NP_DTYPES[dtype])
    b = RNG.standard_normal(cols).astype(NP_DTYPES[dtype]) if bias else None
    inputs = [x, w] + ([b] if bias else [])
    kernel = make_kernel("linear", [TensorType(a.shape, str(a.dtype)) for a in inputs], {})
    written = cpu._rows_gemv(kernel.func, target)
    assert (written is None) == (rows == 1 and dtype == "float32")  # one float32 row: the scheduled GEMV
    lib = tvm.compile(cpu.schedule(kernel.func, "linear", {}, target), target.tvm_target())
    out = tvm.runtime.empty((rows, cols), "float32", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
    want = x.astype(np.float64) @ w.astype(np.float64).T + (b.astype(np.float64) if bias else 0)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
