"""Decode steps' products (one x row per sequence) of 16-bit weights streamed from memory: the kernels of both
builds, with and without software prefetches, beside numpy's read of the same bytes.

    python -m benchmarks.decode_products --shapes 2048x5632,5632x2048,4864x896,896x4864 --rounds 15
    python -m benchmarks.decode_products --rows 8 --shapes 2048x5632,11264x2048   # a decode step of 8 sequences
    python -m benchmarks.decode_products --dtype float16 --shapes 151936x896   # an AWQ checkpoint's float16 head

For each weight shape OUTxIN: the float32 build's product (the weights widened to float32, `schedules.cpu._rows_gemv`)
and, for bfloat16 weights on a CPU with AVX512-BF16, the bfloat16 build's (x rounded to bfloat16, the same loop on
dot products; float16 weights are widened in both builds), each as this CPU's build chooses ("built") and with the
software prefetches forced on and off. Every call reads a
different copy of the weight, the copies (about 512 MiB, in huge pages as the runtime keeps weights) far larger than
the caches, so each call streams from memory as a decode step does. The variants and numpy (the decode roofline of
benchmarks.cpu_generate, reading as many bytes) take turns in every round; prints each one's median read rate in
GB/s and its ratio to numpy's, under the CPU it ran on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ml_dtypes
import numpy as np
import tvm

from benchmarks.cpu_generate import memory_read
from benchmarks.host import cpu_description
from compiler.kernels import make_kernel
from compiler.target import cpu_target
from ir import TensorType
from runtime.cpu import HugePageMemory, use_all_cores
from schedules import cpu
from schedules.avx512_bf16 import DPBF16PS_IR

COPIES_BYTES = 512 << 20


def variants(out: int, depth: int, rows: int = 1, dtype: str = "bfloat16") -> dict:
    """name -> the kernel (a PrimFunc) of each variant for one shape of `dtype` weights."""
    kernel = make_kernel("linear", [TensorType((rows, depth), "float32"), TensorType((out, depth), dtype)], {}).func
    targets = {"float32": cpu_target(None)}
    bf16 = cpu_target(None, "auto").for_weights("bfloat16")
    # on AMX decode rows stay float32; without either path, no bf16 build; float16 weights have no dot products
    if dtype == "bfloat16" and bf16.bf16_products == "avx512bf16":
        targets["bfloat16"] = bf16
    found = {}
    for precision, target in targets.items():
        found[f"{precision} build"] = cpu.schedule(kernel, "linear", {}, target)
        for prefetching in (True, False):
            forced = cpu._rows_gemv(kernel, target, prefetching, DPBF16PS_IR if precision == "bfloat16" else None)
            if forced is None:
                raise ValueError(f"{rows} x row(s) of depth {depth} do not fit the weight-streaming product: it takes "
                                 f"1 to {cpu.GEMV_MAX_ROWS} rows and a depth that is a multiple of 64")
            found[f"{precision}, prefetch {'on' if prefetching else 'off'}"] = forced.with_attr("tirx.noalias", True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="2048x5632,5632x2048,4864x896,896x4864,32000x2048")
    parser.add_argument("--rows", type=int, default=1, help="x rows: sequences in the decode step (at most 16)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="the weights'")
    args = parser.parse_args()
    try:
        shapes = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
        kernels = [variants(out, depth, args.rows, args.dtype) for out, depth in shapes]
    except ValueError as e:
        parser.error(f"--shapes {args.shapes!r} --rows {args.rows}: {e} (shapes are OUTxIN, comma-separated)")
    use_all_cores()
    threads = int(os.environ["TVM_NUM_THREADS"])
    target = cpu_target(None, "float32").tvm_target()
    memory, rng = HugePageMemory(), np.random.default_rng(0)
    numpy_dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float16
    print(f"CPU: {cpu_description()}, {threads} threads, {args.rows} x row(s), {args.dtype} weights\n")
    print("| weight [out, in] | kernel | GB/s (median) | / numpy |\n|---|---|---|---|")
    with memory_read(COPIES_BYTES, args, [], threads) as (_, read, _):
        for (out, depth), variant in zip(shapes, kernels):
            w = (rng.standard_normal((out, depth)) * depth ** -0.5).astype(numpy_dtype)
            copies = [memory.copy(w) for _ in range(max(2, COPIES_BYTES // w.nbytes))]
            x = tvm.runtime.tensor(rng.standard_normal((args.rows, depth)).astype(np.float32))
            y = tvm.runtime.empty((args.rows, out), "float32", tvm.cpu())
            runs = {name: tvm.compile(f, target)["main"] for name, f in variant.items()}
            times = {name: [] for name in [*runs, "numpy"]}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    start = time.perf_counter()
                    for weight in copies:
                        run(x, weight, y)
                    times[name].append((time.perf_counter() - start) / len(copies))
                start = time.perf_counter()
                read()
                times["numpy"].append((time.perf_counter() - start) * w.nbytes / COPIES_BYTES)
            rate = {name: w.nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
            for name, gbs in rate.items():
                print(f"| {out} x {depth} | {name} | {gbs:.1f} | {gbs / rate['numpy']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
