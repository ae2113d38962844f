"""GPU decode speed of a CUDA artifact at Qwen2.5-0.5B shape (bf16), against the H200's memory roofline.

    python benchmarks/gpu_decode.py --work DIR [--cuda-compiler ptx|nvrtc|nvcc] [--tokens 128] [--runs 3]

Prints one JSON line: prefill and decode tokens/s (median of runs), weight bytes per token, and the
decode roofline at the GPU's memory bandwidth.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.checkpoints import real_shape_checkpoint, weight_bytes_per_token
from benchmarks.cpu_generate import runtime_steps, timed_generation
from compiler.build import build
from runtime import CompiledModel

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e peak


def main() -> None:
    """Build, run, print."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True)
    parser.add_argument("--cuda-compiler", default="ptx")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    model_dir = real_shape_checkpoint(args.work, "qwen2.5-0.5b", "bfloat16")
    artifact = build(model_dir, target="cuda", cuda_compiler=args.cuda_compiler, out=f"{args.work}/artifact",
                     prefill_buckets=(args.tokens,), max_context=2 * args.tokens, quiet=True).path
    model = CompiledModel(model_dir, artifact, device="cuda")
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.config.vocab_size, args.tokens)]
    prefill, decode = timed_generation(*runtime_steps(model, prompt), args.tokens, args.runs)
    weight_bytes = weight_bytes_per_token(model_dir)
    print(json.dumps({"model": "qwen2.5-0.5b-shape bf16", "cuda_compiler": args.cuda_compiler,
                      "prefill_tokens_per_s": round(prefill, 1), "decode_tokens_per_s": round(decode, 1),
                      "weight_bytes_per_token": weight_bytes,
                      "decode_roofline_tokens_per_s": round(H200_BANDWIDTH / weight_bytes, 1)}))


if __name__ == "__main__":
    main()
