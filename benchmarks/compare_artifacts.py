"""Prefill and decode speed of several artifacts of one model, in one process, taking turns.

    python -m benchmarks.compare_artifacts MODEL_DIR ARTIFACT ARTIFACT [...] [--rounds 5] [--tokens 128]

On a host whose speed drifts between minutes, only measurements taken side by side compare: each
round runs every artifact once (a prompt of --tokens ids, then --tokens - 1 greedy decode steps), and
the medians over rounds are printed. Build the artifacts from the commits to compare (for example
`git worktree add /tmp/old REV`, then `PYTHONPATH=/tmp/old python -m compiler build MODEL_DIR --out A`
from there); every artifact needs a --max-context of at least 2 x --tokens and a prefill bucket of --tokens.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.cpu_generate import runtime_steps, timed_generation
from runtime import CompiledModel
from runtime.cpu import use_all_cores


def main() -> None:
    """Alternate the artifacts for --rounds rounds; print each run and the medians."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    use_all_cores()
    prompt = list(range(100, 100 + args.tokens))
    steps = {path: runtime_steps(CompiledModel(args.model_dir, path), prompt) for path in args.artifacts}
    runs: dict[str, list[tuple[float, float]]] = {path: [] for path in steps}
    for round_ in range(args.rounds):
        for path, (prefill, decode) in steps.items():
            runs[path].append(timed_generation(prefill, decode, args.tokens, runs=1))
            print(f"round {round_}  {path}  prefill {runs[path][-1][0]:.1f}  decode {runs[path][-1][1]:.2f} tok/s",
                  flush=True)
    for path, results in runs.items():
        prefill, decode = zip(*results)
        print(f"median  {path}  prefill {statistics.median(prefill):.1f}  decode {statistics.median(decode):.2f} tok/s")


if __name__ == "__main__":
    main()
