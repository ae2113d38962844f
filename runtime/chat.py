"""`python -m runtime.chat MODEL_DIR`: an interactive terminal chat that streams the reply as it is generated.

Type a message and press Enter; `/reset` starts a new conversation; EOF (Ctrl-D) or Ctrl-C exits.
Greedy by default; give --temperature (and optionally --top-k, --top-p, --seed) to sample.
"""

from __future__ import annotations

import argparse
import sys

from ir.errors import RudaError

from .pipeline import load_pipeline
from .sampling import GreedyGenerationConfig, SamplingConfig, SamplingGenerationConfig


def _config(args) -> GreedyGenerationConfig:
    if args.temperature is None:
        return GreedyGenerationConfig(args.max_new_tokens, repetition_penalty=args.repetition_penalty)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    return SamplingGenerationConfig(args.max_new_tokens, repetition_penalty=args.repetition_penalty, sampling=sampling)


def chat(pipeline, config: GreedyGenerationConfig, system: str | None, read=input, write=sys.stdout.write) -> None:
    """Run the conversation loop until EOF."""
    history = [{"role": "system", "content": system}] if system else []
    sampled = isinstance(config, SamplingGenerationConfig)
    while True:
        try:
            line = read("> ")
        except EOFError:
            write("\n")
            return
        if line.strip() == "/reset":
            history = history[:1] if system else []
            write("(new conversation)\n")
            continue
        if not line.strip():
            continue
        messages = history + [{"role": "user", "content": line}]
        prompt = pipeline.render_chat(messages, add_generation_prompt=True)
        stream = (pipeline.stream_text_sampled if sampled else pipeline.stream_text)(prompt, config, add_special_tokens=False)
        try:
            for delta in stream:
                write(delta)
                sys.stdout.flush()
        except RudaError as e:
            write(f"\n[{e}; /reset starts a new conversation]\n")
            continue
        write("\n")
        history = messages + [{"role": "assistant", "content": stream.result.generated_text}]


def main(argv: list[str] | None = None) -> int:
    """Run the chat CLI; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m runtime.chat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", metavar="MODEL_DIR")
    parser.add_argument("--artifact", help="artifact directory (default: where `compiler build MODEL_DIR` writes)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="run the llvm artifact on the CPU (default) or the cuda artifact on the GPU")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    args = parser.parse_args(argv)
    try:
        config = _config(args)
        pipeline = load_pipeline(args.model_dir, args.artifact, args.device)
        chat(pipeline, config, args.system)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
    except RudaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
