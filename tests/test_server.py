"""``specdraft serve``: a live server on loopback, driven with the official ``openai`` client.

Servers run in-process (uvicorn in a background thread, on a free port) with the tiny
random target, so tests can reach the scheduler: slow its steps down to hold requests in
flight, read its counters, trigger the SIGTERM drain. One test runs the real command in a
subprocess and sends it a real SIGTERM; one uses the real SmolLM2 target for a chat.

Expected outputs come from the engine itself (plain autoregressive decoding), so every
greedy response is checked token for token, whatever the batch it was decoded in.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from urllib.parse import urlparse

import pytest

import openai  # the official client: tests speak to the server exactly as users do
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specdraft.drafters.registry import build_drafter  # noqa: E402
from specdraft.engine import SpeculativeEngine  # noqa: E402
from specdraft.drafters import NoDrafter  # noqa: E402
from specdraft.models import load_target  # noqa: E402
from specdraft.sampling import SamplingParams  # noqa: E402
from specdraft.server import ServeOptions, create_app  # noqa: E402
from specdraft.server.runner import listen, make_server, url_of  # noqa: E402

API_KEY = "test-key"
MODEL = "tiny"
# The tiny tokenizer is word-level (t0..t15, t0 = EOS): a template joining the messages'
# contents and ending with t2 as the "assistant turn" marker.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t2{% endif %}"


# ---- a live server ----------------------------------------------------------------------------


@dataclass
class Live:
    url: str
    server: object  # runner.DrainingServer
    thread: threading.Thread

    @property
    def service(self):
        return self.server.service

    def client(self, key: str | None = API_KEY, timeout: float = 30.0):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=timeout)


@contextmanager
def live_server(target, drafter: str = "lookup", shutdown_timeout: float = 10.0, **options):
    """A server for ``target`` on 127.0.0.1:<free port>, stopped on exit."""
    engine = SpeculativeEngine(target, build_drafter(drafter, target))
    app = create_app(engine, ServeOptions(model_name=options.pop("model_name", MODEL),
                                          api_key=options.pop("api_key", API_KEY), **options))
    sock = listen("127.0.0.1", 0)
    server = make_server(app, sock, shutdown_timeout=shutdown_timeout, log_level="warning", access_log=False)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 20, "server start")
    try:
        yield Live(url_of(sock), server, thread)
    finally:
        server.should_exit = True
        thread.join(20)


def tiny_with_template(path):
    target = load_target(str(path))
    target.tokenizer.chat_template = CHAT_TEMPLATE
    return target


@pytest.fixture(scope="module")
def live(tiny_target_path):
    with live_server(tiny_with_template(tiny_target_path), max_batch_size=8, max_queue=64,
                     request_timeout=60) as srv:
        yield srv


@pytest.fixture
def slow_live(tiny_target_path, monkeypatch):
    """Starts a server with one batch row, one queue slot, no drafter, and 50 ms steps (so
    that requests stay in flight long enough to be observed); options override."""
    with ExitStack() as stack:

        def start(**options):
            target = tiny_with_template(tiny_target_path)
            srv = stack.enter_context(live_server(target, drafter="none",
                                                  **{"max_batch_size": 1, "max_queue": 1, **options}))
            step = srv.service.engine.step

            def slow_step(batch):
                time.sleep(0.05)
                return step(batch)

            monkeypatch.setattr(srv.service.engine, "step", slow_step)
            return srv

        yield start


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---- helpers --------------------------------------------------------------------------------


def reference(target, ids: list[int], max_tokens: int, **params):
    """The target's own greedy (or seeded) output, decoded alone."""
    engine = SpeculativeEngine(target, NoDrafter())
    return engine.generate([ids], SamplingParams(max_new_tokens=max_tokens, **params))[0]


def random_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(2, 16)}" for _ in range(rng.randrange(2, 10))) for _ in range(n)]


def raw(url: str, method: str, path: str, body=None, key: str | None = API_KEY) -> tuple[int, dict]:
    """One HTTP request without the openai client (for bodies it would never send)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, data, headers)
        resp = conn.getresponse()
        payload = resp.read()
        return resp.status, (json.loads(payload) if payload else {})
    finally:
        conn.close()


def metrics(url: str) -> dict[tuple, float]:
    """/metrics as {(sample name, sorted label items): value}."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(snapshot: dict, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def assert_healthy(url: str) -> None:
    status, body = raw(url, "GET", "/health")
    assert status == 200 and body["status"] == "ok", body


def tiny_ids(target, text: str) -> list[int]:
    return target.encode_prompt(text, chat=False)


# ---- completions and chat ----------------------------------------------------------------------


def test_completion_greedy_matches_the_target(live, tiny_target):
    prompt = "t7 t13 t15 t3"
    want = reference(tiny_target, tiny_ids(tiny_target, prompt), 12)
    out = live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.object == "text_completion" and out.model == MODEL
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (want.prompt_tokens, want.new_tokens)
    assert out.usage.total_tokens == want.prompt_tokens + want.new_tokens


def test_completion_stream_with_usage(live, tiny_target):
    prompt = "t15 t12 t7"
    want = reference(tiny_target, tiny_ids(tiny_target, prompt), 20, ignore_eos=True)
    stream = live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == want.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_token_id_prompt(live, tiny_target):
    ids = [3, 9, 4, 4, 11]
    out = live.client().completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == reference(tiny_target, ids, 8).text


def chat_reference(tiny_target, messages, max_tokens):
    text = " ".join(m["content"] for m in messages) + " t2"
    return reference(tiny_target, tiny_ids(tiny_target, text), max_tokens)


def test_chat_completion(live, tiny_target):
    messages = [{"role": "system", "content": "t5"}, {"role": "user", "content": "t3 t4 t9"}]
    want = chat_reference(tiny_target, messages, 10)
    out = live.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (want.prompt_tokens, want.new_tokens)


def test_chat_stream(live, tiny_target):
    messages = [{"role": "user", "content": [{"type": "text", "text": "t6 t6 t8"}]}]
    want = chat_reference(tiny_target, [{"role": "user", "content": "t6 t6 t8"}], 16)
    chunks = list(live.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.total_tokens == want.prompt_tokens + want.new_tokens


def test_stop_strings_streamed_and_not(live, tiny_target):
    prompt = "t15 t12 t7"
    full = reference(tiny_target, tiny_ids(tiny_target, prompt), 20, ignore_eos=True)
    stop = full.text.split()[3]  # the fourth generated word
    want = reference(tiny_target, tiny_ids(tiny_target, prompt), 20, ignore_eos=True, stop=[stop, "t99"])
    client = live.client()
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop, "t99"],
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert out.choices[0].text == want.text and stop not in want.text
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == want.text


def test_seeded_sampling_is_reproducible(live):
    client = live.client()
    kwargs = dict(model=MODEL, prompt="t3 t5 t7", max_tokens=16, temperature=0.9, top_p=0.95, seed=1234,
                  extra_body={"top_k": 8, "ignore_eos": True})
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: client.completions.create(**kwargs), range(3)))
    assert len({o.choices[0].text for o in outs}) == 1
    assert all(o.usage.completion_tokens == 16 for o in outs)


def test_models_and_health(live):
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert_healthy(live.url)


# ---- bad requests ---------------------------------------------------------------------------

GOOD = {"model": MODEL, "prompt": "t3 t4", "max_tokens": 4}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "t3"}], "max_tokens": 4}

BAD = [  # (path, body, status, param, words in the message)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None, "JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "object"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "messages"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "t3"}]}, 400,
     "messages[0].role", "role"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content", "text parts"),
    ("/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "model", "gpt-9"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "> 0"),
    ("/v1/completions", {**GOOD, "max_tokens": -3}, 400, "max_tokens", "> 0"),
    ("/v1/chat/completions", {**GOOD_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", "> 0"),
    ("/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {**GOOD, "max_tokens": 500}, 400, "max_tokens", "context"),
    ("/v1/completions", {**GOOD, "temperature": 2.5}, 400, "temperature", "[0, 2]"),
    ("/v1/completions", {**GOOD, "temperature": -0.1}, 400, "temperature", "[0, 2]"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {**GOOD, "top_k": -1}, 400, "top_k", ">= 0"),
    ("/v1/completions", {**GOOD, "prompt": "t3 " * 200}, 400, "prompt", "context"),
    ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": "t3 " * 200}]}, 400,
     "messages", "context"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {**GOOD, "prompt": ["t3", "t4"]}, 400, "prompt", "several prompts"),
    ("/v1/completions", {**GOOD, "prompt": [3, 99]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {**GOOD, "n": 2}, 400, "n", "n > 1"),
    ("/v1/completions", {**GOOD, "logprobs": 2}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {**GOOD, "echo": True}, 400, "echo", "echo"),
    ("/v1/chat/completions", {**GOOD_CHAT, "logprobs": True}, 400, "logprobs", "logprobs"),
    ("/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools", "tools"),
    ("/v1/chat/completions", {**GOOD_CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format", "response_format"),
    ("/v1/completions", {**GOOD, "stop": 7}, 400, "stop", "stop"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "stop", "non-empty"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream", "true or false"),
    ("/v1/completions", {**GOOD, "seed": 1.5}, 400, "seed", "integer"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_an_openai_error(live, path, body, status, param, words):
    got, payload = raw(live.url, "POST", path, body)
    assert got == status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"], err["message"]


def test_errors_through_the_openai_client_and_server_keeps_serving(live, tiny_target):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="t3", max_tokens=4, n=2)
    assert e.value.status_code == 400 and "n > 1" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "t3"}])
    for path, method in (("/v1/nothing", "GET"), ("/v1/completions", "GET")):
        status, payload = raw(live.url, method, path)
        assert status in (404, 405) and "message" in payload["error"]
    assert_healthy(live.url)
    out = client.completions.create(model=MODEL, prompt="t7 t13", max_tokens=6, temperature=0)
    assert out.choices[0].text == reference(tiny_target, tiny_ids(tiny_target, "t7 t13"), 6).text


def test_api_key_is_required(live):
    with pytest.raises(openai.AuthenticationError) as e:
        live.client(key="wrong").completions.create(model=MODEL, prompt="t3", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    status, payload = raw(live.url, "POST", "/v1/completions", GOOD, key=None)
    assert status == 401 and payload["error"]["code"] == "invalid_api_key"
    assert raw(live.url, "GET", "/v1/models", key=None)[0] == 401
    assert_healthy(live.url)  # /health and /metrics stay open for probes and scrapers


# ---- continuous batching --------------------------------------------------------------------


def test_concurrent_greedy_requests_match_alone(live, tiny_target):
    prompts = random_prompts(12, seed=1)
    client = live.client()

    def ask(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6 + i, temperature=0,
                                         extra_body={"ignore_eos": i % 2 == 0}).choices[0].text

    alone = [ask(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, range(len(prompts))))
    assert together == alone
    for i, p in enumerate(prompts):
        assert alone[i] == reference(tiny_target, tiny_ids(tiny_target, p), 6 + i, ignore_eos=i % 2 == 0).text


def test_queue_full_gets_429(slow_live):
    srv = slow_live()
    client = srv.client()
    running = client.completions.create(model=MODEL, prompt="t3 t4", max_tokens=100, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(running))  # admitted: the only batch row is taken
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(client.completions.create, model=MODEL, prompt="t5", max_tokens=3, temperature=0)
        wait_for(lambda: srv.service.scheduler.waiting == 1, 10, "a queued request")
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="t6", max_tokens=3)
        assert e.value.status_code == 429 and e.value.code == "queue_full"
        assert e.value.response.headers.get("retry-after") == "1"
        running.close()  # frees the row for the queued request
        assert queued.result(timeout=20).choices[0].text
    assert_healthy(srv.url)
    snap = metrics(srv.url)
    assert metric(snap, "specdraft_requests_total", endpoint="completions", status="429") == 1


def test_disconnected_stream_is_cancelled(slow_live):
    srv = slow_live()
    before = metrics(srv.url)
    stream = srv.client().completions.create(model=MODEL, prompt="t3 t4", max_tokens=100, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    stream.close()
    wait_for(lambda: srv.service.scheduler.running == 0, 5, "the row to leave the batch")
    after = metrics(srv.url)
    assert metric(after, "specdraft_request_endings_total", reason="cancelled") == 1
    generated = metric(after, "specdraft_generated_tokens_total") - metric(before, "specdraft_generated_tokens_total")
    assert 2 <= generated < 100


def test_disconnected_waiting_client_is_cancelled(slow_live):
    srv = slow_live()
    u = urlparse(srv.url)
    sock = socket.create_connection((u.hostname, u.port))
    body = json.dumps({"model": MODEL, "prompt": "t3", "max_tokens": 100, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    wait_for(lambda: srv.service.scheduler.running == 1, 5, "admission")
    sock.close()
    wait_for(lambda: srv.service.scheduler.running == 0, 5, "the row to leave the batch")
    assert metric(metrics(srv.url), "specdraft_request_endings_total", reason="cancelled") == 1


def test_request_timeout(slow_live):
    srv = slow_live(request_timeout=0.4)
    client = srv.client()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="t3", max_tokens=100, extra_body={"ignore_eos": True})
    assert e.value.status_code == 408 and e.value.code == "request_timeout"
    stream = client.completions.create(model=MODEL, prompt="t3", max_tokens=100, stream=True,
                                       extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError, match="timed out"):
        for _ in stream:  # the timeout arrives as an error event after the first tokens
            pass
    wait_for(lambda: srv.service.scheduler.running == 0, 5, "the row to leave the batch")
    assert metric(metrics(srv.url), "specdraft_request_endings_total", reason="timeout") == 2
    assert_healthy(srv.url)


def test_drain_on_sigterm_finishes_running_requests(slow_live):
    srv = slow_live(max_batch_size=2)
    client = srv.client()
    stream = client.completions.create(model=MODEL, prompt="t3 t4", max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    srv.server.handle_exit(signal.SIGTERM, None)  # what the signal handler runs
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="t5", max_tokens=2)
    assert e.value.status_code == 503
    assert raw(srv.url, "GET", "/health")[0] == 503
    rest = list(it)
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert rest[-1].usage.completion_tokens == 20
    srv.thread.join(10)
    assert not srv.thread.is_alive()


def test_engine_failure_is_a_500_and_serving_goes_on(slow_live, monkeypatch):
    srv = slow_live()
    step, calls = srv.service.engine.step, []

    def fails_once(batch):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated engine failure")
        return step(batch)

    monkeypatch.setattr(srv.service.engine, "step", fails_once)
    client = srv.client()
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="t3", max_tokens=5, extra_body={"ignore_eos": True})
    assert e.value.status_code == 500 and e.value.code == "engine_error"
    out = client.completions.create(model=MODEL, prompt="t3", max_tokens=5, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    assert_healthy(srv.url)


# ---- load ---------------------------------------------------------------------------------


def test_bounded_load(live, tiny_target):
    """200 requests, 16 at a time, a quarter streamed: every response is its own prompt's."""
    prompts = random_prompts(40, seed=2)
    jobs = [(i % 40, 4 + (i * 7) % 13, i % 4 == 0) for i in range(200)]  # prompt, max_tokens, stream
    engine = SpeculativeEngine(tiny_target, NoDrafter())
    want = {}
    for p, n, _ in jobs:
        if (p, n) not in want:
            want[(p, n)] = engine.generate([tiny_ids(tiny_target, prompts[p])], SamplingParams(max_new_tokens=n))[0]
    client = live.client(timeout=60)
    before = metrics(live.url)

    def run(job):
        p, n, stream = job
        if not stream:
            out = client.completions.create(model=MODEL, prompt=prompts[p], max_tokens=n, temperature=0)
            return out.choices[0].text, out.usage.completion_tokens
        chunks = list(client.completions.create(model=MODEL, prompt=prompts[p], max_tokens=n, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs, timeout=120))
    assert time.monotonic() - start < 120
    assert len(results) == len(jobs)
    for (p, n, _), (text, tokens) in zip(jobs, results):
        assert (text, tokens) == (want[(p, n)].text, want[(p, n)].new_tokens)
    assert_healthy(live.url)
    after = metrics(live.url)
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    assert delta("specdraft_requests_total", endpoint="completions", status="200") == 200
    assert sum(delta("specdraft_requests_total", endpoint="completions", status=s) for s in ("400", "429", "500")) == 0
    assert delta("specdraft_generated_tokens_total") == sum(t for _, t in results)
    assert delta("specdraft_request_endings_total", reason="finished") == 200
    assert delta("specdraft_request_latency_seconds_count", endpoint="completions") == 200
    assert delta("specdraft_time_to_first_token_seconds_count") == 200
    assert delta("specdraft_tokens_per_step_count") == 200
    assert metric(after, "specdraft_queue_depth") == 0 and metric(after, "specdraft_running_requests") == 0


# ---- the command ------------------------------------------------------------------------------


def serve_command() -> list[str]:
    return [sys.executable, "-m", "specdraft", "serve"]


def test_bad_option_is_one_error_line(capsys):
    from specdraft.cli import main

    assert main(["serve", "--max-batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-batch-size" in err[0]


def announced_url(proc) -> str:
    """The address from "specdraft: serving NAME (drafter D, DTYPE, linear LAYOUT) on
    http://127.0.0.1:PORT" (the dtype and few-row layout tell a slow server's cause)."""
    seen = []
    for line in proc.stderr:
        if line.startswith("specdraft: serving "):
            assert ", float32, linear " in line or ", bfloat16, linear " in line, line
            return line.rsplit(" on ", 1)[1].strip()
        seen.append(line)
    raise AssertionError("the server did not start:\n" + "".join(seen))


def test_serve_command_drains_on_sigterm(tiny_target_path):
    cmd = serve_command() + ["--target", str(tiny_target_path), "--drafter", "none", "--port", "0",
                             "--max-batch-size", "2", "--model-name", "tiny", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = announced_url(proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        stream = client.completions.create(model="tiny", prompt="t3 t4", max_tokens=100, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        proc.send_signal(signal.SIGTERM)
        rest = list(it)
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_smollm2_chat(smol):
    question = "What is the capital of France?"
    want = reference(smol, smol.encode_prompt(question, chat=True), 8)
    with live_server(smol, model_name="SmolLM2-135M-Instruct", api_key=None) as srv:
        out = srv.client().chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": question}])
    assert out.choices[0].message.content == want.text
    assert out.usage.completion_tokens == want.new_tokens


def test_the_engine_is_loaded_on_a_thread_that_ends():
    """``serve`` loads its engine through ``in_passing_thread``: the value comes back, an
    error is raised on the caller's thread as itself (the CLI's one-line errors), and the
    thread that did the work is gone (with it its OpenMP pool, which would slow the
    scheduler thread's forwards: runner.in_passing_thread)."""
    from specdraft.errors import SpecdraftError
    from specdraft.server.runner import in_passing_thread

    seen = []

    def work(x):
        seen.append(threading.current_thread())
        return x + 1

    assert in_passing_thread(work, 41) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def broken():
        raise SpecdraftError("no such model")

    with pytest.raises(SpecdraftError, match="no such model"):
        in_passing_thread(broken)
