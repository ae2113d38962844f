"""Batch-N decode beside a single request on the one engine.

    python -m benchmarks.batch_scaling --work DIR [--shape qwen2.5-0.5b] [--dtype bfloat16] [--prompt 128]
                                       [--tokens 64] [--runs 3] [--rows 8] [--matmul-precision bfloat16]

Builds one artifact (prefill bucket = the prompt length, steps for 1 and --rows sequences), then, in one
process and alternating run by run: one request (`runtime.generate`: the prompt's prefill and --tokens greedy
decode steps, each a step of one row), and --rows sequences decoding together (`CompiledModel.step`). Checks
that the batch's first sequence generates the single request's tokens; prints one JSON line per figure
(medians of --runs, after one untimed warm-up run) and the ratio batch-N / batch-1 decode output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from compiler.build import build
from compiler.options import MATMUL_PRECISIONS
from runtime import CompiledModel, GreedyGenerationConfig, generate

from .checkpoints import SHAPES, real_shape_checkpoint
from .host import cpu_name


class PagedRequests:
    """Sequences on the model's paged arena, each with its own consecutive pages, stepped together greedily."""

    def __init__(self, model: CompiledModel, count: int):
        b = model.buckets
        self.model, self.cache = model, model.new_batch_cache()
        self.pages = [list(range(i * b.pages_per_row, (i + 1) * b.pages_per_row)) for i in range(count)]
        self.tokens: list[list[int]] = [[] for _ in range(count)]

    def prefill(self, prompts: list[list[int]]) -> None:
        """Each sequence's prompt, one step per sequence; its first generated token."""
        for i, prompt in enumerate(prompts):
            logits = self.model.step([(prompt, 0, self.pages[i], i)], self.cache)
            self.tokens[i] = list(prompt) + [int(np.argmax(logits[0]))]

    def decode(self) -> None:
        """One step of every sequence's last token."""
        rows = [([t[-1]], len(t) - 1, self.pages[i], i) for i, t in enumerate(self.tokens)]
        for t, logits in zip(self.tokens, self.model.step(rows, self.cache)):
            t.append(int(np.argmax(logits)))


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    """Build, run every path --runs times, print the figures and ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--matmul-precision", default="float32", choices=MATMUL_PRECISIONS)
    args = parser.parse_args()
    model_dir = real_shape_checkpoint(args.work, args.shape, args.dtype)
    context = args.prompt + args.tokens
    artifact = build(model_dir, out=Path(args.work) / f"{model_dir.name}-rows{args.rows}.{args.matmul_precision}",
                     prefill_buckets=(args.prompt,), max_context=context, batch_rows=(1, args.rows),
                     matmul_precision=args.matmul_precision, quiet=True).path
    model = CompiledModel(model_dir, artifact)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt)]
    config = GreedyGenerationConfig(args.tokens, eos_token_ids=[])
    figures: dict[str, list[float]] = {}
    for run in range(args.runs + 1):  # run 0 warms every path up (thread pool, caches, first allocations)
        if run == 1:
            figures.clear()
        single = generate(model, prompt, config)
        figures.setdefault("single_prefill", []).append(args.prompt / single.prefill_seconds)
        figures.setdefault("single_decode", []).append((args.tokens - 1) / single.decode_seconds)
        many = PagedRequests(model, args.rows)
        many.prefill([prompt[i:] + prompt[:i] for i in range(args.rows)])
        seconds = _timed(lambda: [many.decode() for _ in range(args.tokens - 1)])
        figures.setdefault(f"decode_batch{args.rows}", []).append(args.rows * (args.tokens - 1) / seconds)
        if many.tokens[0][args.prompt:] != single.generated_token_ids:
            raise SystemExit("a sequence of the batch generated other tokens than the same request alone")
    median = {name: statistics.median(values) for name, values in figures.items()}
    for name, value in median.items():
        print(json.dumps({"figure": name, "tokens_per_s": round(value, 2), "runs": [round(v, 2) for v in figures[name]]}))
    print(json.dumps({"cpu": cpu_name(), "shape": args.shape, "dtype": args.dtype,
                      "matmul_precision": model.manifest.target.matmul_precision, "prompt": args.prompt,
                      "tokens": args.tokens, f"batch{args.rows}_over_batch1_decode": round(
                          median[f"decode_batch{args.rows}"] / median["single_decode"], 2)}))


if __name__ == "__main__":
    main()
