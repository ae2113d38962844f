"""Decode steps' products (one x row per sequence) of bfloat16 weights streamed from memory: the kernels of both
builds, with and without software prefetches, beside numpy's read of the same bytes.

    python -m benchmarks.decode_products --shapes 2048x5632,5632x2048,4864x896,896x4864 --rounds 15
    python -m benchmarks.decode_products --rows 8 --shapes 2048x5632,11264x2048   # a decode step of 8 sequences

For each weight shape OUTxIN: the float32 build's product (the weights widened to float32, `schedules.cpu._rows_gemv`)
and, on a CPU with AVX512-BF16, the bfloat16 build's (x rounded to bfloat16, the same loop on dot products),
each as this CPU's build chooses ("built") and with the software prefetches forced on and off. Every call reads a
different copy of the weight, the copies (about 512 MiB, in huge pages as the runtime keeps weights) far larger than
the caches, so each call streams from memory as a decode step does. The variants and numpy (a max over as many
bytes, one share per core, as the decode roofline of benchmarks.cpu_generate reads) take turns in every round; prints each one's median read rate in GB/s and its ratio to
numpy's, under the CPU it ran on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import tvm

from benchmarks.host import cpu_description
from compiler.kernels import make_kernel
from compiler.target import cpu_target
from ir import TensorType
from runtime.cpu import HugePageMemory, use_all_cores
from schedules import cpu
from schedules.avx512_bf16 import DPBF16PS_IR

COPIES_BYTES = 512 << 20


def variants(out: int, depth: int, rows: int = 1) -> dict:
    """name -> the kernel (a PrimFunc) of each variant for one shape."""
    kernel = make_kernel("linear", [TensorType((rows, depth), "float32"), TensorType((out, depth), "bfloat16")],
                         {}).func
    found = {}
    for precision in ("float32", "bfloat16"):
        target = cpu_target(None, "auto").for_weights("bfloat16") if precision == "bfloat16" else cpu_target(None)
        if target.bf16_products not in (None, "avx512bf16"):
            continue  # AMX, whose decode rows stay float32
        if precision == "bfloat16" and target.bf16_products is None:
            continue  # no bfloat16 products on this CPU
        built = cpu.schedule(kernel, "linear", {}, target)
        found[f"{precision} build"] = built
        for prefetching in (True, False):
            forced = cpu._rows_gemv(kernel, target, prefetching, DPBF16PS_IR if precision == "bfloat16" else None)
            found[f"{precision}, prefetch {'on' if prefetching else 'off'}"] = forced.with_attr("tirx.noalias", True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="2048x5632,5632x2048,4864x896,896x4864,32000x2048")
    parser.add_argument("--rows", type=int, default=1, help="x rows: sequences in the decode step (at most 16)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    use_all_cores()
    threads = int(os.environ["TVM_NUM_THREADS"])
    target = cpu_target(None, "float32").tvm_target()
    memory, rng = HugePageMemory(), np.random.default_rng(0)
    parts = [np.ones(COPIES_BYTES // 4 // threads, np.float32) for _ in range(threads)]  # numpy's share per core
    print(f"CPU: {cpu_description()}, {threads} threads, {args.rows} x row(s)\n")
    print("| weight [out, in] | kernel | GB/s (median) | / numpy |\n|---|---|---|---|")
    with ThreadPoolExecutor(threads) as pool:
        for shape in args.shapes.split(","):
            out, depth = (int(d) for d in shape.split("x"))
            w = (rng.standard_normal((out, depth)) * depth ** -0.5).astype(ml_dtypes.bfloat16)
            copies = [memory.copy(w) for _ in range(max(2, COPIES_BYTES // w.nbytes))]
            x = tvm.runtime.tensor(rng.standard_normal((args.rows, depth)).astype(np.float32))
            y = tvm.runtime.empty((args.rows, out), "float32", tvm.cpu())
            runs = {name: tvm.compile(f, target)["main"] for name, f in variants(out, depth, args.rows).items()}
            times = {name: [] for name in [*runs, "numpy"]}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    start = time.perf_counter()
                    for weight in copies:
                        run(x, weight, y)
                    times[name].append((time.perf_counter() - start) / len(copies))
                start = time.perf_counter()
                list(pool.map(np.max, parts))
                times["numpy"].append((time.perf_counter() - start) * w.nbytes / COPIES_BYTES)
            rate = {name: w.nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
            for name, gbs in rate.items():
                print(f"| {out} x {depth} | {name} | {gbs:.1f} | {gbs / rate['numpy']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
