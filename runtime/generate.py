"""`python -m runtime.generate`: run a prebuilt artifact greedily on a raw prompt, or on a file of prompts.

    python -m runtime.generate MODEL_DIR PROMPT [MAX_NEW_TOKENS=32 (Qwen3.5: 8)] [RUNS=1] [--image PATH ...]
                               [--artifact PATH] [--device cpu|cuda]
    python -m runtime.generate MODEL_DIR --batch FILE [--max-new-tokens 32] [--artifact PATH] [--device cpu|cuda]

Prompts are encoded as is (the tokenizer's own special-token template, no chat template). Prints
JSON lines: one `load` line, then one `run` line per run; with --batch (one prompt per line, all
served at once by continuous batching; the artifact needs --batch-rows), one `result` line per
prompt as it finishes, then a `summary` line. With --image (a Qwen3.5 image-text model), the prompt
holds one <|vision_start|><|image_pad|><|vision_end|> per image, images in prompt order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from ir.errors import UsageError, add_debug_flag, exit_cli, positive_int

QWEN35_NEW_TOKENS = 8  # new tokens when not given for Qwen3.5; every other model: 32


def main(argv: list[str]) -> int:
    """Run the generate CLI on `argv`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m runtime.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", metavar="MODEL_DIR")
    parser.add_argument("prompt", metavar="PROMPT", nargs="?")
    parser.add_argument("max_new_tokens", metavar="MAX_NEW_TOKENS", nargs="?", type=positive_int("MAX_NEW_TOKENS"),
                        help="default 32 (Qwen3.5: 8)")
    parser.add_argument("runs", metavar="RUNS", nargs="?", default=1, type=positive_int("RUNS"))
    parser.add_argument("--artifact", help="artifact directory (default: where `compiler build MODEL_DIR` writes)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="run the llvm artifact on the CPU (default) or the cuda artifact on the GPU")
    parser.add_argument("--batch", metavar="FILE", help="serve every line of FILE as a prompt, all at once")
    parser.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"),
                        help="with --batch: new tokens per prompt (default 32, Qwen3.5: 8)")
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="an image (JPEG, PNG) for the prompt's next image placeholder; repeat for more")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.batch is None):
        parser.error("give either PROMPT or --batch FILE")
    if args.image and args.batch:
        parser.error("--image goes with PROMPT, not with --batch")
    prompts = _read_prompts(args.batch) if args.batch else [_text(args.prompt, "PROMPT")]

    from .pipeline import QWEN35_TYPES, load_pipeline  # after the arguments are checked: loads TVM
    from .sampling import GreedyGenerationConfig

    pipeline = load_pipeline(args.model_dir, args.artifact, args.device)
    model = pipeline.model
    target = model.manifest.target
    print(json.dumps({"event": "load", "model": str(Path(args.model_dir)), "model_type": model.config.model_type,
                      "target": target.kind, **{k: getattr(target, k) for k in ("mcpu", "arch") if getattr(target, k)},
                      "artifact": str(model.artifact), "load_seconds": round(model.load_seconds, 3)}), flush=True)
    default_new = QWEN35_NEW_TOKENS if model.config.model_type in QWEN35_TYPES else 32
    if args.batch:
        _serve_batch(pipeline, prompts, GreedyGenerationConfig(max_new_tokens=args.max_new_tokens or default_new))
        return 0
    config = GreedyGenerationConfig(max_new_tokens=args.max_new_tokens or default_new)
    for run in range(args.runs):
        r = _generate(pipeline, prompts[0], args.image, config)
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
    return 0


def _generate(pipeline, prompt: str, images: list[str], config):
    """One greedy run of the prompt (with its images, if any)."""
    from .engine import GenerationError

    if not images:
        return pipeline.generate_text(prompt, config, add_special_tokens=True, skip_special_tokens=True)
    if not hasattr(pipeline, "generate_image_files_greedy"):
        raise GenerationError(f"--image: {pipeline.model.model_dir} is a text-only model (config.json declares no "
                              "vision_config); leave --image out, or use a Qwen3.5 image-text checkpoint")
    return pipeline.generate_image_files_greedy(pipeline.encode(prompt), images, config=config)


def _text(value: str, what: str) -> str:
    """A command-line text, which must be valid UTF-8 (undecodable bytes reach Python as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what} is not valid UTF-8 text (bad byte at character {e.start}); pass UTF-8 text") from None
    return value


def _read_prompts(path: str) -> list[str]:
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"--batch {path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--batch {path}: not valid UTF-8 text (bad byte at offset {e.start})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError(f"--batch {path}: holds no prompts (one prompt per line)")
    return prompts


def _serve_batch(pipeline, prompts: list[str], config) -> None:
    """Serve every prompt at once through the batch executor, printing each result as it finishes."""
    from .batching import BatchExecutor
    from .engine import GenerationError
    from .request import IncrementalDetokenizer
    from .scheduler import ContinuousBatchConfig

    model = pipeline.model
    encoded = [pipeline.encode(p) for p in prompts]
    for line, ids in enumerate(encoded, 1):
        model.check_request(len(ids), config.max_new_tokens, where=f"--batch prompt {line}")
    buckets = model.buckets
    executor = BatchExecutor(model, ContinuousBatchConfig(buckets.batch_rows[-1], buckets.prefill_tokens[-1]),
                             default_eos_token_ids=pipeline.default_eos_token_ids)
    index = {executor.submit(ids, config, IncrementalDetokenizer(pipeline.tokenizer.decode, True)): i
             for i, ids in enumerate(encoded)}
    start, generated, failed = time.perf_counter(), 0, 0
    for done in executor.run():
        i = index[done.request_id]
        generated += len(done.generated_token_ids)
        failed += done.finish_reason == "error"
        print(json.dumps({"event": "result", "index": i, "prompt": prompts[i], "text": prompts[i] + done.text,
                          "generated_text": done.text, "generated_token_ids": done.generated_token_ids,
                          "prompt_token_ids": done.prompt_token_ids, "finish_reason": done.finish_reason,
                          "stopped_on_eos": done.finish_reason == "eos"}), flush=True)
    seconds = time.perf_counter() - start
    print(json.dumps({"event": "summary", "requests": len(prompts), "generated_tokens": generated,
                      "seconds": round(seconds, 3), "generated_tokens_per_s": round(generated / seconds, 2),
                      "scheduler": dataclasses.asdict(executor.scheduler.stats)}))
    if failed:
        raise GenerationError(f"{failed} of {len(prompts)} prompts failed (finish_reason \"error\"): "
                              f"{executor.last_error}")


if __name__ == "__main__":
    exit_cli(main)
