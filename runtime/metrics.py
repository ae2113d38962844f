"""The server's Prometheus metrics: requests by outcome, tokens, queue and batch state, latency histograms."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """Counters and histograms the request handlers update; `render(engine)` is the /metrics page."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ruda_requests", "Requests by outcome: a finish reason (stop, length, abort, "
                                "error) or a refusal (invalid, rejected: queue full, unauthorized)", ["outcome"],
                                registry=r)
        self.prompt_tokens = Counter("ruda_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("ruda_generation_tokens", "Generated tokens", registry=r)
        self.queue_depth = Gauge("ruda_queue_depth", "Requests waiting to start", registry=r)
        self.running = Gauge("ruda_running_sequences", "Requests in the running batch", registry=r)
        self.kv_pages = Gauge("ruda_kv_pages_in_use", "KV pages held by unfinished requests", registry=r)
        self.ttft = Histogram("ruda_time_to_first_token_seconds", "From submission to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ruda_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)

    def first_token(self, seconds: float) -> None:
        """A request's first token came `seconds` after it was submitted."""
        self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        """A request's next token came `seconds` after its previous one."""
        self.itl.observe(seconds)

    def finished(self, prompt_tokens: int, generated_tokens: int, finish_reason: str) -> None:
        """A request ended: its tokens, and its outcome (eos and stop strings count as stop)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated_tokens)
        self.requests.labels(outcome="stop" if finish_reason in ("eos", "stop_string") else finish_reason).inc()

    def refused(self, outcome: str) -> None:
        """A request answered with an error before it ran."""
        self.requests.labels(outcome=outcome).inc()

    def render(self, engine) -> bytes:
        """The metrics in the Prometheus text format, the engine's queue and batch state read now."""
        self.queue_depth.set(engine.queued)
        self.running.set(engine.running)
        self.kv_pages.set(engine.pages_in_use)
        return generate_latest(self.registry)
