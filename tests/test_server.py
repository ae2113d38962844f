"""The OpenAI-compatible server on loopback, driven by the real `openai` client: every answer checked against the
pipeline run alone (greedy and seeded sampling), concurrency, disconnects, back-pressure, errors, failures."""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest

from compiler.build import build
from models.tiny import write_tiny_checkpoint
from runtime import GreedyGenerationConfig, SamplingConfig, SamplingGenerationConfig

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

ROWS = 8


class LiveServer:
    """A server from runtime.serve.make_server, run by uvicorn on a free loopback port in a thread."""

    def __init__(self, model_dir, artifact, **options):
        from runtime.serve import make_server

        self.server = make_server(model_dir, artifact, **options)
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.server.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        port = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=options.get("api_key") or "none",
                                    max_retries=0, timeout=120)
        self.model = self.server.model_name
        self.pipeline = self.server.pipeline

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics."""
        text = httpx.get(self.url + "/metrics").text
        line = next(line for line in text.splitlines() if line.startswith(f"{name}{labels} ") or
                    line.startswith(f"{name}{{{labels}}} "))
        return float(line.split()[-1])

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model_dir = write_tiny_checkpoint(root / "model", arch="qwen2", seed=2)
    artifact = build(model_dir, out=root / "artifact", prefill_buckets=(8, 16, 32), max_context=128,
                     batch_rows=(1, 4, ROWS), quiet=True).path
    return model_dir, artifact


@pytest.fixture(scope="module")
def live(built):
    server = LiveServer(*built, max_queue=64)
    yield server
    server.close()


def greedy_text(pipeline, prompt: str, tokens: int, **options):
    return pipeline.generate_text(prompt, GreedyGenerationConfig(tokens, **options))


def test_models_and_health(live):
    models = live.client.models.list()
    assert [m.id for m in models.data] == [live.model] and models.data[0].object == "model"
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}


def test_completion_equals_the_pipeline(live):
    r = live.client.completions.create(model=live.model, prompt="Hello world", max_tokens=12, temperature=0)
    want = greedy_text(live.pipeline, "Hello world", 12)
    assert r.choices[0].text == want.generated_text and r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == ("stop" if want.stopped_on_eos else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                  len(want.generated_token_ids))
    ids = live.pipeline.encode("Hello world")
    by_ids = live.client.completions.create(model=live.model, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == want.generated_text


def test_chat_uses_the_chat_template(live):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = live.client.chat.completions.create(model=live.model, messages=messages, max_tokens=10, temperature=0)
    prompt = live.pipeline.render_chat(messages)
    want = live.pipeline.generate_text(prompt, GreedyGenerationConfig(10), add_special_tokens=False)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.generated_text
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streaming_chat_deltas_add_up(live):
    messages = [{"role": "user", "content": "tell me a story"}]
    chunks = list(live.client.chat.completions.create(model=live.model, messages=messages, max_tokens=16,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    want = live.pipeline.generate_text(live.pipeline.render_chat(messages), GreedyGenerationConfig(16),
                                       add_special_tokens=False)
    assert text == want.generated_text and len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.generated_token_ids)


def test_stop_strings_end_the_reply_before_them(live):
    full = greedy_text(live.pipeline, "Once upon", 24, eos_token_ids=[]).generated_text
    stop = full[5:8]
    assert stop.strip()
    for stream in (False, True):
        r = live.client.completions.create(model=live.model, prompt="Once upon", max_tokens=24, temperature=0,
                                           stop=[stop], stream=stream)
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text == full[:full.index(stop)]


def test_seeded_sampling_equals_generate_text_sampled_and_n_choices(live):
    r = live.client.completions.create(model=live.model, prompt="The cat", max_tokens=12, temperature=0.8,
                                       top_p=0.9, seed=7, n=3, extra_body={"top_k": 20})
    for i, choice in enumerate(sorted(r.choices, key=lambda c: c.index)):
        config = SamplingGenerationConfig(12, sampling=SamplingConfig(0.8, 20, 0.9, 7 + i))
        assert choice.text == live.pipeline.generate_text_sampled("The cat", config).generated_text
    assert len({c.text for c in r.choices}) > 1


def test_logprobs(live):
    r = live.client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)
    for e in entries:  # greedy: the chosen token is the most likely one
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.logprob <= 0
    c = live.client.completions.create(model=live.model, prompt="hi", max_tokens=4, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == 4 and len(c.choices[0].logprobs.top_logprobs[0]) == 2


def test_concurrent_streams_equal_their_solo_runs(live):
    prompts = [f"prompt number {i} says" for i in range(32)]
    results: dict[int, str] = {}

    def run(i):
        stream = live.client.completions.create(model=live.model, prompt=prompts[i], max_tokens=10, temperature=0,
                                                stream=True)
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        assert results[i] == greedy_text(live.pipeline, prompt, 10).generated_text
    assert live.server.engine.executor.scheduler.stats.batches > 0


def test_a_disconnect_mid_stream_frees_its_pages(live):
    engine = live.server.engine
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "model": live.model, "prompt": "a long story", "max_tokens": 100, "temperature": 0,
            "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # the first text arrived: hang up
    deadline = time.monotonic() + 20
    while engine.running or engine.pages_in_use:
        assert time.monotonic() < deadline, "the disconnected request kept running"
        time.sleep(0.05)
    assert live.metric("ruda_requests_total", 'outcome="abort"') >= 1
    assert live.metric("ruda_kv_pages_in_use") == 0


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("payload,status,param", [
    ({"prompt": "x"}, 400, "model"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x " * 200}, 400, "prompt"),
])
def test_bad_completion_requests(live, payload, status, param):
    body = payload if param == "model" else {"model": live.model, **payload}
    response = httpx.post(live.url + "/v1/completions", json=body)
    assert response.status_code == status
    assert error_of(response)["param"] == param


def test_bad_json_and_bad_messages(live):
    response = httpx.post(live.url + "/v1/chat/completions", content=b"{not json")
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_json"
    response = httpx.post(live.url + "/v1/chat/completions", json={"model": live.model, "messages": []})
    assert response.status_code == 400 and error_of(response)["param"] == "messages"
    response = httpx.post(live.url + "/v1/chat/completions",
                          json={"model": live.model, "messages": [{"role": "robot", "content": "hi"}]})
    assert response.status_code == 400 and error_of(response)["param"] == "messages"


def test_api_key(built):
    server = LiveServer(*built, api_key="secret")
    try:
        assert server.client.models.list().data[0].id == server.model
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.get(server.url + "/v1/models", headers=headers)
            assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
    finally:
        server.close()


def test_a_full_queue_answers_429(built):
    server = LiveServer(*built, max_active_sequences=1, max_queue=1)
    try:
        statuses = []

        def run(i):
            response = httpx.post(server.url + "/v1/completions", json={
                "model": server.model, "prompt": f"busy {i}", "max_tokens": 40, "temperature": 0}, timeout=120)
            statuses.append((response.status_code, response.headers.get("retry-after")))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert (429, "1") in statuses and (200, None) in statuses
        assert server.metric("ruda_requests_total", 'outcome="rejected"') >= 1
    finally:
        server.close()


def test_a_failing_step_fails_only_its_request(built):
    server = LiveServer(*built, max_queue=16)
    model = server.pipeline.model
    poison = server.pipeline.encode(" poison")[0]
    real_step = model.step

    def step(rows, cache, logits=True):
        if any(poison in row[0] for row in rows):
            raise RuntimeError("injected device failure")
        return real_step(rows, cache, logits)

    model.step = step
    try:
        response = httpx.post(server.url + "/v1/completions", json={
            "model": server.model, "prompt": [5, 6, poison], "max_tokens": 5, "temperature": 0}, timeout=120)
        assert response.status_code == 500 and "injected device failure" in error_of(response)["message"]
        ok = server.client.completions.create(model=server.model, prompt="still here", max_tokens=6, temperature=0)
        assert ok.choices[0].text == greedy_text(server.pipeline, "still here", 6).generated_text
    finally:
        server.close()


def test_usage_counts_are_exact(live):
    r = live.client.completions.create(model=live.model, prompt="count me", max_tokens=7, temperature=0)
    ids = live.pipeline.encode("count me")
    assert r.usage.prompt_tokens == len(ids) and r.usage.total_tokens == len(ids) + r.usage.completion_tokens
    assert np.isfinite(live.metric("ruda_prompt_tokens_total"))


def test_serve_cli_finishes_running_requests_on_sigterm_and_exits_0(built):
    import signal
    import socket
    import subprocess
    import sys

    from test_cli import ROOT

    model_dir, artifact = built
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", str(model_dir), "--artifact", str(artifact),
                             "--port", str(port), "--shutdown-grace", "30"], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
                time.sleep(0.2)
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json={
                "model": model_dir.name, "prompt": "a story", "max_tokens": 60, "temperature": 0, "stream": True,
                "stop": None}, timeout=60) as response:
            for line in filter(None, response.iter_lines()):
                if not lines:
                    proc.send_signal(signal.SIGTERM)  # mid-stream: the reply still finishes
                lines.append(line)
        assert lines[-1] == "data: [DONE]"
        finals = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines if x.startswith("data: {")]
        assert finals[-1] in ("stop", "length") and "error" not in lines[-2]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_serve_cli_builds_nothing(tmp_path):
    from test_cli import run

    model_dir = write_tiny_checkpoint(tmp_path / "model", arch="qwen2")
    result = run("runtime.serve", str(model_dir), cwd=tmp_path)
    assert result.returncode == 5 and "python -m compiler build" in result.stderr


def test_a_request_past_the_timeout_is_stopped_with_504(built):
    server = LiveServer(*built, request_timeout=0.005)  # 100 tokens take 30 ms on a fast host: 6x that
    try:
        response = httpx.post(server.url + "/v1/completions", json={
            "model": server.model, "prompt": "slow", "max_tokens": 100, "temperature": 0}, timeout=60)
        assert response.status_code == 504 and error_of(response)["code"] == "request_timeout"
        deadline = time.monotonic() + 20
        while server.server.engine.running:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.close()


def test_the_step_budget_splits_prompts_into_smaller_steps(built):
    server = LiveServer(*built, max_batch_tokens=8)
    try:
        prompt = "a prompt of more than eight tokens, surely, by a margin"
        assert len(server.pipeline.encode(prompt)) > 16
        r = server.client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0)
        assert r.choices[0].text == greedy_text(server.pipeline, prompt, 4).generated_text
        assert server.server.engine.executor.scheduler.stats.batches >= 3 + 3  # 8-token prefill steps, then decodes
    finally:
        server.close()
