"""Serving under load: our OpenAI-compatible server beside llama.cpp's `llama-server`, same checkpoint, same clients.

    python -m benchmarks.serve_load --shape qwen2.5-0.5b --dtype bfloat16 --clients 1,4,16,64 --work DIR

The checkpoint is a random-weight one at a real shape (benchmarks/checkpoints.py) with a tokenizer whose
vocabulary covers every id. Ours: built for llvm with steps of up to the most clients (`--batch-rows 1,4,16,64`,
`--matmul-precision` as given: float32 by default), served by `python -m runtime.serve` with as many active
sequences. llama.cpp: its own server, built from the vendored llama.cpp of llama-cpp-python's sdist
(benchmarks/gguf_convert.py), on the checkpoint's GGUF of the same dtype (BF16 for bfloat16, F16 for float16),
restarted for each level with `--parallel` set to that level's client count (continuous batching, its default)
and a context of that many sequences.

At each level N, N clients each send `--requests` streaming completions one after another: a prompt of
`--prompt-tokens` random token ids (the same for both servers), `--tokens` new tokens, greedy, EOS ignored.
Reported per server and level: requests/s, output tokens/s, time to first token and inter-token latency
(p50 and p99, milliseconds), lost or failed requests; then a Markdown table with our/llama.cpp ratios. One
server runs at a time; both use every core the process may use. Bounded: a level stops after --level-timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.host import cpu_name
from benchmarks.checkpoints import SHAPES, add_bpe_tokenizer, real_shape_checkpoint
from benchmarks.gguf_convert import gguf_file, llama_server_binary
from compiler.options import MATMUL_PRECISIONS

GGUF_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a loopback port, up once /health answers 200; stopped with SIGTERM."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        import httpx

        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{command[0]} did not start: see {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


async def one_request(client, url: str, model: str, prompt: list[int], tokens: int) -> dict:
    """One streaming completion: when each token's chunk arrived, and whether the request completed."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start, arrivals, done = time.perf_counter(), [], False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "arrivals": [], "start": start, "error": response.status_code}
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):  # a token's chunk (llama-server sends one even for a token
                    choices = json.loads(line[6:]).get("choices") or [{}]  # whose text is empty), not the last one
                    if choices[0] and choices[0].get("finish_reason") is None:
                        arrivals.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 -- a lost request is counted, not fatal
        return {"ok": False, "arrivals": arrivals, "start": start, "error": repr(e)}
    return {"ok": done and len(arrivals) > 0, "arrivals": arrivals, "start": start}


async def load(url: str, model: str, clients: int, requests: int, prompts: list[list[int]], tokens: int,
               timeout: float) -> dict:
    """N clients, each sending `requests` completions one after another; the level's figures."""
    import httpx

    async def client_loop(k: int, client) -> list[dict]:
        return [await one_request(client, url, model, prompts[(k * requests + r) % len(prompts)], tokens)
                for r in range(requests)]

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(client_loop(k, client) for k in range(clients))), timeout)
        seconds = time.perf_counter() - start
    runs = [r for per_client in results for r in per_client]
    ok = [r for r in runs if r["ok"]]
    ttft = [r["arrivals"][0] - r["start"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    out_tokens = sum(len(r["arrivals"]) for r in ok)
    pct = lambda xs, q: round(1000 * float(np.percentile(xs, q)), 1) if xs else None  # noqa: E731
    return {"clients": clients, "requests": len(runs), "failed": len(runs) - len(ok), "seconds": round(seconds, 2),
            "requests_per_s": round(len(ok) / seconds, 3), "output_tokens_per_s": round(out_tokens / seconds, 2),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99)}


def ours(model_dir: Path, levels: list[int], args) -> list[dict]:
    """Our server at every level (built once for the largest)."""
    from compiler.build import build

    precision = "" if args.matmul_precision == "float32" else f".{args.matmul_precision}"
    artifact = build(model_dir, out=args.work / f"{model_dir.name}.serve{precision}.llvm", max_context=args.context,
                     batch_rows=tuple(sorted({1, *levels})), prefill_buckets=tuple(sorted({16, 64, 256, *levels})),
                     matmul_precision=args.matmul_precision, quiet=True).path
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = Server([sys.executable, "-m", "runtime.serve", str(model_dir), "--artifact", str(artifact),
                     "--port", str(port), "--max-active-sequences", str(max(levels)), "--max-queue", "4096"]
                    + [word for flag, value in (("--max-batch-tokens", args.max_batch_tokens),
                                                ("--max-decoding-batch-tokens", args.max_decoding_batch_tokens))
                       if value for word in (flag, str(value))],
                    port, args.work / "ours-server.log", env)
    try:
        return [{"server": "ours", **asyncio.run(load(server.url, model_dir.name, n, args.requests,
                                                       args.prompts, args.tokens, args.level_timeout))}
                for n in levels]
    finally:
        server.stop()


def llama_cpp(model_dir: Path, levels: list[int], args) -> list[dict]:
    """llama.cpp's server at every level, restarted with that level's parallel slots."""
    try:
        binary = llama_server_binary(args.work, args.llama_cpp_src)
        gguf = gguf_file(model_dir, GGUF_TYPES[args.dtype], args.work, args.llama_cpp_src)
    except Exception as e:  # noqa: BLE001 -- a peer that cannot be set up is a row with the reason
        return [{"server": "llama.cpp", "clients": n, "error": str(e)} for n in levels]
    threads = str(len(os.sched_getaffinity(0)))
    rows = []
    for n in levels:
        port = free_port()
        server = Server([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel",
                         str(n), "--ctx-size", str(n * args.context), "--threads", threads, "--threads-batch",
                         threads, "--cont-batching", "--no-webui"], port, args.work / f"llama-server-{n}.log")
        try:
            rows.append({"server": "llama.cpp", **asyncio.run(load(server.url, model_dir.name, n, args.requests,
                                                                     args.prompts, args.tokens, args.level_timeout))})
        finally:
            server.stop()
    return rows


def table(rows: list[dict], levels: list[int]) -> str:
    """Markdown: per level, both servers' figures and the ratios ours / llama.cpp."""
    lines = ["| clients | server | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | failed |",
             "|---|---|---|---|---|---|---|"]
    for n in levels:
        pair = {r["server"]: r for r in rows if r.get("clients") == n}
        for name in ("ours", "llama.cpp"):
            r = pair.get(name, {})
            if "error" in r or not r:
                lines.append(f"| {n} | {name} | {r.get('error', 'not run')} | | | | |")
                continue
            lines.append(f"| {n} | {name} | {r['requests_per_s']} | {r['output_tokens_per_s']} | {r['ttft_p50_ms']} / "
                         f"{r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} | {r['failed']} |")
        a, b = pair.get("ours", {}), pair.get("llama.cpp", {})
        if a.get("output_tokens_per_s") and b.get("output_tokens_per_s"):
            lines.append(f"| {n} | ours / llama.cpp | | {a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x | | "
                         f"p99 {a['itl_p99_ms'] / b['itl_p99_ms']:.2f}x | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_load", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[s for s, o in SHAPES.items() if o["arch"] in ("qwen2", "llama")],
                        default="qwen2.5-0.5b")
    parser.add_argument("--dtype", choices=tuple(GGUF_TYPES), default="bfloat16")
    parser.add_argument("--clients", default="1,4,16,64", help="concurrency levels (comma-separated)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client at each level")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--context", type=int, default=128, help="tokens one sequence may hold")
    parser.add_argument("--level-timeout", type=float, default=900.0, help="seconds one level may take")
    parser.add_argument("--work", type=Path, required=True, help="directory for checkpoints, builds, logs")
    parser.add_argument("--llama-cpp-src", help="an unpacked llama-cpp-python sdist or llama.cpp tree")
    parser.add_argument("--skip", choices=("ours", "llama.cpp"), help="run only the other server")
    parser.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="float32",
                        help="our build's prefill products (auto: bfloat16 on AMX / AVX512-BF16 for a bf16 checkpoint, "
                        "as llama.cpp's BF16 GGUF rounds its activations)")
    parser.add_argument("--max-batch-tokens", type=int, help="our server's token budget per step (default: its own)")
    parser.add_argument("--max-decoding-batch-tokens", type=int,
                        help="our server's budget for steps with decodes in them (default: its own)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    levels = sorted({int(n) for n in args.clients.split(",")})
    model_dir = real_shape_checkpoint(args.work, args.shape, args.dtype)
    add_bpe_tokenizer(model_dir, SHAPES[args.shape]["arch"])
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = np.random.default_rng(0)
    args.prompts = [[int(t) for t in rng.integers(1000, vocab - 1000, args.prompt_tokens)] for _ in range(64)]
    rows = []
    for name, run in (("ours", ours), ("llama.cpp", llama_cpp)):
        if args.skip != name:
            rows += run(model_dir, levels, args)
            print(json.dumps(rows[-len(levels):]), flush=True)
    print(f"\nCPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores; shape "
          f"{args.shape} {args.dtype}; {args.requests} requests per client, {args.prompt_tokens} prompt + {args.tokens} "
          f"new tokens each, greedy, EOS ignored; ours built with --matmul-precision {args.matmul_precision}\n")
    print(table(rows, levels))


if __name__ == "__main__":
    main()
