"""HTTP routes of ``specdraft serve`` (FastAPI): the OpenAI-compatible API around a Scheduler.

A generation request goes: API key -> JSON body -> ``protocol.parse_request`` ->
tokenization -> ``SamplingParams`` -> ``Scheduler.submit`` -> the scheduler thread's
events, received through an asyncio queue fed with ``loop.call_soon_threadsafe``.

Invariants:

* every error response, ours or the framework's (404, 405, 500), has OpenAI's error shape;
  a 500 carries the exception's type only (never a traceback), is logged once, and keeps
  the connection open (``ErrorBoundary``);
* limits hold while reading: the body is read chunk by chunk and refused (413) as soon as
  it passes ``max_body_bytes``, so memory per request is bounded by the limit, not by what
  the client sends; a prompt too long in characters to fit the context is refused before
  it is tokenized (``prompt_char_limit``);
* the event loop never runs CPU-heavy work: JSON parsing, validation, chat templating and
  tokenizing run in the thread pool, so /health and running streams stay responsive;
* a request that cannot run gets its error status *before* any byte of a response body:
  a stream starts only once its first tokens exist, so queue timeouts, a full queue and a
  draining server are real 4xx/5xx responses, not errors inside a 200 stream;
* a job whose client went away (stream closed, connection dropped while waiting) is
  cancelled, so its row leaves the batch.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import SpeculativeEngine, StepEvent
from ..errors import SpecdraftError
from .metrics import ServerMetrics
from .protocol import (CHAT, COMPLETIONS, DONE, APIError, ChunkWriter, GenerationRequest, bad_request,
                       completion_body, new_response_id, parse_json_body, parse_request)
from .scheduler import JobError, NotAccepting, QueueFull, Scheduler
from .streaming import TextStream

log = logging.getLogger("specdraft.server")

ROUTES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/models": "models"}
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection"; nobody receives it


@dataclass
class ServeOptions:
    """Server settings (``specdraft serve`` flags)."""

    model_name: str
    api_key: str | None = None
    max_batch_size: int = 8
    max_queue: int = 64
    request_timeout: float | None = 600.0
    default_max_tokens: int = 256
    max_body_bytes: int = 4 << 20


class Service:
    """What the routes share: engine, options, scheduler, metrics, and the draining flag.

    ``draining`` is a plain attribute so that a signal handler may set it without locks.
    """

    def __init__(self, engine: SpeculativeEngine, options: ServeOptions):
        self.engine = engine
        self.options = options
        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(engine, options.max_batch_size, options.max_queue, self.metrics)
        self.draining = False
        self.started = int(time.time())
        self.prompt_char_limit = prompt_char_limit(engine.target)

    @property
    def target(self):
        return self.engine.target

    def status(self) -> str:
        """ok, draining (after SIGTERM), or stopped (the scheduler thread has ended)."""
        if self.draining:
            return "draining"
        return "ok" if self.scheduler.accepting else "stopped"


def create_app(engine: SpeculativeEngine, options: ServeOptions) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the scheduler thread."""
    service = Service(engine, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.scheduler.start()
        yield
        # Joining waits for the step in progress; do it off the event loop so that the
        # scheduler's last deliveries still reach their requests.
        await asyncio.to_thread(service.scheduler.stop)

    app = FastAPI(title="specdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(ErrorBoundary)  # inside CountResponses (added last = outermost): its 500s are counted
    app.add_middleware(CountResponses, metrics=service.metrics)
    _add_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(service, request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(service, request, COMPLETIONS)

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(service, request)
        return {"object": "list", "data": [{
            "id": options.model_name, "object": "model", "created": service.started, "owned_by": "specdraft",
            "max_model_len": service.target.max_context}]}

    @app.get("/health")
    async def health():
        status = service.status()
        body = {"status": status, "model": options.model_name,
                "waiting": service.scheduler.waiting, "running": service.scheduler.running}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        data, content_type = service.metrics.render()
        return Response(data, media_type=content_type)

    return app


# ---- errors -------------------------------------------------------------------------------


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found" if err.status_code == 404 else None
        # err.headers holds the framework's own, e.g. 405's Allow
        return error_response(APIError(err.status_code, str(err.detail), code=kind, headers=err.headers))


class ErrorBoundary:
    """ASGI middleware: an exception no handler took becomes one logged traceback and a 500
    with OpenAI's error shape (the exception's type, never its traceback), sent on the same
    connection. Starlette's own fallback (ServerErrorMiddleware) re-raises after its 500,
    so uvicorn logs the traceback a second time and drops a keep-alive connection.

    An exception after the response started cannot change it any more: it is logged and the
    response ends where it is (streams report their own failures as an error event first).
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:
            log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                response = error_response(APIError(500, f"internal server error: {type(err).__name__}",
                                                   type="server_error"))
                await response(scope, receive, send)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def job_error(err: JobError) -> APIError:
    """How a job that ended without a result is reported."""
    if err.kind == JobError.TIMEOUT:
        return APIError(408, f"{err} (the server's --request-timeout)", type="timeout_error",
                        code="request_timeout")
    if err.kind == JobError.SHUTDOWN:
        return APIError(503, str(err), type="server_error", code="server_shutting_down")
    return APIError(500, str(err), type="server_error", code="engine_error")


def check_api_key(service: Service, request: Request) -> None:
    """401 unless the ``Authorization: Bearer KEY`` header holds the server's key (if it has one)."""
    key = service.options.api_key
    if not key:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                       code="invalid_api_key")


class CountResponses:
    """ASGI middleware: count /v1 responses by endpoint and status, when the status is sent
    (so a client that has its response always finds it counted)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        endpoint = ROUTES.get(scope["path"], "other")
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except BaseException:
            if not started:  # the 500 is sent by an outer middleware
                self.metrics.requests.labels(endpoint, "500").inc()
            raise


# ---- generation ---------------------------------------------------------------------------


class ClientGone(Exception):
    """The client disconnected while its request waited."""


async def generate(service: Service, request: Request, endpoint: str) -> Response:
    """Validate, queue, and answer one chat or completions request."""
    received = time.perf_counter()
    check_api_key(service, request)
    if service.status() != "ok":
        raise APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
    raw = await read_body(service, request)
    req, prompt, params = await run_in_threadpool(prepare, service, raw, endpoint)
    job_id, inbox = submit(service, prompt, params)
    try:
        # Until the response starts, nothing else listens to the connection: watch it here.
        async with disconnect_watch(request, inbox):
            first = await next_delivery(inbox)
            service.metrics.ttft.observe(time.perf_counter() - received)
            if not req.stream:
                result = await collect_result(inbox, first)
    except (ClientGone, asyncio.CancelledError) as e:
        service.scheduler.cancel(job_id)
        if isinstance(e, ClientGone):
            return Response(status_code=CLIENT_CLOSED)
        raise
    rid = new_response_id(endpoint)
    if req.stream:  # from here on StreamingResponse watches for the disconnect
        body = stream_body(service, req, rid, inbox, first, received)
        return CancellingStream(body, on_close=lambda: service.scheduler.cancel(job_id),
                                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    service.metrics.latency.labels(endpoint).observe(time.perf_counter() - received)
    return JSONResponse(completion_body(endpoint, rid, req.model, result.text, result.finish_reason,
                                        result.prompt_tokens, result.new_tokens))


async def read_body(service: Service, request: Request) -> bytes:
    """The raw body, read chunk by chunk: a body over the limit (declared or chunked) is a
    413 once its first ``max_body_bytes`` + 1 bytes have arrived, never buffered whole.
    The 413 closes the connection: the rest of that body is never read."""
    limit = service.options.max_body_bytes
    too_large = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large",
                         headers={"Connection": "close"})
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refuse before reading it
        raise too_large
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise too_large
    return bytes(raw)


def prepare(service: Service, raw: bytes, endpoint: str):
    """Body -> (request, prompt ids, sampling params), or an APIError. CPU-bound (JSON,
    chat template, tokenizer): runs in the thread pool, off the event loop."""
    req = parse_request(parse_json_body(raw), endpoint, service.options.model_name)
    prompt = encode_prompt(service.target, req, service.prompt_char_limit)
    return req, prompt, sampling_params(service, req, prompt)


def prompt_char_limit(target) -> int:
    """Characters beyond which a prompt cannot fit the context: a token never covers more
    characters than the longest vocabulary entry (16 at least, for tokenizers with byte or
    unknown-word fallbacks), so a longer text has more tokens than the context holds."""
    try:
        longest = max(map(len, target.tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without a vocabulary listing: only the exact check applies
        return 1 << 62
    return target.max_context * max(longest, 16)


def sampling_params(service: Service, req: GenerationRequest, prompt: list[int]):
    try:
        return req.sampling_params(len(prompt), service.target.max_context, service.options.default_max_tokens)
    except SpecdraftError as e:  # the engine's own rules, should protocol.py have missed one
        raise bad_request(str(e)) from None


def encode_prompt(target, req: GenerationRequest, char_limit: int = 1 << 62) -> list[int]:
    """The prompt's token ids: chat messages through the chat template, text as is, ids checked.
    Text longer than ``char_limit`` characters is refused before the tokenizer sees it."""
    param = "messages" if req.endpoint == CHAT else "prompt"
    chars = (sum(len(m["content"]) for m in req.messages) if req.endpoint == CHAT
             else len(req.prompt) if isinstance(req.prompt, str) else 0)
    if chars > char_limit:
        raise bad_request(f"the prompt has {chars} characters, more than this model's maximum context length "
                          f"of {target.max_context} tokens can hold", param, "context_length_exceeded")
    if req.endpoint == CHAT:
        ids = encode_chat(target, req.messages)
    elif isinstance(req.prompt, list):
        if len(req.prompt) >= target.max_context:
            raise bad_request(f"the prompt has {len(req.prompt)} tokens; this model's maximum context "
                              f"length is {target.max_context} tokens", param, "context_length_exceeded")
        bad = [t for t in req.prompt if t >= target.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (size {target.vocab_size})", "prompt")
        ids = req.prompt
    else:
        try:
            ids = target.encode_prompt(req.prompt, chat=False)
        except Exception as e:  # as for chat templates: what the tokenizer refuses is the input's fault
            raise bad_request(f"the tokenizer rejected the prompt: {type(e).__name__}", "prompt") from None
    if not ids:
        raise bad_request("the prompt encodes to no tokens", "messages" if req.endpoint == CHAT else "prompt")
    return list(ids)


def encode_chat(target, messages: list[dict]) -> list[int]:
    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("the model has no chat template; use /v1/completions", "messages", "no_chat_template")
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # templates reject what they cannot render (e.g. roles out of order)
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    if hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def submit(service: Service, prompt: list[int], params) -> tuple[int, asyncio.Queue]:
    """Queue the job; its deliveries arrive in the returned asyncio queue, in order."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def deliver(item) -> None:  # runs on the scheduler thread
        loop.call_soon_threadsafe(inbox.put_nowait, item)

    try:
        job = service.scheduler.submit(prompt, params, deliver, service.options.request_timeout)
    except QueueFull as e:
        raise APIError(429, f"{e}; retry later", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except NotAccepting as e:
        raise APIError(503, str(e), type="server_error", code="server_shutting_down") from None
    service.metrics.prompt_tokens.inc(len(prompt))
    return job.id, inbox


GONE = object()  # put into a request's inbox when its client disconnects


@asynccontextmanager
async def disconnect_watch(request: Request, inbox: asyncio.Queue):
    """While inside, a client disconnect puts GONE into ``inbox``.

    The request body has been read, so the only message ``receive`` can still bring is
    the disconnect. The watcher must be gone before a StreamingResponse starts its own.
    """
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        inbox.put_nowait(GONE)

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


async def next_delivery(inbox: asyncio.Queue) -> StepEvent:
    """The job's next event; a job error becomes its APIError, a disconnect ClientGone."""
    item = await inbox.get()
    if item is GONE:
        raise ClientGone()
    if isinstance(item, JobError):
        raise job_error(item)
    return item


async def collect_result(inbox: asyncio.Queue, event: StepEvent):
    """Wait for the job's result (non-streamed responses need only that)."""
    while event.result is None:
        event = await next_delivery(inbox)
    return event.result


async def stream_body(service: Service, req: GenerationRequest, rid: str, inbox: asyncio.Queue,
                      item, received: float):
    """SSE chunks: (chat: a role chunk), text deltas, a finish chunk, (usage), [DONE].

    A job error after the stream began is sent as an ``{"error": ...}`` event, then [DONE].
    """
    writer = ChunkWriter(req.endpoint, rid, req.model, req.include_usage)
    text = TextStream(service.target.tokenizer, req.stop)
    if req.endpoint == CHAT:
        yield writer.role()
    try:
        while True:
            if isinstance(item, JobError):
                yield writer.error(job_error(item))
                break
            delta = text.push(item.new_ids, item.result)
            if delta:
                yield writer.text(delta)
            result = item.result
            if result is not None:
                service.metrics.latency.labels(req.endpoint).observe(time.perf_counter() - received)
                yield writer.text("", result.finish_reason)
                if req.include_usage:
                    yield writer.usage(result.prompt_tokens, result.new_tokens)
                break
            item = await inbox.get()
    except Exception as err:  # a bug here must still end the stream the documented way
        log.exception("a stream failed")
        yield writer.error(APIError(500, f"internal server error: {type(err).__name__}", type="server_error"))
    yield DONE


class CancellingStream(StreamingResponse):
    """A StreamingResponse that calls ``on_close`` however it ends (done, client gone,
    server stopping), so that an unfinished job never keeps its batch row."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()  # a no-op for a job that already finished
