"""Our build of a llama.cpp GGUF file beside llama.cpp on the same file: tokens, logits, greedy text and speed.

    python -m benchmarks.gguf_peer --shape qwen2.5-0.5b,tinyllama-1.1b --quant f16,q8_0,q4_k_m --work DIR
    python -m benchmarks.gguf_peer --shape tinyllama-1.1b --quant q4_0 --matmul-precision bfloat16 --work DIR

The GGUF files come from llama.cpp's own converter (F16) and quantiser (the other types) run on a random
real-shape checkpoint, so the files are what users download: llama.cpp's tensor names and types (Q4_K_M mixes
Q4_K with Q6_K), its SentencePiece vocabulary, Llama's permuted q/k rows. Per file it prints one JSON line:
whether the prompt's tokens are llama.cpp's, the prompt's last logits against llama.cpp's (largest difference
relative to llama.cpp's largest logit; llama.cpp rounds activations for its quantised products, we do not), how
many of 16 greedy tokens agree, how many weights we ran packed (projections, embedding and head of every block
type, in the INT4 kernels), and prefill (the prompt, in chunks of 64) and decode tokens/s of both, alternating
(medians of --runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.checkpoints import SHAPES, real_shape_checkpoint
from benchmarks.gguf_convert import QUANT_TYPES, gguf_file, quantized_gguf
from benchmarks.host import cpu_description
from compiler.build import build
from compiler.options import MATMUL_PRECISIONS
from runtime import CompiledModel, GreedyGenerationConfig, generate
from runtime.tokenizer import Tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. Hello, world! 12345 numbers and words. " * 3
GREEDY = 16
DECODE = 32
THREADS = 2


def model_dir_of(gguf: Path) -> Path:
    """A model directory holding only `gguf` (a link to it), as a user would pass one."""
    folder = gguf.with_suffix(".d")
    folder.mkdir(exist_ok=True)
    link = folder / gguf.name
    if not link.exists():
        link.symlink_to(gguf.resolve())
    return folder


def compare(gguf: Path, work: Path, runs: int, matmul_precision: str = "float32") -> dict:
    """The figures of one GGUF file (see the module docstring), ours built with `matmul_precision` products."""
    import llama_cpp

    model_dir = model_dir_of(gguf)
    suffix = "" if matmul_precision == "float32" else f".{matmul_precision}"
    built = build(model_dir, out=work / f"{gguf.stem}{suffix}.llvm", prefill_buckets=(16, 64), max_context=256,
                  matmul_precision=matmul_precision, quiet=True)
    ours = CompiledModel(model_dir, built.path)
    llm = llama_cpp.Llama(str(gguf), n_ctx=256, n_batch=64, n_ubatch=64, n_threads=THREADS,
                          n_threads_batch=THREADS, verbose=False)
    vocab = llm.n_vocab()
    ids = Tokenizer(model_dir).encode(PROMPT)
    theirs_ids = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)

    def peer_logits(tokens):
        llm.eval(tokens)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).copy()

    llm.reset()
    want = peer_logits(ids)
    got = ours.forward(ids, ours.new_cache(len(ids) + 1))
    peer_tokens = [int(np.argmax(want))]
    for _ in range(GREEDY - 1):
        peer_tokens.append(int(np.argmax(peer_logits([peer_tokens[-1]]))))
    our_tokens = generate(ours, ids, GreedyGenerationConfig(GREEDY, eos_token_ids=[])).generated_token_ids
    agree = next((i for i, (a, b) in enumerate(zip(our_tokens, peer_tokens)) if a != b), GREEDY)

    def ours_decode():
        result = generate(ours, ids[:16], GreedyGenerationConfig(DECODE + 1, eos_token_ids=[]))
        return DECODE / result.decode_seconds

    def peer_decode():
        llm.reset()
        peer_logits(ids[:16])
        start = time.perf_counter()
        token = 0
        for _ in range(DECODE):
            token = int(np.argmax(peer_logits([token])))
        return DECODE / (time.perf_counter() - start)

    def ours_prefill():
        cache = ours.new_cache(len(ids) + 1)
        start = time.perf_counter()
        ours.forward(ids, cache)
        return len(ids) / (time.perf_counter() - start)

    def peer_prefill():
        llm.reset()
        start = time.perf_counter()
        peer_logits(ids)
        return len(ids) / (time.perf_counter() - start)

    timers = {"ours_prefill": ours_prefill, "peer_prefill": peer_prefill, "ours": ours_decode,
              "llama.cpp": peer_decode}
    rates = {name: [] for name in timers}
    for _ in range(runs):
        for name, timer in timers.items():
            rates[name].append(timer())
    ours_rate, peer_rate, ours_fill, peer_fill = (statistics.median(rates[k]) for k in (
        "ours", "llama.cpp", "ours_prefill", "peer_prefill"))
    llm.close()
    quantization = ours.manifest.quantization
    return {"gguf": gguf.name, "packed_params": quantization.packed_params if quantization else 0,
            "tokens_equal": ids == theirs_ids, "prompt_tokens": len(ids),
            "logit_difference": float(np.abs(got - want).max() / np.abs(want).max()),
            "argmax_equal": int(np.argmax(got)) == int(np.argmax(want)), "greedy_tokens_agreeing": agree,
            "prefill_tok_s": round(ours_fill, 1), "llama_cpp_prefill_tok_s": round(peer_fill, 1),
            "prefill_ratio": round(ours_fill / peer_fill, 3),
            "decode_tok_s": round(ours_rate, 2), "llama_cpp_decode_tok_s": round(peer_rate, 2),
            "decode_ratio": round(ours_rate / peer_rate, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--quant", default="f16,q8_0,q4_k_m", help=f"comma-separated, of f16, {', '.join(QUANT_TYPES)}")
    parser.add_argument("--runs", type=int, default=3, help="decode timings per engine, alternating (default 3)")
    parser.add_argument("--work", required=True, help="directory for checkpoints, GGUF files and artifacts (reused)")
    parser.add_argument("--llama-cpp-src", help="unpacked llama-cpp-python sdist or llama.cpp tree with the converter")
    parser.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="float32",
                        help="our build's products (as `python -m compiler build`; default float32)")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"cpu": cpu_description(), "threads": THREADS}), flush=True)
    for shape in args.shape.split(","):
        checkpoint = real_shape_checkpoint(work, shape, "bfloat16")
        for quant in args.quant.split(","):
            gguf = gguf_file(checkpoint, "f16", work, args.llama_cpp_src) if quant == "f16" else \
                quantized_gguf(checkpoint, quant, work, args.llama_cpp_src)
            print(json.dumps({"shape": shape, "quant": quant, "matmul_precision": args.matmul_precision,
                              **compare(gguf, work, args.runs, args.matmul_precision)}), flush=True)


if __name__ == "__main__":
    main()
