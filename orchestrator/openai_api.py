"""The orchestrator's OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions,
/v1/models, /health (one module: the request models, the response shapes and the server of one
protocol change together).

It runs on the orchestrator's event loop (uvicorn, started by `serve()` beside the gRPC
server) and is a translator only: every request is built and validated by
Orchestrator.make_request (tokenizer, chat template, context and parameter limits) and
run by Orchestrator.stream (the scheduler, stop strings, cancellation, the requests
metric), exactly as gRPC Generate is. This module maps OpenAI's JSON and server-sent
events onto those records and the Outcome's gRPC status onto HTTP codes.

Extensions beyond OpenAI's fields (the client's `extra_body`): `top_k`, `ignore_eos`,
`stop_token_ids`, `draft_steps` (flow-map jumps for this request), `max_draft_tokens`
(0 = speculation off), `return_token_ids` (token ids in each choice / chunk, as vLLM
names it). Responses carry the request's speculative statistics under `"flashmap"`
(streamed: in the chunk that has the finish_reason).

One idea: the request models, the response shapes and the server of one HTTP API.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse

from flashmap.auth import bearer
from flashmap.types import InvalidRequest
from orchestrator.requests import Outcome

log = logging.getLogger("flashmap.openai")

# Outcome / request status -> (HTTP status, OpenAI error type)
_HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    @staticmethod
    def from_status(code: grpc.StatusCode, message: str) -> ApiError:
        status, kind = _HTTP_OF.get(code, (500, "server_error"))
        return ApiError(status, message, kind, code=code.name.lower())

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# ----------------------------------------------------------------------------- request bodies
# Unknown fields are refused (as OpenAI does), so a misspelt extension is an error, not ignored.


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share. None = OpenAI's default."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # optional here: the one served model
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default: 1
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: int | None = None  # 0 or -1 = off
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    draft_steps: int | None = None
    max_draft_tokens: int | None = None  # 0 = speculation off for this request
    return_token_ids: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(
        extra="allow"
    )  # name, tool_calls: null, refusal: null ... from clients
    role: str
    content: str | list[_ContentPart] | None = None


class ChatRequest(_Sampling):
    messages: list[_Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


# Fields accepted for compatibility, refused unless they are at their neutral value: this
# server cannot honour them, and ignoring them would silently change what a client gets.
_NEUTRAL = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
}


def _check_supported(body: _Sampling) -> None:
    if body.n not in (None, 1):
        raise ApiError(
            400,
            f"n must be 1 (this server returns one choice per request), got {body.n}",
            param="n",
        )
    for name, neutral in _NEUTRAL.items():
        if name in type(body).model_fields and getattr(body, name) not in neutral:
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )


def _message_text(m: _Message, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise ApiError(
                400,
                f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                param="messages",
            )
        parts.append(part.text)
    return "\n".join(parts)


# ----------------------------------------------------------------------------- responses


def _dumps(obj: Any) -> str:
    # numpy scalars can reach the stats; everything else is plain JSON
    return json.dumps(
        obj,
        ensure_ascii=False,
        separators=(",", ":"),
        default=lambda o: o.item() if hasattr(o, "item") else str(o),
    )


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_dumps(obj), status_code=status, media_type="application/json")


def _error(e: ApiError) -> Response:
    return _json(e.body(), e.status)


class _Shape:
    """OpenAI's JSON for one endpoint: whole responses and streamed chunks, completions or chat."""

    def __init__(self, chat: bool, model: str, gen, return_token_ids: bool):
        self.chat, self.model, self.gen, self.ids = chat, model, gen, return_token_ids
        self.id = gen.request_id
        self.created = int(time.time())

    def head(self, chunk: bool) -> dict:
        obj = (
            ("chat.completion.chunk" if chunk else "chat.completion")
            if self.chat
            else "text_completion"
        )
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(
        self, text: str, ids: list[int], finish: str | None, chunk: bool, first: bool = False
    ) -> dict:
        c: dict[str, Any] = {"index": 0}
        if not self.chat:
            c["text"] = text
        elif chunk:
            c["delta"] = ({"role": "assistant"} if first else {}) | (
                {"content": text} if text or first else {}
            )
        else:
            c["message"] = {"role": "assistant", "content": text}
        c["logprobs"] = None
        c["finish_reason"] = finish
        if self.ids:
            c["token_ids"] = ids
            if not chunk or first:
                c["prompt_token_ids"] = list(self.gen.prompt_ids)
        return c

    @staticmethod
    def usage(o) -> dict:
        return {
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
        }

    @staticmethod
    def stats(o) -> dict:
        return {**o.stats.as_dict(), "time_to_first_token_s": o.ttft_s, "total_s": o.total_s}

    def response(self, text: str, ids: list[int], o) -> dict:
        return {
            **self.head(False),
            "choices": [self._choice(text, ids, o.finish_reason, False)],
            "usage": self.usage(o),
            "flashmap": self.stats(o),
        }

    def chunk(
        self, text: str, ids: list[int], finish: str | None = None, first: bool = False
    ) -> dict:
        return {**self.head(True), "choices": [self._choice(text, ids, finish, True, first)]}


def _sse(obj: Any) -> str:
    return f"data: {obj if isinstance(obj, str) else _dumps(obj)}\n\n"


async def _events(
    first, items: AsyncIterator, shape: _Shape, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE body: chunks as pieces commit, the finish chunk (with "flashmap"), the usage chunk
    when asked for, then [DONE]. An error after the stream started is an `error` event."""
    with_usage = (lambda d: {**d, "usage": None}) if include_usage else (lambda d: d)
    async with contextlib.aclosing(items):
        if shape.chat:  # OpenAI opens a chat stream with the assistant role
            yield _sse(with_usage(shape.chunk("", [], first=True)))
        item = first
        while True:
            if not isinstance(item, Outcome):
                if item.text or shape.ids:
                    yield _sse(with_usage(shape.chunk(item.text, item.token_ids)))
            elif item.error is not None:
                yield _sse(ApiError.from_status(*item.error).body())
                break
            else:
                yield _sse(
                    with_usage(
                        {**shape.chunk("", [], item.finish_reason), "flashmap": shape.stats(item)}
                    )
                )
                if include_usage:
                    yield _sse({**shape.head(True), "choices": [], "usage": shape.usage(item)})
                break
            item = await items.__anext__()
    yield _sse("[DONE]")


async def _unless_disconnected(receive, work: Awaitable) -> tuple[bool, Any]:
    """Run `work` until it finishes or the client disconnects, whichever is first: (True, result)
    or (False, None) after cancelling it. Cancelling the task that iterates Orchestrator.stream
    aborts the request, which frees its target and drafter slots at the next round."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await task
    if task.cancelled() or isinstance(
        task.exception(), OSError
    ):  # OSError: a write to a closed connection
        return False, None
    return True, task.result()


class _EventStream(StreamingResponse):
    """Server-sent events that stop, and abort the request, as soon as the client goes away
    (Starlette's own only notices at the next write, which may be many rounds later)."""

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def __call__(self, scope, receive, send) -> None:
        try:
            await _unless_disconnected(receive, self.stream_response(send))
        finally:
            await self.body_iterator.aclose()


# ----------------------------------------------------------------------------- the app


def create_app(orch) -> FastAPI:
    """The FastAPI app over a started Orchestrator."""
    app = FastAPI(
        title="FlashMap Serve (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None
    )
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error(e)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, e: InvalidRequest):
        return _error(ApiError(400, str(e)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        if "json" not in request.headers.get("content-type", ""):
            return _error(
                ApiError(400, "send the request body as JSON (Content-Type: application/json)")
            )
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "extra_forbidden":
            msg = f"unsupported field {loc[-1]!r}" if loc else "unsupported field"
        elif err.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", []
        else:
            msg = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}"
        return _error(ApiError(400, msg, param=".".join(loc) or None))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error(
            ApiError(e.status_code, f"{e.detail}: {request.method} {request.url.path}", kind)
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("HTTP request failed")
        return _error(
            ApiError(500, f"internal error: {type(e).__name__}", "server_error", code="internal")
        )

    def model_card() -> dict:
        return {
            "id": orch.info.model_name,
            "object": "model",
            "created": started,
            "owned_by": "flashmap",
            "max_model_len": orch.info.max_seq_len,
        }

    def check_model(name: str | None) -> None:
        if name not in (None, orch.info.model_name):
            raise ApiError(
                404,
                f"the model {name!r} does not exist (this server serves {orch.info.model_name!r})",
                param="model",
                code="model_not_found",
            )

    @app.middleware("http")
    async def api_key(request: Request, call_next):
        """With an API key configured, every /v1 call carries `Authorization: Bearer <key>`; no body
        is larger than the public API's message limit (the gRPC port's)."""
        size = request.headers.get("content-length", "0")
        if not size.isdigit() or int(size) > orch.cfg.max_message_bytes:
            return _error(
                ApiError(413, f"the request body is larger than {orch.cfg.max_message_bytes} bytes")
            )
        key = orch.cfg.api_key
        if (
            key
            and request.url.path.startswith("/v1")
            and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), bearer(key).encode()
            )
        ):
            return _error(
                ApiError(
                    401,
                    "missing or wrong API key (Authorization: Bearer <key>)",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
            )
        return await call_next(request)

    @app.get("/health")
    async def health():
        ready = orch.health.ok  # what the health loop last learned: never a call that could hang
        body = {
            "status": "ok" if ready else "unavailable",
            "target_ready": ready,
            "drafter_ready": bool(orch.drafter and orch.drafter.connected),
            "active_requests": len(orch.active),
            "queued_requests": len(orch.waiting),
        }
        return _json(body, 200 if ready else 503)

    @app.get("/v1/models")
    async def models():
        return _json({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return _json(model_card())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"one prompt per request, got {len(p)}", param="prompt")
            p = p[0]
        prompt = {"text": p} if isinstance(p, str) else {"token_ids": p}
        return await run(
            request, body, False, prompt, 16 if body.max_tokens is None else body.max_tokens
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        messages = [
            {"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(body.messages)
        ]
        limit = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        return await run(
            request, body, True, {"messages": messages}, limit
        )  # None: the rest of the context

    async def run(
        request: Request, body: _Sampling, chat: bool, prompt: dict, max_tokens: int | None
    ) -> Response:
        check_model(body.model)
        _check_supported(body)
        gen = await orch.request_async(
            functools.partial(
                orch.make_request,
                **prompt,
                max_new_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=0 if body.top_k in (None, -1) else body.top_k,
                top_p=body.top_p,
                seed=body.seed,
                stop_token_ids=body.stop_token_ids or (),
                ignore_eos=body.ignore_eos,
                draft_steps=body.draft_steps,
                max_draft_tokens=body.max_draft_tokens,
                request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            )
        )
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        shape = _Shape(chat, orch.info.model_name, gen, body.return_token_ids)
        items = orch.stream(gen, stops)
        if not body.stream:
            ok, result = await _unless_disconnected(request.receive, _collect(items))
            if not ok:
                return Response(status_code=499)  # nobody is there to read it
            text, ids, outcome = result
            if outcome.error is not None:
                return _error(ApiError.from_status(*outcome.error))
            return _json(shape.response(text, ids, outcome))
        # Wait for the first item before answering, so that a request refused at admission
        # (queue full, a bad request) gets its HTTP status rather than a 200 and an error event.
        ok, first = await _unless_disconnected(request.receive, items.__anext__())
        if not ok:
            return Response(status_code=499)
        if isinstance(first, Outcome) and first.error is not None:
            await items.aclose()
            return _error(ApiError.from_status(*first.error))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _EventStream(_events(first, items, shape, include_usage))

    return app


async def _collect(items: AsyncIterator) -> tuple[str, list[int], Any]:
    text, ids = [], []
    async with contextlib.aclosing(items):
        async for item in items:
            if not isinstance(item, Outcome):
                text.append(item.text)
                ids.extend(item.token_ids)
            else:
                return "".join(text), ids, item
    raise RuntimeError("the request stream ended without an outcome")


# ----------------------------------------------------------------------------- the server


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The gRPC server's serve loop owns SIGINT / SIGTERM and stops this server in turn.
        yield


class HttpServer:
    """The API served by uvicorn on the running event loop."""

    def __init__(self, orch, host: str, port: int, grace_s: float = 2.0):
        tls = orch.cfg.tls or (None, None)  # the gRPC port's certificate, when it has one
        config = uvicorn.Config(
            create_app(orch),
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=grace_s,
            ssl_certfile=tls[0],
            ssl_keyfile=tls[1],
        )
        self.server = _Server(config)
        self.host, self.port = host, port
        self._task: asyncio.Task | None = None

    async def start(self) -> HttpServer:
        self._task = asyncio.create_task(self.server.serve())
        while (
            not self.server.started
        ):  # listening (a port in use ends the process, as uvicorn does)
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"the HTTP API did not start on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1", self.host, self.port)
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self.server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
