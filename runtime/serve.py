"""`python -m runtime.serve MODEL_DIR`: an OpenAI-compatible HTTP server over the continuous batch executor.

    python -m runtime.serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--artifact PATH] [--device cpu|cuda]
                            [--max-active-sequences N] [--max-batch-tokens N] [--max-decoding-batch-tokens N]
                            [--max-queue N] [--request-timeout S] [--api-key KEY] [--shutdown-grace S]

Serves /v1/models, /v1/completions and /v1/chat/completions (JSON, or server-sent events with "stream": true),
/health and /metrics (Prometheus). It builds nothing: the artifact must exist (built with --batch-rows at
least --max-active-sequences). Binds to loopback unless --host says otherwise. SIGINT / SIGTERM stop it
gracefully: no new connections, running requests get --shutdown-grace seconds to finish, then exit 0.
Starlette + uvicorn (the `serve` extra: pip install -e .[serve]): a small, well-kept ASGI stack whose
streaming responses notice a client that goes away, so its request is cancelled at once.
"""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from ir.errors import UsageError, add_debug_flag, exit_cli, positive_int


def main(argv: list[str]) -> int:
    """Run the server CLI on `argv`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m runtime.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", metavar="MODEL_DIR")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--artifact", help="artifact directory (default: where `compiler build MODEL_DIR` writes)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-active-sequences", type=positive_int("--max-active-sequences"),
                        help="requests batched at once (default: the artifact's largest --batch-rows)")
    parser.add_argument("--max-batch-tokens", type=positive_int("--max-batch-tokens"),
                        help="tokens one step may hold (decodes and prefill chunks; default: the artifact's largest "
                             "--prefill-buckets); steps with decodes in them hold at most --max-decoding-batch-tokens")
    parser.add_argument("--max-decoding-batch-tokens", type=positive_int("--max-decoding-batch-tokens"),
                        help="tokens a step may hold while sequences are decoding (their decodes, then prefill "
                             "chunks; default 64, at most --max-batch-tokens): bounds how long a new prompt delays "
                             "the running streams' next tokens")
    parser.add_argument("--max-queue", type=positive_int("--max-queue"), default=256,
                        help="requests that may wait for a place in the batch; more are answered 429 (default 256)")
    parser.add_argument("--request-timeout", type=float, help="seconds a request may take before it is stopped "
                                                               "(default: no limit)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ requests")
    parser.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="seconds running requests get to finish when the server is stopped (default 30)")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    try:
        import uvicorn
    except ImportError:
        raise UsageError("the server needs the serve extra: pip install -e .[serve]") from None
    server = make_server(args.model_dir, args.artifact, args.device, args.max_active_sequences, args.max_queue,
                         args.request_timeout, args.api_key, args.shutdown_grace, args.max_batch_tokens,
                         args.max_decoding_batch_tokens)
    print(f"serving {server.model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    for stop in (signal.SIGINT, signal.SIGTERM):  # uvicorn handles them while it runs and raises them again after
        signal.signal(stop, signal.SIG_IGN)  # its graceful stop: ignored then, so a stopped server exits 0
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=args.shutdown_grace)
    return 0


def make_server(model_dir, artifact=None, device: str = "cpu", max_active_sequences: int | None = None,
                max_queue: int = 256, request_timeout: float | None = None, api_key: str | None = None,
                shutdown_grace: float = 30.0, max_batch_tokens: int | None = None,
                max_decoding_batch_tokens: int | None = None):
    """The OpenAIServer for a built model (its app stops the engine loop when the ASGI server shuts down)."""
    from .engine import GenerationError
    from .openai_api import OpenAIServer
    from .pipeline import load_pipeline
    from .serving import ServingEngine

    pipeline = load_pipeline(model_dir, artifact, device)
    rows = pipeline.model.buckets.batch_rows[-1]
    active = max_active_sequences or rows
    if active > rows:
        raise GenerationError(f"--max-active-sequences {active} exceeds the artifact's largest --batch-rows {rows}; "
                              f"rebuild with --batch-rows 1,...,{active} or serve fewer at once")
    engine = ServingEngine(pipeline, active, max_queue, max_batch_tokens, max_decoding_batch_tokens)
    server = OpenAIServer(engine, Path(model_dir).resolve().name, api_key, request_timeout)

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.stop(shutdown_grace)

    server.app.router.lifespan_context = lifespan
    return server


if __name__ == "__main__":
    exit_cli(main)
