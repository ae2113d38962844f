"""End-to-end CPU speed of our runtime at a real model shape: prefill of N tokens, then N decode steps.

    python -m benchmarks.cpu_generate --shape qwen2.5-0.5b --dtype bfloat16 --tokens 128 --work DIR

Also measures this machine's memory read bandwidth in the same run (numpy over a 1 GiB array on
every core's share) and prints the decode roofline: bandwidth / weight bytes read per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.checkpoints import SHAPES, real_shape_checkpoint
from compiler.build import build
from runtime import CompiledModel


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s that all cores together read from memory (the best of several passes)."""
    threads = len(os.sched_getaffinity(0))
    parts = [np.ones(int(gib * 2**30 / 4 / threads), np.float32) for _ in range(threads)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return sum(p.nbytes for p in parts) / best


def main() -> None:
    """Build, run, print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    model_dir = real_shape_checkpoint(args.work, args.shape, args.dtype)
    artifact = build(model_dir, out=f"{args.work}/{args.shape}-{args.dtype}.llvm", prefill_buckets=(args.tokens,),
                     context_buckets=(2 * args.tokens,), quiet=True).path
    model = CompiledModel(model_dir, artifact)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.config.vocab_size, args.tokens)]
    prefill, decode = [], []
    for _ in range(args.runs):
        cache = model.new_cache(2 * args.tokens)
        start = time.perf_counter()
        token = int(np.argmax(model.forward(prompt, cache)))
        prefill.append(args.tokens / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(args.tokens - 1):
            token = int(np.argmax(model.forward([token], cache)))
        decode.append((args.tokens - 1) / (time.perf_counter() - start))
    itemsize = {"float32": 4}.get(args.dtype, 2)
    weight_bytes = sum(int(np.prod(p["shape"])) * itemsize for p in model.manifest["params"]
                       if p["name"] != "model.embed_tokens.weight" or model.config.tie_word_embeddings)
    bandwidth = read_bandwidth()
    print(json.dumps({"model": f"{args.shape} {args.dtype} (random weights)", "threads": len(os.sched_getaffinity(0)),
                      "prefill_tokens": args.tokens, "prefill_tokens_per_s": round(statistics.median(prefill), 1),
                      "decode_tokens_per_s": round(statistics.median(decode), 2),
                      "read_bandwidth_gb_s": round(bandwidth / 1e9, 1), "weight_bytes_per_token": weight_bytes,
                      "decode_roofline_tokens_per_s": round(bandwidth / weight_bytes, 2),
                      "decode_vs_roofline": round(statistics.median(decode) * weight_bytes / bandwidth, 3)}))


if __name__ == "__main__":
    main()
