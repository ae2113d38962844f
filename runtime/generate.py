"""`python -m runtime.generate`: run a prebuilt artifact greedily on a raw prompt.

    python -m runtime.generate MODEL_DIR PROMPT [MAX_NEW_TOKENS=32] [RUNS=1] [--artifact PATH] [--device cpu|cuda]

The prompt is encoded as is (the tokenizer's own special-token template, no chat template).
Prints JSON lines: one `load` line, then one `run` line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ir.errors import RudaError

from .pipeline import load_pipeline
from .sampling import GreedyGenerationConfig


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be an integer > 0, got {text!r}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    """Run the generate CLI; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m runtime.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", metavar="MODEL_DIR")
    parser.add_argument("prompt", metavar="PROMPT")
    parser.add_argument("max_new_tokens", metavar="MAX_NEW_TOKENS", nargs="?", default=32,
                        type=_positive("MAX_NEW_TOKENS"))
    parser.add_argument("runs", metavar="RUNS", nargs="?", default=1, type=_positive("RUNS"))
    parser.add_argument("--artifact", help="artifact directory (default: where `compiler build MODEL_DIR` writes)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="run the llvm artifact on the CPU (default) or the cuda artifact on the GPU")
    args = parser.parse_args(argv)
    try:
        pipeline = load_pipeline(args.model_dir, args.artifact, args.device)
        model = pipeline.model
        print(json.dumps({"event": "load", "model": str(Path(args.model_dir)), "model_type": model.config.model_type,
                          "target": model.manifest["target"]["kind"], "mcpu": model.manifest["target"]["mcpu"],
                          "artifact": str(model.artifact), "load_seconds": round(model.load_seconds, 3)}), flush=True)
        config = GreedyGenerationConfig(max_new_tokens=args.max_new_tokens)
        for run in range(args.runs):
            r = pipeline.generate_text(args.prompt, config, add_special_tokens=True, skip_special_tokens=True)
            decode_steps = len(r.generated_token_ids) - 1
            print(json.dumps({
                "event": "run", "run": run, "text": r.text, "generated_text": r.generated_text,
                "generated_token_ids": r.generated_token_ids, "prompt_token_ids": r.prompt_token_ids,
                "prompt_tokens": len(r.prompt_token_ids), "stopped_on_eos": r.stopped_on_eos,
                "finish_reason": r.finish_reason,
                "prefill_seconds": round(r.prefill_seconds, 6), "decode_seconds": round(r.decode_seconds, 6),
                "prefill_tokens_per_s": round(len(r.prompt_token_ids) / r.prefill_seconds, 2),
                "decode_tokens_per_s": round(decode_steps / r.decode_seconds, 2) if decode_steps else None,
            }), flush=True)
    except RudaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
