"""What bfloat16 prefill products cost in accuracy: logits of a prompt with the activations rounded to bfloat16 before
every matrix product (the numerics of `--matmul-precision bfloat16`, on AMX tiles or AVX512-BF16 dot products:
bfloat16 x bfloat16 products are exact in float32, sums stay float32), and of transformers computing in bfloat16,
each against transformers in float32 on the same bfloat16 weights.

    python -m benchmarks.bf16_numerics --shape qwen2.5-0.5b,tinyllama-1.1b --work DIR [--tokens 128]

The rounded-activation model is transformers in float32 with a hook that rounds each nn.Linear input to bfloat16:
an independent model of our kernels' arithmetic (their summation order aside), so it runs on any CPU. Reports,
over every prompt position, the largest |logit error| relative to the largest |logit|, and the share of positions
whose argmax (the greedy token) matches float32's. Random weights (benchmarks/checkpoints.py) and random token ids.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.checkpoints import SHAPES, real_shape_checkpoint


def compare(logits, reference) -> dict:
    """Relative max error and argmax agreement of [positions, vocab] logits against the reference ones."""
    error = float(np.abs(logits - reference).max() / np.abs(reference).max())
    agree = float((logits.argmax(-1) == reference.argmax(-1)).mean())
    return {"max_rel_error": float(f"{error:.3g}"), "argmax_agreement": round(agree, 4)}


def measure(shape: str, args) -> dict:
    """Errors of bfloat16-activation products and of a bfloat16 model against float32, for one shape."""
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    model_dir = real_shape_checkpoint(args.work, shape, "bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([np.random.default_rng(0).integers(0, SHAPES[shape]["vocab_size"], args.tokens).tolist()])
    with torch.no_grad():
        reference = hf(ids).logits[0].numpy()
        hooks = [m.register_forward_pre_hook(lambda _, x: (x[0].to(torch.bfloat16).to(torch.float32),))
                 for m in hf.modules() if isinstance(m, torch.nn.Linear)]
        rounded = hf(ids).logits[0].numpy()
        for hook in hooks:
            hook.remove()
        bf16 = hf.to(torch.bfloat16)(ids).logits[0].float().numpy()
    return {"shape": shape, "tokens": args.tokens, "bf16_products": compare(rounded, reference),
            "transformers_bf16": compare(bf16, reference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--work", required=True, help="directory for the random checkpoints (reused)")
    parser.add_argument("--tokens", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for shape in args.shape.split(","):
        print(json.dumps(measure(shape, args)), flush=True)


if __name__ == "__main__":
    main()
