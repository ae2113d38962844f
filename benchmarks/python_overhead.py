"""Python's share of a decode step: `CompiledModel.forward` and the generation loop beside the compiled call alone.

    python -m benchmarks.python_overhead MODEL_DIR [--steps 64] [--artifact PATH]

The compiled step function runs every kernel of a decode step; everything else per token (input tensor,
logits copy-out, cache bookkeeping, the greedy pick, the stop checks of `generate`) is Python overhead. Both
are measured in the same generation: the step function is wrapped with a timer.
"""

from __future__ import annotations

import argparse
import time

from compiler.build import build
from runtime import CompiledModel, GreedyGenerationConfig, generate


class Timed:
    """A compiled step function that adds up the time spent inside it."""

    def __init__(self, function):
        self.function, self.seconds, self.calls = function, 0.0, 0

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.function(*args)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def main() -> None:
    """Generate with every compiled call timed; print the per-token split and the overhead share."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--artifact", help="a built llvm artifact (default: build one with small buckets)")
    args = parser.parse_args()
    artifact = args.artifact or build(args.model_dir, out=f"{args.model_dir}.overhead.llvm", prefill_buckets=(16,),
                                      max_context=4 * args.steps, quiet=True).path
    model = CompiledModel(args.model_dir, artifact)
    name = "step_t1_r1"  # a decode step of one sequence
    model.new_cache().release()  # makes the arena of single sequences, whose step functions generate() calls
    functions = model._arena.cache.functions._functions
    functions[name] = timed = Timed(functions[name])
    result = generate(model, [1, 2, 3], GreedyGenerationConfig(args.steps, eos_token_ids=[]))
    steps = len(result.generated_token_ids) - 1
    inside, total = timed.seconds / steps, result.decode_seconds / steps
    print(f"decode step: {total * 1e3:.3f} ms per token, of which the compiled step function {inside * 1e3:.3f} ms "
          f"and Python {(total - inside) * 1e6:.0f} us = {100 * (total - inside) / total:.2f}% ({steps} steps)")


if __name__ == "__main__":
    main()
