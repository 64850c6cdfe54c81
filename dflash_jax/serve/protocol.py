"""The OpenAI wire format: request bodies checked into `Params` (every bad field a 400 naming it), errors in
OpenAI's shape, and the response and stream-chunk bodies of chat and text completions."""
from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError

MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape: {"error": {"message", "type", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"), "param": None,
                          "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Strict):
    type: str
    text: str = ""


class Message(_Strict):
    role: str
    content: Union[str, list[ContentPart], None] = None


class _Common(_Strict):
    model: Union[str, None] = None
    max_tokens: Union[int, None] = None
    max_completion_tokens: Union[int, None] = None
    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    top_k: Union[int, None] = None
    seed: Union[int, None] = None
    stop: Union[str, list[str], None] = None
    n: Union[int, None] = None
    stream: Union[bool, None] = None
    stream_options: Union[dict, None] = None
    ignore_eos: Union[bool, None] = None  # vLLM's extension: run to max_tokens through end-of-sequence tokens


class ChatBody(_Common):
    messages: list[Message]


class CompletionBody(_Common):
    prompt: Union[str, list[str], list[int]]


_FIELDS = set(ChatBody.model_fields) | set(CompletionBody.model_fields) | set(Message.model_fields) | \
    set(ContentPart.model_fields)


@dataclasses.dataclass
class Params:
    """A checked request, tokenised by the caller."""
    kind: Literal["chat", "completion"]
    messages: list | None  # chat: [{"role", "content"}]
    prompt: str | list[int] | None  # completion: text or token ids
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    model: str | None


def parse(raw: bytes, kind: str) -> Params:
    """The body of a /v1/chat/completions (kind "chat") or /v1/completions request, checked; ApiError(400) naming
    the first problem."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", "invalid_json")
    try:
        body = (ChatBody if kind == "chat" else CompletionBody).model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or p in _FIELDS)  # not union tags
        field = str(err["loc"][0]) if err["loc"] else "body"
        raise ApiError(400, f"'{where or field}': {err['msg']}", "invalid_" + field) from None
    if body.n not in (None, 1):
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {body.n}", "invalid_n")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'max_tokens' must be at least 1, got {max_tokens}", "invalid_max_tokens")
    t = 1.0 if body.temperature is None else body.temperature
    if not (math.isfinite(t) and t >= 0):
        raise ApiError(400, f"'temperature' must be a finite number >= 0, got {t}", "invalid_temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", "invalid_top_p")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    if top_k < 0:
        raise ApiError(400, f"'top_k' must be >= 0 (0 or -1: off), got {body.top_k}", "invalid_top_k")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS or not all(stop):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings", "invalid_stop")
    messages = prompt = None
    if kind == "chat":
        if not body.messages:
            raise ApiError(400, "'messages' must hold at least one message", "invalid_messages")
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                     "".join(p.text for p in (m.content or ()) if p.type == "text")} for m in body.messages]
    else:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"'prompt' as a list of strings must hold one (one choice per request), got "
                                    f"{len(prompt)}", "invalid_prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "'prompt' is empty", "invalid_prompt")
    opts = body.stream_options or {}
    return Params(kind=kind, messages=messages, prompt=prompt, max_tokens=max_tokens, temperature=float(t),
                  top_p=float(top_p), top_k=int(top_k), seed=body.seed, stop=stop, stream=bool(body.stream),
                  include_usage=bool(opts.get("include_usage")), ignore_eos=bool(body.ignore_eos), model=body.model)


class Reply:
    """The response bodies of one request: the whole answer, or its stream chunks."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def whole(self, text: str, finish: str, usage: dict) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(self.object), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None = None, finish: str | None = None, first: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}


def sse(obj) -> bytes:
    """One server-sent event: `data: {json}` (or `data: [DONE]`)."""
    return b"data: " + (obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()) + b"\n\n"
