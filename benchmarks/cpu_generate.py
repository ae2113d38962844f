"""End-to-end CPU speed at real model shapes: ours beside transformers and llama.cpp, prefill N tokens, decode N.

    python -m benchmarks.cpu_generate --shape qwen2.5-0.5b --dtype bfloat16 --tokens 128 --work DIR
    python -m benchmarks.cpu_generate --shape qwen2.5-0.5b --tokens 2048 --decode-tokens 32 --work DIR  # long prompt
    python -m benchmarks.cpu_generate --shape all --dtype all --work DIR        # every shape in bf16 and f32
    python -m benchmarks.cpu_generate --shape tinyllama-1.1b --dtype awq --work DIR   # AWQ INT4 beside Q4_0 / Q8_0

--shape and --dtype take a name, a comma-separated list or `all`. For each shape and dtype the run makes a
random-weight checkpoint in Hugging Face format (benchmarks/checkpoints.py), builds it for llvm, opens every engine
in this process with the same number of threads (every core it may use), and runs them in turn, --runs rounds: in
a round each engine prefills (the order rotating from round to round), then their decode steps interleave, a slice
of each engine's in turn (DECODE_SLICES slices), so that a shared host's drift, which can move its memory bandwidth
by half within seconds, hits every engine alike; a short pause after each engine's turn lets its threads stop
spinning. The decode roofline takes its turns too: an engine whose step reads a token's weight bytes from memory.

- ours: the compiled artifact through CompiledModel; for bfloat16 and AWQ also one built with --matmul-precision
  bfloat16 (prefill products on AMX tiles, else prefill and decode products on AVX512-BF16 dot products, but for
  one sequence's rows up to a page on AMD Zen 4: schedules.cpu.rows_on_dot_products; a row with the reason where
  this CPU has neither);
  `--mcpu cooperlake` on an AMX Xeon builds for a CPU without AMX, so that the AVX512-BF16 path is timed there;
- transformers (torch CPU, the checkpoint's dtype);
- llama.cpp through llama-cpp-python, on the checkpoint converted to GGUF by the converter from
  llama-cpp-python's sdist (F32 for float32; BF16 and F16 for bfloat16; F16 for float16).

`--dtype awq`: the random float16 checkpoint quantised by our AWQ packer (GEMM INT4, group 128) for ours, beside
transformers in bfloat16 on the float checkpoint and llama.cpp on its Q4_0 and Q8_0 GGUFs (the F16 conversion
quantised by the same llama.cpp build's llama_model_quantize); the roofline counts the bytes the AWQ checkpoint
stores (packed words, zeros, f16 scales, the f16 embeddings and lm_head).

Each does one prefill of the N-token prompt (token ids, no tokenizer) and N-1 single-token decode
steps fed the greedy argmax (no EOS), --runs times; the medians are reported. --decode-tokens M makes that M-1 steps
(a long prompt's prefill, and decode at its context, without as many decode steps). A peer that is not
installed or fails to convert or run is a table row with the reason (llama.cpp first runs one batch of each GGUF in
a child process, so a crash of its own is such a row, not the end of the benchmark). Prints one JSON line per shape
and dtype, then a Markdown table with the ratios us/peer and us/decode roofline (the read bandwidth of those
turns / weight bytes read per token). transformers is in the `test` extra; llama-cpp-python and the
converter's needs are in the `bench` extra (pip install -e .[test,bench]).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from benchmarks.checkpoints import (SHAPES, awq_checkpoint_of, checkpoint_dtype, real_shape_checkpoint,
                                    weight_bytes_per_token)
from benchmarks.gguf_convert import QUANT_TYPES, gguf_file, quantized_gguf
from benchmarks.host import cpu_description

DTYPES = ("bfloat16", "float32")
GGUF_TYPES = {"float32": ("f32",), "bfloat16": ("bf16", "f16"), "float16": ("f16",), "awq": ("q4_0", "q8_0", "q4_k_m")}
AWQ_GROUP = 128
ROOFLINE = "decode roofline: the weights of a token read from memory (numpy)"
PAUSE_S = 0.5  # between two engines' turns: the threads of the one that ran (OpenMP) stop spinning
DECODE_SLICES = 8  # a round's decode steps, in this many slices that the engines take in turn


@contextmanager
def memory_read(weight_bytes: int, args, prompt: list[int], threads: int):
    """The decode roofline as an engine that takes its turns with the others: each of its steps reads a token's
    weight bytes from memory (numpy max over one share per core, far larger than the caches), so its tokens/s is
    what the host's read bandwidth allows at that moment: (label, prefill, decode)."""
    parts = [np.ones(weight_bytes // 4 // threads, np.float32) for _ in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        def read(state=None):
            list(pool.map(np.max, parts))  # np.sum is compute-bound here (about half the rate)
            return state

        yield ROOFLINE, read, read


def medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The median prefill and the median decode tokens/s of several runs."""
    return statistics.median(p for p, _ in runs), statistics.median(d for _, d in runs)


@contextmanager
def ours(model_dir: Path, args, prompt: list[int], threads: int, matmul_precision: str = "float32"):
    """Our runtime: (label, prefill, decode) on an artifact built for this shape and prompt length."""
    from compiler.build import build
    from compiler.target import BF16_PATH_NAMES
    from runtime import CompiledModel

    suffix = ("" if matmul_precision == "float32" else f".{matmul_precision}") + (f".{args.mcpu}" if args.mcpu else "")
    artifact = build(model_dir, out=f"{args.work}/{model_dir.name}{suffix}.llvm",
                     prefill_buckets=(args.tokens,), max_context=context(args), mcpu=args.mcpu,
                     matmul_precision=matmul_precision, quiet=True).path
    model = CompiledModel(model_dir, artifact)
    path = model.manifest.target.bf16_products  # the path the build chose for this CPU
    steps = "prefill and decode" if path == "avx512bf16" else "prefill"
    label = "ours (llvm artifact" + (f", bf16 {steps} products on {BF16_PATH_NAMES[path]})" if path else ")")
    yield label, *runtime_steps(model, prompt, context(args))


def context(args) -> int:
    """Tokens a sequence of the benchmark holds: the prompt and the tokens generated after it."""
    return args.tokens + args.decode_tokens


def ours_bf16(model_dir: Path, args, prompt: list[int], threads: int):
    """Ours built with --matmul-precision bfloat16 (activations rounded to bf16 in prefill products, as llama.cpp's
    BF16 path does)."""
    return ours(model_dir, args, prompt, threads, matmul_precision="bfloat16")


def runtime_steps(model, prompt: list[int], tokens: int):
    """An engine's (prefill, decode) on a CompiledModel: a fresh cache of `tokens` tokens, greedy steps."""

    def prefill():
        cache = model.new_cache(tokens)
        return cache, int(np.argmax(model.forward(prompt, cache)))

    def decode(state):
        cache, token = state
        return cache, int(np.argmax(model.forward([token], cache)))

    return prefill, decode


@contextmanager
def transformers_peer(model_dir: Path, args, prompt: list[int], threads: int):
    """transformers, torch CPU, same threads, the checkpoint's dtype: (label, prefill, decode)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    dtype = args.peer_dtype or checkpoint_dtype(model_dir)  # bfloat16 beside an AWQ checkpoint of float16 weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt])

    def step(tokens, past=None):
        with torch.no_grad():
            out = hf(tokens, past_key_values=past, use_cache=True, logits_to_keep=1)  # as generate() does
        return out.past_key_values, out.logits.argmax(-1)

    label = f"transformers {transformers.__version__} (torch {torch.__version__})"
    yield label, lambda: step(ids), lambda state: step(state[1], state[0])


def llama_options(tokens: int, context_tokens: int, threads: int) -> dict:
    """llama.cpp's context options for a prompt of `tokens` in one batch in a context of `context_tokens`, on
    `threads`."""
    return dict(n_ctx=context_tokens, n_batch=tokens, n_ubatch=tokens, n_threads=threads, n_threads_batch=threads,
                flash_attn=True, verbose=False)


@contextmanager
def llama_cpp_peer(gguf: Path, args, prompt: list[int], threads: int):
    """llama.cpp (llama-cpp-python) on a GGUF file, same threads, prompt in one batch: (label, prefill, decode)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), **llama_options(args.tokens, context(args), threads))
    vocab = llm.n_vocab()

    def step(tokens):
        llm.eval(tokens)
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))

    def prefill():
        llm.reset()
        return step(prompt)

    label = f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, GGUF {gguf.name.split('.')[-2].upper()})"
    try:
        yield label, prefill, lambda token: step([token])
    finally:
        llm.close()


def open_engine(stack: ExitStack, peer, source, args, prompt: list[int], threads: int, fallback: str) -> dict:
    """One engine opened on `source` (checkpoint dir or GGUF, or the exception that stopped it) for the rounds, held
    until `stack` closes: {"engine", "steps": (prefill, decode), "runs": []}, or {"engine", "error"}."""
    try:
        if isinstance(source, Exception):
            raise source
        label, prefill, decode = stack.enter_context(peer(source, args, prompt, threads))
        return {"engine": label, "steps": (prefill, decode), "runs": []}
    except ImportError as e:
        return {"engine": fallback, "error": f"not installed ({e}); pip install -e .[test,bench]"}
    except Exception as e:  # noqa: BLE001  (a peer that fails is reported, not hidden)
        return {"engine": fallback, "error": f"{type(e).__name__}: {e}"}


def run_rounds(engines: list[dict], tokens: int, rounds: int, steps: int | None = None) -> list[dict]:
    """Every open engine once per round, `rounds` times: each prefills its `tokens` in turn (the order rotating by
    round), then their decode steps (`steps`, else tokens - 1) interleave, DECODE_SLICES slices taken in turn; each
    engine's medians (or the error that stopped it). Not one engine's run after another's: a shared host's speed
    drifts within seconds."""
    steps = tokens - 1 if steps is None else steps
    slices = [len(s) for s in np.array_split(np.arange(steps), DECODE_SLICES) if len(s)]
    for round_ in range(rounds):
        live = [e for e in engines if "steps" in e]
        live = live[round_ % len(live):] + live[:round_ % len(live)] if live else []
        for e in live:
            _turn(e, _prefill, tokens)
        for count in slices:
            for e in (e for e in live if "steps" in e):
                _turn(e, _decode, count)
        for e in (e for e in live if "steps" in e):
            e["runs"].append((tokens / e.pop("prefill_s"), steps / e.pop("decode_s")))
            e.pop("state")
    return [_result(e) for e in engines]


def _turn(engine: dict, action, count: int) -> None:
    """One timed turn of an engine, then the pause; an exception stops the engine (its row gives the error)."""
    try:
        action(engine, count)
    except Exception as error:  # noqa: BLE001
        for key in ("steps", "state", "prefill_s", "decode_s"):
            engine.pop(key, None)
        engine["error"] = f"{type(error).__name__}: {error}"
    time.sleep(PAUSE_S)


def _prefill(engine: dict, tokens: int) -> None:
    """The round's prefill (`run_rounds` dropped the last round's state, and its cache with it), its seconds
    recorded, after one untimed prefill that wakes the engine's threads from the pause (on a shared host, a single
    call right after an idle pause took 1.3x as long, and varied twice as much, as the same call repeated)."""
    engine["steps"][0]()  # its state is dropped at once, so its cache is free again
    start = time.perf_counter()
    engine["state"] = engine["steps"][0]()
    engine["prefill_s"], engine["decode_s"] = time.perf_counter() - start, 0.0


def _decode(engine: dict, steps: int) -> None:
    """`steps` decode steps from the engine's state, their seconds added to the round's decode time."""
    start = time.perf_counter()
    for _ in range(steps):
        engine["state"] = engine["steps"][1](engine["state"])
    engine["decode_s"] += time.perf_counter() - start


def _result(engine: dict) -> dict:
    """An engine's row: its median speeds, or the error that stopped it."""
    if "error" in engine:
        return {"engine": engine["engine"], "error": engine["error"]}
    prefill, decode = medians(engine["runs"])
    return {"engine": engine["engine"], "prefill_tokens_per_s": round(prefill, 1),
            "decode_tokens_per_s": round(decode, 2)}


def gguf_or_error(model_dir: Path, outtype: str, args, threads: int) -> Path | Exception:
    """The GGUF conversion of `model_dir`, or why there is none (llama-cpp-python missing, converter failed)."""
    try:
        import llama_cpp  # noqa: F401  (no point converting for a peer that cannot run)

        if outtype in QUANT_TYPES:
            gguf = quantized_gguf(model_dir, outtype, Path(args.work), args.llama_cpp_src)
        else:
            gguf = gguf_file(model_dir, outtype, Path(args.work), args.llama_cpp_src)
        return survives_a_run(gguf, args.tokens, context(args), threads)
    except Exception as e:  # noqa: BLE001  (reported in the peer's row)
        return e


# One prompt-sized batch and one decode step of llama.cpp on a GGUF, in a child process (argv: GGUF, tokens, the
# options of `llama_options` as JSON).
_PROBE = """
import json, sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], **json.loads(sys.argv[3]))
llm.eval(list(range(1, int(sys.argv[2]) + 1)))
llm.eval([1])
"""


class PeerCrash(RuntimeError):
    """llama.cpp died on a GGUF in the probe process."""


def survives_a_run(gguf: Path, tokens: int, context_tokens: int, threads: int) -> Path:
    """`gguf`, once llama.cpp has run a prompt-sized batch and a decode step on it in a child process: a peer that
    dies there (seen: llama.cpp's AMX path for Q4_0 on a Xeon, SIGSEGV) becomes a row with the reason instead of
    killing this process and every figure in it."""
    options = json.dumps(llama_options(tokens, context_tokens, threads))
    done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf), str(tokens), options], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        how = f"signal {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exit {done.returncode}"
        raise PeerCrash(f"llama.cpp died ({how}) running a {tokens}-token batch on {gguf.name} in a probe process")
    return gguf


def benchmark(shape: str, dtype: str, args) -> dict:
    """Every engine's speeds for one shape and dtype, with the bandwidth and decode roofline of the moment."""
    args.peer_dtype = "bfloat16" if dtype == "awq" else None
    model_dir = real_shape_checkpoint(args.work, shape, "float16" if dtype == "awq" else dtype)
    ours_dir = awq_checkpoint_of(model_dir, AWQ_GROUP) if dtype == "awq" else model_dir
    threads = len(os.sched_getaffinity(0))
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, SHAPES[shape]["vocab_size"], args.tokens)]
    load = os.getloadavg()[0]  # other work on the machine skews every column; recorded, not corrected for
    weight_bytes = weight_bytes_per_token(ours_dir)
    peers = [(ours, ours_dir, "ours")]
    peers += [(ours_bf16, ours_dir, "ours (bf16 prefill products)")] if dtype in ("bfloat16", "awq") else []
    peers += [(transformers_peer, model_dir, "transformers")]
    peers += [(llama_cpp_peer, gguf_or_error(model_dir, outtype, args, threads), f"llama.cpp (GGUF {outtype.upper()})")
              for outtype in GGUF_TYPES[dtype]]
    peers += [(memory_read, weight_bytes, ROOFLINE)]
    with ExitStack() as stack:
        engines = run_rounds([open_engine(stack, peer, source, args, prompt, threads, fallback)
                              for peer, source, fallback in peers], args.tokens, args.runs, args.decode_tokens - 1)
    gc.collect()
    roofline = engines.pop().get("decode_tokens_per_s", float("nan"))
    what = f"AWQ INT4 g{AWQ_GROUP}" if dtype == "awq" else dtype
    return {"model": f"{shape} {what} (random weights)", "cpu": cpu_description(), "threads": threads,
            "tokens": args.tokens, "decode_tokens": args.decode_tokens, "runs": args.runs,
            "load_average_1m": round(load, 2), "read_bandwidth_gb_s": round(roofline * weight_bytes / 1e9, 1),
            "weight_bytes_per_token": weight_bytes, "decode_roofline_tokens_per_s": roofline, "engines": engines}


def ratio(a: dict, b: dict, key: str) -> str:
    """a[key] / b[key] to two places, or empty when either is missing."""
    return f"{a[key] / b[key]:.2f}" if key in a and key in b else ""


def table(results: list[dict]) -> str:
    """A Markdown table of every engine's tok/s and our ratios to it (default build; prefill of the bf16-products
    build), plus each decode roofline, under the CPU it ran on."""
    lines = [f"CPU: {results[0]['cpu']}" if results else "", "",
             "| model | engine | prefill tok/s | decode tok/s | us/engine prefill | us/engine decode "
             "| us (bf16 products)/engine prefill |", "|---|---|---|---|---|---|---|"]
    for r in results:
        us, prefill, decode = r["engines"][0], "prefill_tokens_per_s", "decode_tokens_per_s"
        bf16 = next((e for e in r["engines"][1:] if e["engine"].startswith("ours") and "error" not in e), {})
        for e in r["engines"]:
            if "error" in e:
                lines.append(f"| {r['model']} | {e['engine']} | failed: {e['error']} | | | | |")
                continue
            ours = e is us or e is bf16
            lines.append(f"| {r['model']} | {e['engine']} | {e[prefill]} | {e[decode]} | "
                         f"{'' if ours else ratio(us, e, prefill)} | {'' if ours else ratio(us, e, decode)} | "
                         f"{'' if ours else ratio(bf16, e, prefill)} |")
        roof = r["decode_roofline_tokens_per_s"]
        vs = f"{us[decode] / roof:.2f}" if decode in us else ""
        lines.append(f"| {r['model']} | decode roofline: {r['read_bandwidth_gb_s']} GB/s read / "
                     f"{r['weight_bytes_per_token'] / 1e9:.2f} GB of weights per token | | {roof} | | {vs} | |")
    return "\n".join(lines)


def choices(value: str, known: tuple[str, ...], every: tuple[str, ...]) -> list[str]:
    """`value` as a list of names: one name, a comma-separated list, or `all` (the names in `every`)."""
    names = list(every) if value == "all" else value.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(known)} or all")
    return names


def main() -> None:
    """Benchmark every shape and dtype asked for; print a JSON line for each and then the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=lambda v: choices(v, tuple(SHAPES), tuple(SHAPES)), default=["qwen2.5-0.5b"],
                        help=f"{', '.join(sorted(SHAPES))}, a comma-separated list, or all")
    parser.add_argument("--dtype", type=lambda v: choices(v, tuple(GGUF_TYPES), DTYPES), default=["bfloat16"],
                        help="bfloat16, float32, float16, awq (AWQ INT4 beside llama.cpp Q4_0 and Q8_0), a "
                        "comma-separated list, or all (bfloat16 and float32)")
    parser.add_argument("--tokens", type=int, default=128,
                        help="prompt tokens, and tokens generated unless --decode-tokens says otherwise (default 128)")
    parser.add_argument("--decode-tokens", type=int, help="tokens generated after the prompt, the first by the prefill "
                        "(default: --tokens)")
    parser.add_argument("--runs", type=int, default=3, help="runs per engine; medians are reported (default 3)")
    parser.add_argument("--work", required=True, help="directory for checkpoints, artifacts and GGUF files (reused)")
    parser.add_argument("--mcpu", help="build ours for this LLVM CPU (default: this machine's), e.g. cooperlake on an "
                        "AMX Xeon to time the AVX512-BF16 path there")
    parser.add_argument("--llama-cpp-src", help="unpacked llama-cpp-python sdist or llama.cpp tree with "
                        "convert_hf_to_gguf.py (default: pip download the installed version's sdist into --work)")
    args = parser.parse_args()
    args.decode_tokens = args.tokens if args.decode_tokens is None else args.decode_tokens
    if args.tokens < 1 or args.decode_tokens < 2:
        parser.error("--tokens must be at least 1 and --decode-tokens at least 2 (one decode step)")
    results = []
    for shape in args.shape:
        for dtype in args.dtype:
            results.append(benchmark(shape, dtype, args))
            print(json.dumps(results[-1]), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
