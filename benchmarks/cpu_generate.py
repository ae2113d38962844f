"""End-to-end CPU speed at a real model shape, ours beside transformers: prefill N tokens, decode N.

    python -m benchmarks.cpu_generate --shape qwen2.5-0.5b --dtype bfloat16 --tokens 128 --work DIR

Both run in the same process with the same number of threads (every core this process may use).
The run also measures this machine's memory read bandwidth (numpy, one share of 1 GiB per core)
and prints the decode roofline: bandwidth / weight bytes read per token. transformers is a test
dependency; without it that column says why it is missing.
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


def timed_generation(prefill_fn, decode_fn, tokens: int, runs: int) -> tuple[float, float]:
    """Median (prefill tokens/s, decode tokens/s) of `runs` runs of prefill then tokens-1 decode steps."""
    prefill, decode = [], []
    for _ in range(runs):
        start = time.perf_counter()
        state = prefill_fn()
        prefill.append(tokens / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(tokens - 1):
            state = decode_fn(state)
        decode.append((tokens - 1) / (time.perf_counter() - start))
    return statistics.median(prefill), statistics.median(decode)


def ours(model_dir, args, prompt) -> tuple[float, float, CompiledModel]:
    """Our runtime's speeds (and the model, for its manifest)."""
    artifact = build(model_dir, out=f"{args.work}/{args.shape}-{args.dtype}.llvm", prefill_buckets=(args.tokens,),
                     context_buckets=(2 * args.tokens,), quiet=True).path
    model = CompiledModel(model_dir, artifact)

    def prefill():
        cache = model.new_cache(2 * args.tokens)
        return cache, int(np.argmax(model.forward(prompt, cache)))

    def decode(state):
        cache, token = state
        return cache, int(np.argmax(model.forward([token], cache)))

    return (*timed_generation(prefill, decode, args.tokens, args.runs), model)


def transformers_speed(model_dir, args, prompt, threads: int) -> dict:
    """transformers (torch CPU, same threads, the checkpoint's dtype) speeds, or why it could not run."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return {"transformers": f"not installed ({e})"}
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    ids = torch.tensor([prompt])

    def prefill():
        with torch.no_grad():
            out = hf(ids, use_cache=True)
        return out.past_key_values, out.logits[:, -1:].argmax(-1)

    def decode(state):
        past, token = state
        with torch.no_grad():
            out = hf(token, past_key_values=past, use_cache=True)
        return out.past_key_values, out.logits[:, -1:].argmax(-1)

    p, d = timed_generation(prefill, decode, args.tokens, args.runs)
    return {"transformers_prefill_tokens_per_s": round(p, 1), "transformers_decode_tokens_per_s": round(d, 2)}


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
    threads = len(os.sched_getaffinity(0))
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, SHAPES[args.shape]["vocab_size"], args.tokens)]
    prefill, decode, model = ours(model_dir, args, prompt)
    peer = transformers_speed(model_dir, args, prompt, threads)
    itemsize = {"float32": 4}.get(args.dtype, 2)
    weight_bytes = sum(int(np.prod(p["shape"])) * itemsize for p in model.manifest["params"]
                       if p["name"] != "model.embed_tokens.weight" or model.config.tie_word_embeddings)
    bandwidth = read_bandwidth()
    result = {"model": f"{args.shape} {args.dtype} (random weights)", "threads": threads, "tokens": args.tokens,
              "prefill_tokens_per_s": round(prefill, 1), "decode_tokens_per_s": round(decode, 2), **peer,
              "read_bandwidth_gb_s": round(bandwidth / 1e9, 1), "weight_bytes_per_token": weight_bytes,
              "decode_roofline_tokens_per_s": round(bandwidth / weight_bytes, 2),
              "decode_vs_roofline": round(decode * weight_bytes / bandwidth, 3)}
    if "transformers_decode_tokens_per_s" in peer:
        result["prefill_vs_transformers"] = round(prefill / peer["transformers_prefill_tokens_per_s"], 2)
        result["decode_vs_transformers"] = round(decode / peer["transformers_decode_tokens_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
