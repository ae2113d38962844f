"""Prefill products of bfloat16 weights on NVIDIA tensor cores (WMMA), for `--matmul-precision bfloat16` builds.

Opt-in, as on the CPU: the activations are rounded to bfloat16 (to nearest, ties to even) as their tile is copied
to shared memory; products and sums stay float32 (`wmma::mma_sync` bf16 x bf16 -> f32). A thread block of four
warps computes a TILE_ROWS x TILE_COLS block of y: per depth step of DEPTH, all 128 threads copy the block's x rows
(rounded) and w rows to shared memory, then each warp loads its 16 x 16 fragments (x row-major; w's rows are the
columns of B, so B is column-major) and multiplies them into its float32 accumulator fragments. At the end the
accumulators go to shared memory and the threads write y, adding the bias.

The WMMA calls are CUDA C++ (`nvcuda::wmma`): the nvrtc and nvcc paths compile them; the direct PTX path (LLVM
NVPTX) cannot emit them, and `compiler.cuda.cuda_target` refuses the option there. TVM 0.27's `tensorize` cannot
build such a kernel (serialising a PrimFunc, which it does, crashes), so the kernel is written out. With `emulate`
the same loop nest runs on the CPU: thread loops serial, fragments plain buffers with loop versions of the four
WMMA calls: the tests check its tiling against numpy there.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .written import bf16_bits, linear_func, thread_loop

FRAGMENT = 16  # a WMMA fragment's side (m16n16k16)
WARPS = 4
LANES = 32
THREADS = WARPS * LANES
TILE_COLS, DEPTH = 64, 32  # DEPTH = LANES: a warp copies a tile row
HALVES = TILE_COLS // LANES  # a y row of the tile, in warp-wide parts
WARP_GRIDS = {64: (2, 2), 32: (2, 2), 16: (1, 4)}  # a block's rows -> its warps as (rows of warps, columns of warps)


def tensor_core_shape(rows: int, cols: int, depth: int) -> bool:
    """Whether a product of these sizes fits the kernel's tiles."""
    return any(rows % r == 0 for r in WARP_GRIDS) and cols % TILE_COLS == 0 and depth % DEPTH == 0


def _rounded(v):
    """float32 `v` rounded to the nearest bfloat16, as bfloat16."""
    return T.Cast("bfloat16", T.reinterpret("float32", T.Cast("uint32", bf16_bits(v)) << T.uint32(16)))


def wmma_gemm(func: tirx.PrimFunc, emulate: bool = False) -> tirx.PrimFunc:
    """The tensor-core kernel with the signature of `linear` kernel `func` (float32 x, bfloat16 w [out, in],
    optional bias); `emulate`: the CPU form of the same loops (see the module docstring)."""
    (m, k), n = (int(d) for d in func.params[0].shape), int(func.params[1].shape[0])
    rows = next(r for r in WARP_GRIDS if m % r == 0)
    warp_rows, warp_cols = WARP_GRIDS[rows]
    frag_rows, frag_cols = rows // (FRAGMENT * warp_rows), TILE_COLS // (FRAGMENT * warp_cols)
    sets = WARPS if emulate else 1  # emulated fragments: a set per warp (on the GPU each warp's are its own)
    scopes = ("local",) * 3 if emulate else ("wmma.matrix_a", "wmma.matrix_b", "wmma.accumulator")

    threads = thread_loop(emulate)

    def index(warp, i, per):
        """Fragment i of a warp's `per` in its fragment buffer."""
        return warp * per + i if emulate else i

    @T.macro
    def fill(c, ci):
        if emulate:
            for r, s in T.grid(FRAGMENT, FRAGMENT):
                c[ci * FRAGMENT + r, s] = T.float32(0)
        else:
            T.evaluate(T.tvm_fill_fragment(c.data, FRAGMENT, FRAGMENT, FRAGMENT, ci, T.float32(0), dtype="handle"))

    @T.macro
    def load(frag, fi, tile, row, col, layout):
        """Fragment fi from tile[row:+16, col:+16]: A row-major, or B column-major (the tile holds B's columns)."""
        if emulate:
            for r, s in T.grid(FRAGMENT, FRAGMENT):
                frag[fi * FRAGMENT + r, s] = tile[row + r, col + s]
        else:
            T.evaluate(T.tvm_load_matrix_sync(frag.data, FRAGMENT, FRAGMENT, FRAGMENT, fi, tile.access_ptr(
                "r", ptr_type="bfloat16", offset=row * DEPTH + col), DEPTH, layout, dtype="handle"))

    @T.macro
    def mma(c, ci, a, ai, b, bi):
        if emulate:
            for r, s, d in T.grid(FRAGMENT, FRAGMENT, FRAGMENT):
                c[ci * FRAGMENT + r, s] = c[ci * FRAGMENT + r, s] + T.Cast(
                    "float32", a[ai * FRAGMENT + r, d]) * T.Cast("float32", b[bi * FRAGMENT + s, d])
        else:
            T.evaluate(T.tvm_mma_sync(c.data, ci, a.data, ai, b.data, bi, c.data, ci, dtype="handle"))

    @T.macro
    def store(c, ci, out, row, col):
        if emulate:
            for r, s in T.grid(FRAGMENT, FRAGMENT):
                out[row + r, col + s] = c[ci * FRAGMENT + r, s]
        else:
            T.evaluate(T.tvm_store_matrix_sync(c.data, FRAGMENT, FRAGMENT, FRAGMENT, ci, out.access_ptr(
                "w", ptr_type="float32", offset=row * TILE_COLS + col), TILE_COLS, "row_major", dtype="handle"))

    @T.macro
    def products(x, w, y, first):
        for by in threads(m // rows, "blockIdx.y"):
            for bx in threads(n // TILE_COLS, "blockIdx.x"):
                xs = T.alloc_buffer((rows, DEPTH), "bfloat16", scope="shared")
                ws = T.alloc_buffer((TILE_COLS, DEPTH), "bfloat16", scope="shared")
                out = T.alloc_buffer((rows, TILE_COLS), "float32", scope="shared")
                a = T.alloc_buffer((sets * frag_rows * FRAGMENT, FRAGMENT), "bfloat16", scope=scopes[0])
                b = T.alloc_buffer((sets * frag_cols * FRAGMENT, FRAGMENT), "bfloat16", scope=scopes[1])
                c = T.alloc_buffer((sets * frag_rows * frag_cols * FRAGMENT, FRAGMENT), "float32", scope=scopes[2])
                for warp in threads(WARPS, "threadIdx.y"):
                    for f in range(frag_rows * frag_cols):
                        fill(c, index(warp, f, frag_rows * frag_cols))
                    for e in range(rows * TILE_COLS // THREADS):  # `out` is live from here: TVM's storage rewrite
                        for lane in threads(LANES, "threadIdx.x"):  # must not fold it into the tiles' memory
                            out[(e * WARPS + warp) // HALVES, (e * WARPS + warp) % HALVES * LANES + lane] = T.float32(0)
                for step in range(k // DEPTH):
                    for warp in threads(WARPS, "threadIdx.y"):  # a warp copies a tile row at a time (LANES = DEPTH)
                        for e in range(rows // WARPS):
                            for lane in threads(LANES, "threadIdx.x"):
                                xs[e * WARPS + warp, lane] = _rounded(
                                    x[by * rows + e * WARPS + warp, step * DEPTH + lane])
                        for e in range(TILE_COLS // WARPS):
                            for lane in threads(LANES, "threadIdx.x"):
                                ws[e * WARPS + warp, lane] = w[bx * TILE_COLS + e * WARPS + warp, step * DEPTH + lane]
                    for warp in threads(WARPS, "threadIdx.y"):
                        for d in range(DEPTH // FRAGMENT):
                            for i in range(frag_rows):
                                load(a, index(warp, i, frag_rows), xs,
                                     (warp // warp_cols * frag_rows + i) * FRAGMENT, d * FRAGMENT, "row_major")
                            for j in range(frag_cols):
                                load(b, index(warp, j, frag_cols), ws,
                                     (warp % warp_cols * frag_cols + j) * FRAGMENT, d * FRAGMENT, "col_major")
                            for i, j in T.grid(frag_rows, frag_cols):
                                mma(c, index(warp, i * frag_cols + j, frag_rows * frag_cols),
                                    a, index(warp, i, frag_rows), b, index(warp, j, frag_cols))
                for warp in threads(WARPS, "threadIdx.y"):
                    for i, j in T.grid(frag_rows, frag_cols):
                        store(c, index(warp, i * frag_cols + j, frag_rows * frag_cols), out,
                              (warp // warp_cols * frag_rows + i) * FRAGMENT,
                              (warp % warp_cols * frag_cols + j) * FRAGMENT)
                for warp in threads(WARPS, "threadIdx.y"):  # a warp writes LANES columns of a row at a time
                    for e in range(rows * TILE_COLS // THREADS):
                        for lane in threads(LANES, "threadIdx.x"):
                            y[by * rows + (e * WARPS + warp) // HALVES, bx * TILE_COLS + (e * WARPS + warp) % HALVES
                              * LANES + lane] = out[(e * WARPS + warp) // HALVES, (e * WARPS + warp) % HALVES * LANES
                                                    + lane] + first(bx * TILE_COLS + (e * WARPS + warp) % HALVES
                                                                    * LANES + lane)

    return linear_func(func, products)
