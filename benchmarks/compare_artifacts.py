"""Prefill and decode speed of several artifacts of one model, in one process, taking turns.

    python -m benchmarks.compare_artifacts MODEL_DIR ARTIFACT ARTIFACT [...] [--rounds 5] [--tokens 128]

On a host whose speed drifts within seconds, only measurements taken side by side compare: the artifacts take
turns as the engines of `benchmarks.cpu_generate` do (each round: a prefill of --tokens ids each, in an order
that rotates by round, then their --tokens - 1 greedy decode steps in interleaved slices), and the table gives each
artifact's medians over rounds and the median over rounds of its ratio to the first artifact in the same round.
Build the artifacts from the commits to compare (for example `git worktree add /tmp/old REV`, then
`PYTHONPATH=/tmp/old python -m compiler build MODEL_DIR --out A` from there); every artifact needs a --max-context
of at least 2 x --tokens and a prefill bucket of --tokens.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.cpu_generate import run_rounds, runtime_steps
from runtime import CompiledModel
from runtime.cpu import use_all_cores


def same_round_ratios(engines: list[dict]) -> list[tuple[float, float]]:
    """Each engine's (prefill, decode) speed over the first engine's, the median over the rounds of their ratio."""
    first = engines[0]["runs"]
    return [tuple(statistics.median(mine[k] / theirs[k] for mine, theirs in zip(e["runs"], first)) for k in (0, 1))
            for e in engines]


def main() -> None:
    """Run the artifacts in turns for --rounds rounds; print their medians and same-round ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    use_all_cores()
    prompt = list(range(100, 100 + args.tokens))
    engines = [{"engine": path, "steps": runtime_steps(CompiledModel(args.model_dir, path), prompt, 2 * args.tokens),
                "runs": []} for path in args.artifacts]
    results = run_rounds(engines, args.tokens, args.rounds)
    failed = [r for r in results if "error" in r]
    if failed:
        raise SystemExit("\n".join(f"{r['engine']}: {r['error']}" for r in failed))
    print("| artifact | prefill tok/s | decode tok/s | prefill / first | decode / first |\n|---|---|---|---|---|")
    for row, (prefill, decode) in zip(results, same_round_ratios(engines)):
        print(f"| {row['engine']} | {row['prefill_tokens_per_s']} | {row['decode_tokens_per_s']} | {prefill:.3f} | "
              f"{decode:.3f} |")


if __name__ == "__main__":
    main()
