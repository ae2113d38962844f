"""What bfloat16 prefill products cost in accuracy: logits of a prompt with the activations rounded to bfloat16 before
every matrix product (the numerics of `--matmul-precision bfloat16`, on AMX tiles or AVX512-BF16 dot products:
bfloat16 x bfloat16 products are exact in float32, sums stay float32), the same with attention's operands rounded
too (`bf16_attention`: what the build runs on AMX tiles and on AMD Zen 4/5's dot products, where prompt chunks'
attention products run in bfloat16), and of transformers computing in bfloat16, each against transformers in
float32 on the same bfloat16 weights.

    python -m benchmarks.bf16_numerics --shape qwen2.5-0.5b,tinyllama-1.1b --work DIR [--tokens 128]

The rounded-activation model is transformers in float32 with a hook that rounds each nn.Linear input to bfloat16,
and for the rounded attention also an attention function (transformers' AttentionInterface) that rounds q, keys,
probabilities and values: an independent model of our kernels' arithmetic (their summation order aside), so it runs
on any CPU. Reports, over every prompt position, the largest |logit error| relative to the largest |logit|, and the
share of positions whose argmax (the greedy token) matches float32's. Random weights (benchmarks/checkpoints.py) and
random token ids.
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
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = torch.tensor([np.random.default_rng(0).integers(0, SHAPES[shape]["vocab_size"], args.tokens).tolist()])
    with torch.no_grad():
        reference = hf(ids).logits[0].numpy()
        hooks = [m.register_forward_pre_hook(lambda _, x: (_bf16(x[0]),))
                 for m in hf.modules() if isinstance(m, torch.nn.Linear)]
        rounded = hf(ids).logits[0].numpy()
        hf.set_attn_implementation(_rounded_attention_name())
        attention = hf(ids).logits[0].numpy()
        hf.set_attn_implementation("eager")
        for hook in hooks:
            hook.remove()
        bf16 = hf.to(torch.bfloat16)(ids).logits[0].float().numpy()
    return {"shape": shape, "tokens": args.tokens, "bf16_products": compare(rounded, reference),
            "bf16_attention": compare(attention, reference), "transformers_bf16": compare(bf16, reference)}


def _bf16(x):
    """x rounded to bfloat16, kept float32."""
    import torch

    return x.to(torch.bfloat16).to(torch.float32)


def _rounded_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' attention interface with our bfloat16 attention kernels' arithmetic: q (scaled), keys,
    probabilities and values rounded to bfloat16, float32 scores and sums, each row divided by the sum of its rounded
    probabilities."""
    groups = query.shape[1] // key.shape[1]
    keys, values = (_bf16(t).repeat_interleave(groups, dim=1) for t in (key, value))
    scores = _bf16(query * scaling) @ keys.transpose(2, 3)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = _bf16((scores - scores.amax(-1, keepdim=True)).exp())
    return ((weights @ values) / weights.sum(-1, keepdim=True)).transpose(1, 2).contiguous(), weights


def _rounded_attention_name() -> str:
    """The name under which transformers knows `_rounded_attention` (registered with eager's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register("bf16_rounded", _rounded_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("bf16_rounded", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return "bf16_rounded"


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
