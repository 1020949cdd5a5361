"""``specdraft serve`` against an unfriendly client (issue 17): one regression test per
failure found, property-based tests (hypothesis) that throw generated bodies at every
endpoint, and a memory bound over 200 mixed requests.

Invariants checked: no request gets a 5xx unless the engine failed; every error has
OpenAI's shape; limits hold while reading (the body is never buffered past the limit);
tokenizing runs off the event loop; a second SIGTERM ends streams with an error event and
``[DONE]`` and the process exits cleanly. Servers run on 127.0.0.1 with the tiny target.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from urllib.parse import urlparse

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_llama
from test_server import (API_KEY, MODEL, announced_url, assert_healthy, live_server, serve_command,
                         tiny_with_template, wait_for)

from specdraft.server.protocol import APIError, parse_request

MiB = 1 << 20


@pytest.fixture(scope="module")
def srv(tiny_target_path):
    with live_server(tiny_with_template(tiny_target_path), max_batch_size=4, max_queue=64,
                     request_timeout=60) as s:
        yield s


class Conn:
    """One keep-alive HTTP connection (http.client), so tests can tell whether the server
    kept it open after an error."""

    def __init__(self, url: str):
        u = urlparse(url)
        self.http = http.client.HTTPConnection(u.hostname, u.port, timeout=30)

    def request(self, method: str, path: str, body: bytes | None = None, key: str | None = API_KEY):
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.http.request(method, path, body, headers)
        resp = self.http.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()

    def close(self):
        self.http.close()


def request(url: str, method: str, path: str, body: bytes | None = None):
    conn = Conn(url)
    try:
        return conn.request(method, path, body)
    finally:
        conn.close()


def assert_openai_error(status: int, payload: bytes, code: str | None = None) -> dict:
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def no_tracebacks(caplog) -> None:
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


# ---- regressions ------------------------------------------------------------------------------


def test_deeply_nested_json_is_a_400_and_the_connection_stays(srv, caplog):
    caplog.set_level(logging.WARNING)
    conn = Conn(srv.url)
    try:
        for depth in (201, 100_000):
            body = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
            status, _, payload = conn.request("POST", "/v1/completions", body)
            assert status == 400
            assert "nests deeper" in assert_openai_error(status, payload, "invalid_json")["message"]
        status, _, _ = conn.request("GET", "/health")  # same connection: not reset
        assert status == 200
    finally:
        conn.close()
    no_tracebacks(caplog)


def test_nesting_within_the_limit_is_parsed(srv):
    body = json.dumps({"model": MODEL, "prompt": "t3", "max_tokens": 2, "metadata": [[[[[]]]]] * 3}).encode()
    status, _, payload = request(srv.url, "POST", "/v1/completions", body)
    assert status == 200, payload


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "t3 \\ud800 t4"}'),
    ("/v1/completions", b'{"prompt": "t3 \\udc00"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "t3 \\ud800"}]}'),
    ("/v1/completions", b'{"prompt": "t3 \xed\xa0\x80"}'),  # a surrogate sent as (invalid) UTF-8
])
def test_lone_surrogates_are_a_400(srv, path, body):
    status, _, payload = request(srv.url, "POST", path, body)
    assert status == 400
    assert_openai_error(status, payload, "invalid_json")


def test_protocol_rejects_invalid_unicode_however_it_arrives():
    for body, param in (({"prompt": "t3 \ud800"}, "prompt"),
                        ({"messages": [{"role": "user", "content": "\udc00"}]}, "messages[0].content"),
                        ({"prompt": "t3", "stop": ["\ud800"]}, "stop")):
        endpoint = "chat" if "messages" in body else "completions"
        with pytest.raises(APIError) as e:
            parse_request(body, endpoint, MODEL)
        assert e.value.status == 400 and e.value.param == param and "Unicode" in e.value.message


def test_error_messages_quote_values_briefly():
    with pytest.raises(APIError) as e:
        parse_request({"prompt": "t3", "max_tokens": "x" * 1_000_000}, "completions", MODEL)
    assert len(e.value.message) < 200
    with pytest.raises(APIError) as e:  # an integer too large for a float is still a 400
        parse_request({"prompt": "t3", "temperature": 10**400}, "completions", MODEL)
    assert e.value.status == 400 and e.value.param == "temperature"


def chunked_oversize_body(srv, total: int) -> tuple[bytes, int]:
    """POST a chunked body of ``total`` bytes (generated, never held whole); returns the
    response's first bytes and how many bytes were sent before the server closed."""
    u = urlparse(srv.url)
    sock = socket.create_connection((u.hostname, u.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk, sent = b" " * MiB, [0]

    def send():
        try:
            while sent[0] < total:
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                sent[0] += len(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server closed after its 413: the rest is never read
            pass

    sender = threading.Thread(target=send)
    sender.start()
    sock.settimeout(30)
    try:
        head = sock.recv(4096)
    finally:
        sender.join(60)
        sock.close()
    return head, sent[0]


def test_chunked_body_over_the_limit_is_refused_while_streaming(srv):
    proc = psutil.Process()
    chunked_oversize_body(srv, 8 * MiB)  # warm-up: first-use allocations are not the body's
    before = proc.memory_info().rss
    head, sent = chunked_oversize_body(srv, 200 * MiB)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert sent < 100 * MiB  # the server stopped reading long before the end
    assert proc.memory_info().rss - before < 50 * MiB
    assert_healthy(srv.url)


def test_declared_body_over_the_limit_is_refused_before_reading(srv):
    u = urlparse(srv.url)
    sock = socket.create_connection((u.hostname, u.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                 + b"\r\nContent-Length: 209715200\r\n\r\n{")
    sock.settimeout(10)
    assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    sock.close()


def test_prompt_too_long_for_the_context_is_refused_before_tokenizing(srv, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the tokenizer ran")

    monkeypatch.setattr(srv.service.target, "encode_prompt", must_not_run)
    started = time.monotonic()
    for path, body in (("/v1/completions", {"prompt": "t3 " * 1_300_000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t3 " * 1_300_000}]})):
        status, _, payload = request(srv.url, "POST", path, json.dumps(body).encode())
        assert status == 400
        assert_openai_error(status, payload, "context_length_exceeded")
    assert time.monotonic() - started < 5


def test_tokenizing_runs_off_the_event_loop(srv, monkeypatch):
    """While a (slow) tokenization runs, /health answers at once."""
    encode, inside = srv.service.target.encode_prompt, threading.Event()

    def slow_encode(*args, **kwargs):
        inside.set()
        time.sleep(1.5)
        return encode(*args, **kwargs)

    monkeypatch.setattr(srv.service.target, "encode_prompt", slow_encode)
    body = json.dumps({"model": MODEL, "prompt": "t3 t4", "max_tokens": 2}).encode()
    with_slow = threading.Thread(target=request, args=(srv.url, "POST", "/v1/completions", body))
    with_slow.start()
    assert inside.wait(10)
    started = time.monotonic()
    status, _, _ = request(srv.url, "GET", "/health")
    assert status == 200 and time.monotonic() - started < 0.5
    with_slow.join(20)


def test_405_carries_an_allow_header(srv):
    for method, path, allowed in (("GET", "/v1/completions", "POST"), ("POST", "/health", "GET"),
                                  ("DELETE", "/v1/models", "GET")):
        status, headers, payload = request(srv.url, method, path)
        assert status == 405 and allowed in headers.get("allow", ""), headers
        assert_openai_error(status, payload)


def test_unexpected_error_is_one_500_without_traceback_and_the_connection_stays(srv, monkeypatch, caplog):
    caplog.set_level(logging.ERROR)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug with a secret path /home/x")

    monkeypatch.setattr(srv.service.scheduler, "submit", broken)
    conn = Conn(srv.url)
    try:
        body = json.dumps({"model": MODEL, "prompt": "t3", "max_tokens": 2}).encode()
        status, _, payload = conn.request("POST", "/v1/completions", body)
        assert status == 500
        err = assert_openai_error(status, payload)
        assert err["type"] == "server_error" and "RuntimeError" in err["message"] and "/home" not in err["message"]
        assert conn.request("GET", "/health")[0] == 200  # same connection
    finally:
        conn.close()
    assert len([r for r in caplog.records if r.exc_info]) == 1  # logged once, not twice


def read_sse(resp) -> list[str]:
    """The data lines of an SSE response, read until the server ends it."""
    lines = []
    while line := resp.fp.readline():
        if line.startswith(b"data: "):
            lines.append(line[6:].strip().decode())
    return lines


def test_second_sigterm_ends_streams_with_an_error_event_and_exits_cleanly(tmp_path):
    target = make_tiny_llama(tmp_path / "long-context", max_position_embeddings=4096)
    cmd = serve_command() + ["--target", str(target), "--drafter", "none", "--port", "0", "--model-name", "tiny",
                             "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        u = urlparse(announced_url(proc))
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "t3 t4", "max_tokens": 4000,
                                                            "stream": True, "ignore_eos": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.fp.readline()  # the stream is running
        proc.send_signal(signal.SIGTERM)  # drain: the stream would go on
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)  # now: end it
        events = read_sse(resp)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        assert proc.wait(30) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        err = proc.stderr.read()
        assert "Traceback" not in err and "terminate called" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- property-based: generated bodies at every endpoint ------------------------------------------

ANY_CHAR = st.characters(codec=None, categories=None, exclude_categories=[]) | st.characters(categories=["Cs"])
TEXT = st.text(ANY_CHAR, max_size=12) | st.sampled_from(["t3 t4", "", "\x00", "t2 " * 50])
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSONISH = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                       max_leaves=12)
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | JSONISH,
    "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2) | JSONISH})
FIELDS = {  # a plausible value (so requests get past the first check) or anything at all
    "model": st.just(MODEL), "prompt": st.sampled_from(["t3 t4", [3, 4, 5]]) | TEXT,
    "messages": st.lists(MESSAGE, max_size=3), "max_tokens": st.integers(-2, 6),
    "max_completion_tokens": st.integers(-1, 6), "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-1, 20), "seed": st.integers(), "stop": TEXT | st.lists(TEXT, max_size=3),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "stream_options": st.just({"include_usage": True}),
    "n": st.integers(0, 3), "logprobs": st.booleans(), "echo": st.booleans(), "tools": st.just([]),
    "response_format": st.just({"type": "text"}), "user": TEXT,
}
OBJECT = st.fixed_dictionaries({}, optional={name: value | JSONISH for name, value in FIELDS.items()})


def encoded(body, raw_utf8: bool) -> bytes:
    """JSON text: surrogates escaped (\\udXXX), or written as (invalid) UTF-8 bytes."""
    if raw_utf8:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(body).encode()


BODY = st.one_of(
    st.builds(encoded, OBJECT, st.booleans()),
    st.builds(encoded, JSONISH, st.booleans()),
    st.integers(150, 5000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(150, 5000).map(lambda d: b'{"prompt": ' + b'{"a": ' * d + b"1" + b"}" * d + b"}"),
    st.binary(max_size=64),
    st.none(),
)
ROUTE = st.sampled_from([("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                         ("GET", "/health"), ("GET", "/metrics"), ("POST", "/health"), ("GET", "/v1/completions"),
                         ("PUT", "/v1/chat/completions"), ("POST", "/v1/unknown")])


@settings(max_examples=int(os.environ.get("SPECDRAFT_HUNT_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=ROUTE, body=BODY)
def test_generated_bodies_never_get_a_5xx(srv, route, body):
    method, path = route
    status, headers, payload = request(srv.url, method, path, body)
    assert status < 500, (status, payload[:300])
    if status >= 400:
        assert_openai_error(status, payload)
    elif headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    status, _, _ = request(srv.url, "GET", "/health")
    assert status == 200


# ---- memory over a mixed load ------------------------------------------------------------------


def mixed_requests(n: int) -> list[tuple[str, str, bytes]]:
    good = json.dumps({"model": MODEL, "prompt": "t3 t4 t5", "max_tokens": 4}).encode()
    stream = json.dumps({"model": MODEL, "prompt": "t6", "max_tokens": 4, "stream": True}).encode()
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "t7"}], "max_tokens": 3}).encode()
    kinds = [
        ("POST", "/v1/completions", good), ("POST", "/v1/completions", stream), ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/completions", b"[" * 50_000 + b"]" * 50_000),
        ("POST", "/v1/completions", b'{"prompt": "\\ud800"}'),
        ("POST", "/v1/completions", json.dumps({"prompt": "t3 " * 1_000_000}).encode()),  # 3 MB, under the limit
        ("POST", "/v1/completions", b" " * (5 * MiB)),  # over the limit
        ("POST", "/v1/completions", json.dumps({"prompt": "t3", "max_tokens": "x" * 100_000}).encode()),
        ("GET", "/v1/completions", None), ("GET", "/health", None),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def status_of(srv, method: str, path: str, body: bytes | None) -> int:
    try:
        return request(srv.url, method, path, body)[0]
    except (BrokenPipeError, ConnectionResetError):  # a 413 that closed before the whole body was sent
        assert len(body) > srv.service.options.max_body_bytes
        return 413


def test_rss_stays_bounded_over_200_mixed_requests(srv):
    proc = psutil.Process()
    for method, path, body in mixed_requests(10):  # warm-up: one of each kind
        status_of(srv, method, path, body)
    start = proc.memory_info().rss
    statuses = [status_of(srv, method, path, body) for method, path, body in mixed_requests(200)]
    assert all(s < 500 for s in statuses) and statuses.count(200) >= 80
    assert proc.memory_info().rss - start < 50 * MiB
    assert_healthy(srv.url)
    wait_for(lambda: srv.service.scheduler.idle(), 10, "the scheduler to be idle")
