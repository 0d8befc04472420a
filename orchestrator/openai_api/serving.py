"""The OpenAI API's handlers: /v1/completions and /v1/chat/completions, whole or streamed as
server-sent events, over the orchestrator.

A translator only: every request is built and validated by Orchestrator.make_request (from the
body's Prompt and RequestOptions: orchestrator.openai_api.protocol) and run by
Orchestrator.stream (the scheduler, stop strings, cancellation, the requests metric), exactly
as gRPC Generate is. Here the Outcome's gRPC status becomes an HTTP code, the pieces become
chunks, and a client that goes away aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from orchestrator.openai_api.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    check_supported,
    dumps,
)
from orchestrator.openai_api.responses import Shape, joined
from orchestrator.requests import Outcome, Piece


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def error_response(e: ApiError) -> Response:
    return json_response(e.body(), e.status)


class OpenAIServing:
    """The generation endpoints over a started Orchestrator."""

    def __init__(self, orch):
        self.orch = orch

    def check_model(self, name: str | None) -> None:
        served = self.orch.info.model_name
        if name not in (None, served):
            raise ApiError(
                404,
                f"the model {name!r} does not exist (this server serves {served!r})",
                param="model",
                code="model_not_found",
            )

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._run(request, body, False)

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        return await self._run(request, body, True)

    async def _run(
        self, request: Request, body: CompletionRequest | ChatRequest, chat: bool
    ) -> Response:
        orch = self.orch
        prompt = body.to_prompt()
        self.check_model(body.model)
        check_supported(body)
        options = body.to_options()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        gen = await orch.request_async(orch.make_request, prompt, options, request_id)
        token_text = orch.tokenizer.token_text if orch.tokenizer is not None else None
        shape = Shape(chat, orch.info.model_name, gen, body.return_token_ids, token_text)
        items = orch.stream(gen, options.stop)
        if not body.stream:
            ok, result = await unless_disconnected(request.receive, _collect(items))
            if not ok:
                return Response(status_code=499)  # nobody is there to read it
            piece, outcome = result
            if outcome.error is not None:
                return error_response(ApiError.from_status(*outcome.error))
            return json_response(shape.response(piece, outcome))
        # Wait for the first item before answering, so that a request refused at admission
        # (queue full, a bad request) gets its HTTP status rather than a 200 and an error event.
        ok, first = await unless_disconnected(request.receive, items.__anext__())
        if not ok:
            return Response(status_code=499)
        if isinstance(first, Outcome) and first.error is not None:
            await items.aclose()
            return error_response(ApiError.from_status(*first.error))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _EventStream(_events(first, items, shape, include_usage))


async def _collect(items: AsyncIterator) -> tuple[Piece, Any]:
    pieces = []
    async with contextlib.aclosing(items):
        async for item in items:
            if not isinstance(item, Outcome):
                pieces.append(item)
            else:
                return joined(pieces), item
    raise RuntimeError("the request stream ended without an outcome")


def _sse(obj: Any) -> str:
    return f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n"


async def _events(
    first, items: AsyncIterator, shape: Shape, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE body: chunks as pieces commit, the finish chunk (with "flashmap"), the usage chunk
    when asked for, then [DONE]. An error after the stream started is an `error` event."""
    with_usage = (lambda d: {**d, "usage": None}) if include_usage else (lambda d: d)
    async with contextlib.aclosing(items):
        if shape.chat:  # OpenAI opens a chat stream with the assistant role
            yield _sse(with_usage(shape.chunk(Piece([], ""), first=True)))
        item = first
        while True:
            if not isinstance(item, Outcome):
                if shape.wants(item):
                    yield _sse(with_usage(shape.chunk(item)))
            elif item.error is not None:
                yield _sse(ApiError.from_status(*item.error).body())
                break
            else:
                yield _sse(with_usage(shape.finish_chunk(item)))
                if include_usage:
                    yield _sse({**shape.head(True), "choices": [], "usage": shape.usage(item)})
                break
            item = await items.__anext__()
    yield _sse("[DONE]")


async def unless_disconnected(receive, work: Awaitable) -> tuple[bool, Any]:
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
            await unless_disconnected(receive, self.stream_response(send))
        finally:
            await self.body_iterator.aclose()
