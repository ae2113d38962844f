"""One request's prefill and decode speed with the code of a given checkout: for comparing commits whose artifacts
the other's runtime cannot read.

    python benchmarks/single_request.py ROOT MODEL_DIR ARTIFACT_DIR [--prompt 128] [--tokens 64] [--runs 3]

ROOT is a checkout of this project (`git worktree add /tmp/old REV`, or this one): its compiler builds
ARTIFACT_DIR (reused when up to date; a prefill bucket of --prompt tokens, room for --prompt + --tokens) and
its runtime times a --prompt-token prefill and --tokens - 1 greedy decode steps, --runs times after one
untimed warm-up run. Prints one JSON line with the medians and the last token (equal tokens: equal results).
Run it for two checkouts in turn, several rounds, on a quiet machine: only ratios of one session compare.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time


def main() -> None:
    """Build with ROOT's compiler, time with ROOT's runtime, print the medians."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root")
    parser.add_argument("model_dir")
    parser.add_argument("artifact")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    import numpy as np

    from compiler.build import build
    from runtime import CompiledModel

    room = args.prompt + args.tokens  # older checkouts size the cache with context buckets
    size = {"max_context": room} if "max_context" in inspect.signature(build).parameters \
        else {"context_buckets": (room,)}
    build(args.model_dir, out=args.artifact, prefill_buckets=(args.prompt,), quiet=True, **size)
    model = CompiledModel(args.model_dir, args.artifact)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt)]
    prefill, decode = [], []
    for _ in range(args.runs + 1):
        cache = model.new_cache(room)
        start = time.perf_counter()
        token = int(np.argmax(model.forward(prompt, cache)))
        prefill.append(args.prompt / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(args.tokens - 1):
            token = int(np.argmax(model.forward([token], cache)))
        decode.append((args.tokens - 1) / (time.perf_counter() - start))
        del cache
    print(json.dumps({"root": args.root, "model": args.model_dir, "prefill_tokens_per_s": round(
        statistics.median(prefill[1:]), 2), "decode_tokens_per_s": round(statistics.median(decode[1:]), 2),
        "last_token": token}))


if __name__ == "__main__":
    main()
