"""One decode row's paged attention with its KV history streamed from memory, beside numpy's read of the same bytes.

    python -m benchmarks.decode_attention --shapes 14x2x64,32x4x64,8x2x256 --positions 1024,4096 --rounds 9

For each attention shape HEADSxKV_HEADSxHEAD_DIM (Qwen2.5-0.5B 14x2x64, TinyLlama 32x4x64, Qwen3.5's gated layers
8x2x256) and context length: the kernel this CPU's build runs for a decode step of one sequence
(`schedules.cpu_decode_attention`), over a KV arena in pages of 16 positions that the sequence holds in order (as a
fresh engine hands them out), once from memory (every call reads a different copy of the keys and values, the copies
about 512 MiB in huge pages, as a decode step finds them after streaming the weights) and once in cache (one copy
again and again: what its arithmetic alone allows). Numpy reads as many bytes from memory in the same rounds (the
decode roofline of benchmarks.cpu_generate). Prints each one's median time and read rate, and the kernel's ratio to
numpy's rate, under the CPU it ran on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import tvm

from benchmarks.cpu_generate import memory_read
from benchmarks.host import cpu_description
from compiler.kernels import make_kernel
from compiler.target import cpu_target
from ir import TensorType
from runtime.cpu import HugePageMemory, use_all_cores
from schedules import cpu

COPIES_BYTES = 512 << 20
PAGE = 16  # positions a KV page holds, as `python -m compiler build` makes them by default


def attention_kernel(heads: int, kv_heads: int, dim: int, positions: int):
    """The decode kernel (a PrimFunc) of one row at `positions` positions, its arena holding just them."""
    pages = -(-positions // PAGE)
    cache = TensorType((pages, PAGE, kv_heads * dim), "float32")
    types = [TensorType((1, heads * dim), "float32"), cache, cache, TensorType((1, pages), "int32"),
             TensorType((1,), "int32"), TensorType((1,), "int32")]
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": dim, "scale": dim ** -0.5}
    return cpu.schedule(make_kernel("paged_attention", types, attrs).func, "paged_attention", attrs, cpu_target(None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="14x2x64,32x4x64,8x2x256")
    parser.add_argument("--positions", default="1024,4096", help="context lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    try:
        shapes = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
        positions = [int(p) for p in args.positions.split(",")]
        if any(len(s) != 3 or s[0] % s[1] for s in shapes) or min(positions) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--shapes {args.shapes!r} --positions {args.positions!r}: shapes are HEADSxKV_HEADSxHEAD_DIM "
                     "with HEADS a multiple of KV_HEADS, positions whole numbers from 1, each comma-separated")
    use_all_cores()
    threads = int(os.environ["TVM_NUM_THREADS"])
    memory, rng = HugePageMemory(), np.random.default_rng(0)
    print(f"CPU: {cpu_description()}, {threads} threads, one decode row\n")
    print("| heads x KV heads x dim | positions | from memory (us) | GB/s | / numpy | in cache (us) |\n"
          "|---|---|---|---|---|---|")
    with memory_read(COPIES_BYTES, args, [], threads) as (_, read, _):
        for heads, kv_heads, dim in shapes:
            for n in positions:
                run = tvm.compile(attention_kernel(heads, kv_heads, dim, n), cpu_target(None).tvm_target())["main"]
                pages, history_bytes = -(-n // PAGE), 2 * n * kv_heads * dim * 4  # the keys and values read
                kv = rng.standard_normal((pages, PAGE, kv_heads * dim)).astype(np.float32)
                copies = [(memory.copy(kv), memory.copy(kv)) for _ in range(max(2, COPIES_BYTES // (2 * kv.nbytes)))]
                q = tvm.runtime.tensor(rng.standard_normal((1, heads * dim)).astype(np.float32))
                table = tvm.runtime.tensor(np.arange(pages, dtype=np.int32)[None])
                row, last = tvm.runtime.tensor(np.zeros(1, np.int32)), tvm.runtime.tensor(np.array([n - 1], np.int32))
                out = tvm.runtime.empty((1, heads * dim), "float32", tvm.cpu())
                times = {"memory": [], "cache": [], "numpy": []}
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    for keys, values in copies:
                        run(q, keys, values, table, row, last, out)
                    times["memory"].append((time.perf_counter() - start) / len(copies))
                    start = time.perf_counter()
                    for _ in copies:
                        run(q, *copies[0], table, row, last, out)
                    times["cache"].append((time.perf_counter() - start) / len(copies))
                    start = time.perf_counter()
                    read()
                    times["numpy"].append((time.perf_counter() - start) * history_bytes / COPIES_BYTES)
                us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
                gbs = history_bytes / us["memory"] / 1e3
                print(f"| {heads} x {kv_heads} x {dim} | {n} | {us['memory']:.1f} | {gbs:.1f} | "
                      f"{us['numpy'] / us['memory']:.2f} | {us['cache']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
