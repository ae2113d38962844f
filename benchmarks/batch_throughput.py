"""Throughput of continuous batching: N concurrent requests through the batch executor vs one by one.

    python -m benchmarks.batch_throughput --work DIR [--requests 32] [--new-tokens 32] [--rows 8]

Uses a random Qwen2 checkpoint of about 130M parameters (SHAPE), big enough for decode to be
bound by reading weights, as real models are, and small enough to run in a minute; prints one JSON line with generated tokens/s both ways and their ratio, after
checking that both ways generate exactly the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from compiler.build import build
from models.tiny import random_weights, save_weights, tiny_config
from runtime import CompiledModel, ContinuousBatchConfig, GreedyGenerationConfig, generate
from runtime.batching import BatchExecutor

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             intermediate_size=2816, vocab_size=8192, max_position_embeddings=512)


def main() -> None:
    """Build, run both ways, compare, print."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rows", type=int, default=8, help="sequences per batch step")
    args = parser.parse_args()
    model_dir = Path(args.work) / "batch-model"
    config = tiny_config("qwen2", dtype="bfloat16", **SHAPE)
    model_dir.mkdir(parents=True, exist_ok=True)
    save_weights(random_weights(config, seed=0), model_dir)
    (model_dir / "config.json").write_text(json.dumps(config))
    artifact = build(model_dir, out=f"{args.work}/batch-artifact", prefill_buckets=(8, 16, 64), max_context=128,
                     batch_rows=(1, args.rows), quiet=True).path
    model = CompiledModel(model_dir, artifact)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, SHAPE["vocab_size"], int(rng.integers(4, 48)))]
               for _ in range(args.requests)]
    gen = GreedyGenerationConfig(args.new_tokens, eos_token_ids=[])

    start = time.perf_counter()
    solo = [generate(model, p, gen).generated_token_ids for p in prompts]
    solo_seconds = time.perf_counter() - start

    executor = BatchExecutor(model, ContinuousBatchConfig(max_active_sequences=args.rows, max_batch_tokens=64))
    start = time.perf_counter()
    ids = [executor.submit(p, gen) for p in prompts]
    batched = {f.request_id: f.generated_token_ids for f in executor.run()}
    batch_seconds = time.perf_counter() - start

    if [batched[i] for i in ids] != solo:
        raise SystemExit("batched tokens differ from solo tokens")
    tokens = args.requests * args.new_tokens
    print(json.dumps({"requests": args.requests, "new_tokens_each": args.new_tokens, "rows_per_step": args.rows,
                      "solo_tokens_per_s": round(tokens / solo_seconds, 1),
                      "batched_tokens_per_s": round(tokens / batch_seconds, 1),
                      "speedup": round(solo_seconds / batch_seconds, 2), "identical_tokens": True}))


if __name__ == "__main__":
    main()
