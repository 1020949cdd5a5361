"""The OpenAI-compatible wire format: request parsing and validation, errors, responses.

Everything here is pure (no HTTP framework, no engine): a JSON body goes in, a
``GenerationRequest`` or an ``APIError`` comes out; results go in, JSON-ready dicts come
out. Invariants:

* every rejection is an ``APIError`` whose ``body()`` is OpenAI's error shape
  ``{"error": {"message", "type", "param", "code"}}`` and whose status is 4xx for the
  client's mistakes;
* an option the server cannot honour is rejected by name, never silently ignored, unless
  its value is the one that changes nothing (``n: 1``, ``logprobs: false``, ``tools: []``);
* options unknown to this server (``user``, ``metadata``, ...) are ignored, as clients send
  them freely;
* a body nested deeper than ``MAX_JSON_DEPTH`` or holding a string that is not valid Unicode
  (a lone surrogate) is a 400 before any field is read, and error messages quote at most
  ``_SHOWN`` characters of a value, so no input, however large or deep, costs more than
  one linear pass to reject.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

import pydantic_core

from ..sampling import SamplingParams

CHAT = "chat"
COMPLETIONS = "completions"
ROLES = ("system", "developer", "user", "assistant")
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
GREEDY_BELOW = 1e-5  # logits / such a temperature overflow float32; the limit is greedy anyway
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts
MAX_JSON_DEPTH = 200  # pydantic-core's parser refuses deeper nesting (its recursion limit)
_SHOWN = 60  # characters of a rejected value quoted in an error message


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- request parsing ------------------------------------------------------------------


@dataclass
class GenerationRequest:
    """A validated chat or completions request (before tokenization).

    Exactly one of ``messages`` (chat) and ``prompt`` (completions; text or token ids)
    is set. ``max_tokens`` None means the server's default.
    """

    endpoint: str
    model: str
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False

    def sampling_params(self, prompt_tokens: int, max_context: int, default_max_tokens: int) -> SamplingParams:
        """The engine's settings, once the prompt's length is known.

        The engine ends a row when prompt + generated reaches the context, so at most
        ``max_context - prompt_tokens`` new tokens fit.
        """
        room = max_context - prompt_tokens
        param = "messages" if self.endpoint == CHAT else "prompt"
        if room <= 0:
            raise bad_request(f"the prompt has {prompt_tokens} tokens; this model's maximum context "
                              f"length is {max_context} tokens", param, "context_length_exceeded")
        if self.max_tokens is None:
            max_new = min(default_max_tokens, room)
        elif self.max_tokens > room:
            raise bad_request(f"this model's maximum context length is {max_context} tokens; you asked "
                              f"for {prompt_tokens + self.max_tokens} ({prompt_tokens} in the prompt, "
                              f"{self.max_tokens} to generate): lower max_tokens to at most {room}",
                              "max_tokens", "context_length_exceeded")
        else:
            max_new = self.max_tokens
        return SamplingParams(max_new_tokens=max_new, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=list(self.stop),
                              ignore_eos=self.ignore_eos).validate()


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400.

    pydantic-core's parser (FastAPI's own) rather than ``json``: it runs in linear time
    without recursing on the C stack, stops at ``MAX_JSON_DEPTH`` levels (``json.loads``
    raises RecursionError, a 500, on deep input), and refuses invalid UTF-8 and escaped
    lone surrogates, which no tokenizer can encode.
    """
    try:
        body = pydantic_core.from_json(raw)
    except ValueError as e:
        reason = (f"it nests deeper than {MAX_JSON_DEPTH} levels" if "recursion limit" in str(e)
                  else _shown_text(str(e), 200))
        if "surrogate" in reason or "hex escape" in reason:
            reason += " (strings must be valid Unicode: no lone surrogates)"
        raise bad_request(f"the request body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return body


# Options the engine cannot honour, with the values that leave them switched off.
_HARMLESS = {
    "n": (None, 1),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}
_CHAT_ONLY = {"tools", "tool_choice", "functions", "function_call", "response_format", "audio",
              "modalities", "prediction", "top_logprobs"}
_COMPLETIONS_ONLY = {"best_of", "echo", "suffix"}


def parse_request(body: dict, endpoint: str, served_model: str) -> GenerationRequest:
    """Validate a chat or completions body; raise APIError naming the offending field."""
    _reject_unsupported(body, endpoint)
    req = GenerationRequest(endpoint=endpoint, model=_model(body, served_model))
    if endpoint == CHAT:
        req.messages = _messages(body.get("messages"))
    else:
        req.prompt = _prompt(body.get("prompt"))
    req.max_tokens = _max_tokens(body)
    req.temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    if req.temperature < GREEDY_BELOW:
        req.temperature = 0.0
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    req.top_k = _integer(body, "top_k", 0, 0) or 0
    req.seed = _integer(body, "seed", None, *SEED_RANGE)
    req.stop = _stop(body.get("stop"))
    req.ignore_eos = _boolean(body, "ignore_eos", False)
    req.stream = _boolean(body, "stream", False)
    req.include_usage = _stream_options(body, req.stream)
    return req


def _reject_unsupported(body: dict, endpoint: str) -> None:
    wrong_endpoint = _COMPLETIONS_ONLY if endpoint == CHAT else _CHAT_ONLY
    for name, harmless in _HARMLESS.items():
        if name in body and name not in wrong_endpoint and body[name] not in harmless:
            what = "n > 1 (several choices per request)" if name == "n" else f"{name!r}"
            raise bad_request(f"{what} is not supported by this server", name, "unsupported_parameter")


def _model(body: dict, served: str) -> str:
    model = body.get("model", served)  # optional here; the OpenAI client always sends it
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model != served:
        raise APIError(404, f"the model {_shown(model)} does not exist; this server serves {served!r}",
                       "model", "model_not_found")
    return model


def _messages(messages) -> list[dict]:
    """Chat messages as [{'role', 'content': str}], text parts joined."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{param} must be an object with 'role' and 'content'", param)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{param}.role must be one of {', '.join(ROLES)}; got {_shown(role)}", f"{param}.role")
        # Most chat templates know only 'system'; OpenAI's newer 'developer' means the same.
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(m.get("content"), f"{param}.content")})
    return out


def _content(content, param: str) -> str:
    if isinstance(content, str):
        return _text(content, param)
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                                  param, "unsupported_content")
            texts.append(_text(part["text"], param))
        return "\n".join(texts)
    raise bad_request(f"{param} must be a string or a list of text parts", param)


def _prompt(prompt) -> str | list[int]:
    """One prompt: a string or a list of token ids (also wrapped in a one-item list)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        return _text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("several prompts in one request are not supported; send one request per prompt",
                          "prompt", "unsupported_parameter")
    if prompt == [] or prompt is None:
        raise bad_request("'prompt' is required and must not be empty", "prompt")
    raise bad_request("'prompt' must be a string or a list of token ids", "prompt")


def _max_tokens(body: dict) -> int | None:
    """max_completion_tokens (the newer name) wins over max_tokens."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _integer(body, name, None, None)
    if value is not None and value <= 0:
        raise bad_request(f"'{name}' must be > 0, got {value}", name)
    return value


def _text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode: a lone surrogate (possible in a str built by other
    means than our JSON parser) would fail inside the tokenizer instead of here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{param} is not valid Unicode: {e.reason} at index {e.start}", param) from None
    return text


def _shown_text(text: str, limit: int = _SHOWN) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _shown(value) -> str:
    """A value as quoted in an error message: its repr, cut to a few dozen characters
    (reprs are computed on a bounded prefix for strings and containers)."""
    if isinstance(value, str):
        return repr(_shown_text(value))
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    return _shown_text(repr(value))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _integer(body: dict, name: str, default, low, high=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {_shown(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad_request(f"'{name}' must be >= {low}, got {value}" if high is None else
                          f"'{name}' must be in [{low}, {high}], got {value}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    # isfinite only for floats: math.isfinite(10**400) raises OverflowError
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))):
        raise bad_request(f"'{name}' must be a number, got {_shown(value)}", name)
    if value > high or value < low or (low_open and value == low):
        interval = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise bad_request(f"'{name}' must be in {interval}, got {value}", name)
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {_shown(value)}", name)
    return value


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    return [_text(s, "stop") for s in stops]


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return _boolean(options, "include_usage", False)


# ---- responses --------------------------------------------------------------------------


def new_response_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == CHAT else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(endpoint: str, rid: str, model: str, created: int, chunk: bool) -> dict:
    kind = "chat.completion" if endpoint == CHAT else "text_completion"
    return {"id": rid, "object": kind + (".chunk" if chunk and endpoint == CHAT else ""),
            "created": created, "model": model}


def completion_body(endpoint: str, rid: str, model: str, text: str, finish_reason: str,
                    prompt_tokens: int, completion_tokens: int) -> dict:
    """A whole (non-streamed) response."""
    if endpoint == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {**_envelope(endpoint, rid, model, int(time.time()), chunk=False), "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


@dataclass
class ChunkWriter:
    """Builds the SSE chunks of one streamed response (same id and ``created`` throughout).

    With ``include_usage`` every chunk carries ``usage: null`` and the last one, which has
    no choices, carries the figures (OpenAI's convention).
    """

    endpoint: str
    rid: str
    model: str
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choices: list[dict]) -> dict:
        out = {**_envelope(self.endpoint, self.rid, self.model, self.created, chunk=True), "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def role(self) -> str:
        """The chat stream's opening chunk (completions streams have none)."""
        return sse(self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None, "logprobs": None}]))

    def text(self, delta: str, finish_reason: str | None = None) -> str:
        if self.endpoint == CHAT:
            choice = {"index": 0, "delta": {"content": delta} if delta else {}}
        else:
            choice = {"index": 0, "text": delta}
        choice.update(finish_reason=finish_reason, logprobs=None)
        return sse(self._chunk([choice]))

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        out = {**self._chunk([]), "usage": usage(prompt_tokens, completion_tokens)}
        return sse(out)

    @staticmethod
    def error(err: APIError) -> str:
        """A failure after the stream began: the openai client raises on such an event."""
        return sse(err.body())


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
