"""Client SDK for FlashMap Serve: sync and async, streaming, plain exceptions.

    from flashmap.client import Client
    with Client("127.0.0.1:50051") as c:
        for chunk in c.generate_stream(prompt="def add(a, b):", max_new_tokens=32):
            print(chunk.text, end="")
        out = c.generate(prompt_ids=[1, 2, 3], max_new_tokens=16, temperature=0.8, seed=1)
        print(out.token_ids, out.stats.mean_acceptance_length)
        print(c.generate(messages=[{"role": "user", "content": "Hello!"}], max_new_tokens=64).text)

generate and generate_stream take one prompt (prompt=, prompt_ids= or messages=), request_id=,
and the request's options: the fields of flashmap.request_options.RequestOptions by name, or a
RequestOptions as options= (fields by name then change it). A conversation's answer comes apart
as the server splits it: `text` (the answer), `reasoning_content` (a template that thinks),
`tool_calls`, and `thinking` (the mode that ran); `logprobs=True` brings each token's
log-probability (flashmap.types.TokenLogprob).

    out = c.generate(messages=[{"role": "user", "content": "Weather in Paris?"}],
                     tools=[{"type": "function", "function": {"name": "get_weather"}}],
                     chat_template_kwargs={"enable_thinking": False}, max_new_tokens=256)
    print(out.thinking, out.reasoning_content, out.tool_calls, out.text)

gRPC errors become FlashMapError subclasses (InvalidArgument, ResourceExhausted,
Unavailable, ...), each with the server's message. DrafterAdmin switches the drafter's
step count at run time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from flashmap.auth import (
    API_KEY_ENV,
    API_KEY_HEADER,
    DRAFTER_TOKEN_ENV,
    DRAFTER_TOKEN_HEADER,
    DRAFTER_TOKEN_LOCAL,
    bearer,
    read_secret,
)
from flashmap.chat import ToolCall
from flashmap.request_options import Prompt, RequestOptions
from flashmap.request_proto import options_to_proto, prompt_to_proto
from flashmap.types import SpecStats, TokenLogprob
from flashmap.v1 import drafter_pb2, drafter_pb2_grpc, serving_pb2, serving_pb2_grpc
from flashmap.wire import stats_from_proto


class FlashMapError(Exception):
    code: grpc.StatusCode | None = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code or self.code


class InvalidArgument(FlashMapError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(FlashMapError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(FlashMapError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(FlashMapError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(FlashMapError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(FlashMapError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {
    c.code: c
    for c in (
        InvalidArgument,
        ResourceExhausted,
        Unavailable,
        Cancelled,
        DeadlineExceeded,
        Unauthenticated,
    )
}


def _translate(e: grpc.RpcError) -> FlashMapError:
    code = e.code()
    return _BY_CODE.get(code, FlashMapError)(e.details() or str(code), code)


@dataclass
class Chunk:
    """A streamed piece: token ids + text delta, or (finished=True) the final summary."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked: one per token id
    finished: bool = False
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats | None = None
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0
    thinking: str = ""  # a conversation's thinking mode: "on", "off" or "unsupported"

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["stats"] = self.stats.as_dict() if self.stats else None
        d["tool_calls"] = [c.__dict__ for c in self.tool_calls]
        d["logprobs"] = [x.__dict__ for x in self.logprobs]
        return d

    def summary(self) -> str:
        s = self.stats or SpecStats()
        return (
            f"{self.completion_tokens} tokens, finish={self.finish_reason}, mean acceptance length="
            f"{s.mean_acceptance_length:.2f}, rounds={s.rounds}, fallback rounds={s.fallback_rounds}, "
            f"ttft={self.time_to_first_token_s * 1e3:.1f} ms, total={self.total_s:.3f} s"
        )


@dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecStats
    prompt_tokens: int
    time_to_first_token_s: float
    total_s: float
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    thinking: str = ""


def _request(
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    messages: list[dict] | None = None,
    request_id: str = "",
    options: RequestOptions | None = None,
    **fields,
) -> serving_pb2.GenerateRequest:
    """A GenerateRequest: one prompt (text, token ids, or a conversation the server renders with
    the chat template), and the options (flashmap.request_options.RequestOptions: `options`,
    with any of its fields given by name on top)."""
    opts = replace(options or RequestOptions(), **fields)
    req = serving_pb2.GenerateRequest(request_id=request_id)
    prompt_to_proto(Prompt(prompt, prompt_ids, messages), req)
    return options_to_proto(opts, req)


def _chunk(resp: serving_pb2.GenerateResponse) -> Chunk:
    if resp.WhichOneof("kind") == "chunk":
        c = resp.chunk
        return Chunk(
            resp.request_id,
            list(c.token_ids),
            c.text,
            c.reasoning_content,
            [ToolCall(t.id, t.name, t.arguments) for t in c.tool_calls],
            [
                TokenLogprob(x.token_id, x.logprob, list(x.top_ids), list(x.top_logprobs))
                for x in c.logprobs
            ],
        )
    f = resp.final
    return Chunk(
        resp.request_id,
        finished=True,
        finish_reason=f.finish_reason,
        prompt_tokens=f.usage.prompt_tokens,
        completion_tokens=f.usage.completion_tokens,
        stats=stats_from_proto(f.stats),
        time_to_first_token_s=f.time_to_first_token_s,
        total_s=f.total_s,
        thinking=f.thinking,
    )


def _collect(chunks) -> Completion:
    ids, text, reasoning, calls, logprobs = [], [], [], [], []
    for c in chunks:
        if c.finished:
            return Completion(
                c.request_id,
                ids,
                "".join(text),
                c.finish_reason,
                c.stats,
                c.prompt_tokens,
                c.time_to_first_token_s,
                c.total_s,
                "".join(reasoning),
                calls,
                logprobs,
                c.thinking,
            )
        ids.extend(c.token_ids)
        text.append(c.text)
        reasoning.append(c.reasoning_content)
        calls.extend(c.tool_calls)
        logprobs.extend(c.logprobs)
    raise FlashMapError("stream ended without a final message")


_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


def _channel_args(api_key: str | None, tls: bool | str | None):
    """(metadata, channel credentials or None) for a public-API client. api_key None: the
    environment's ($FLASHMAP_API_KEY or its _FILE); tls: True (system roots) or a CA file."""
    key = read_secret(API_KEY_ENV) if api_key is None else api_key
    md = ((API_KEY_HEADER, bearer(key)),) if key else None
    if not tls:
        return md, None
    roots = Path(tls).read_bytes() if isinstance(tls, str) else None
    return md, grpc.ssl_channel_credentials(root_certificates=roots)


class _SyncChannel:
    """A blocking gRPC channel: unary calls with errors translated, closed by `with`."""

    channel: grpc.Channel
    _md: tuple | None
    timeout: float | None = None

    def _unary(self, rpc, req):
        try:
            return rpc(req, timeout=self.timeout or 30.0, metadata=self._md)
        except grpc.RpcError as e:
            raise _translate(e) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client(_SyncChannel):
    def __init__(
        self,
        url: str = "127.0.0.1:50051",
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool | str | None = None,
    ):
        self._md, creds = _channel_args(api_key, tls)
        self.channel = (
            grpc.secure_channel(url, creds, options=_OPTIONS)
            if creds is not None
            else grpc.insecure_channel(url, options=_OPTIONS)
        )
        self.stub = serving_pb2_grpc.FlashMapStub(self.channel)
        self.timeout = timeout

    def generate_stream(self, **kw) -> Iterator[Chunk]:
        call = self.stub.Generate(_request(**kw), timeout=self.timeout, metadata=self._md)
        try:
            for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as e:
            raise _translate(e) from None
        finally:
            call.cancel()  # no-op when finished; frees the server's slot when the caller stops early

    def generate(self, **kw) -> Completion:
        return _collect(self.generate_stream(**kw))

    def abort(self, request_id: str) -> bool:
        return self._unary(self.stub.Abort, serving_pb2.AbortRequest(request_id=request_id)).found

    def model_info(self) -> serving_pb2.ModelInfoResponse:
        return self._unary(self.stub.ModelInfo, serving_pb2.ModelInfoRequest())

    def health(self) -> serving_pb2.HealthResponse:
        return self._unary(self.stub.Health, serving_pb2.HealthRequest())


class AsyncClient:
    def __init__(
        self,
        url: str = "127.0.0.1:50051",
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool | str | None = None,
    ):
        self._md, creds = _channel_args(api_key, tls)
        self.channel = (
            grpc.aio.secure_channel(url, creds, options=_OPTIONS)
            if creds is not None
            else grpc.aio.insecure_channel(url, options=_OPTIONS)
        )
        self.stub = serving_pb2_grpc.FlashMapStub(self.channel)
        self.timeout = timeout

    async def generate_stream(self, **kw) -> AsyncIterator[Chunk]:
        call = self.stub.Generate(_request(**kw), timeout=self.timeout, metadata=self._md)
        try:
            async for resp in call:
                yield _chunk(resp)
        except grpc.aio.AioRpcError as e:
            raise _translate(e) from None
        finally:
            call.cancel()

    async def generate(self, **kw) -> Completion:
        return _collect([c async for c in self.generate_stream(**kw)])

    async def _unary(self, rpc, req):
        try:
            return await rpc(req, timeout=self.timeout or 30.0, metadata=self._md)
        except grpc.aio.AioRpcError as e:
            raise _translate(e) from None

    async def abort(self, request_id: str) -> bool:
        return (
            await self._unary(self.stub.Abort, serving_pb2.AbortRequest(request_id=request_id))
        ).found

    async def model_info(self) -> serving_pb2.ModelInfoResponse:
        return await self._unary(self.stub.ModelInfo, serving_pb2.ModelInfoRequest())

    async def health(self) -> serving_pb2.HealthResponse:
        return await self._unary(self.stub.Health, serving_pb2.HealthRequest())

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class DrafterAdmin(_SyncChannel):
    """Run-time control of the drafter service: the step count (1 or 2 jumps, or N) and its state."""

    def __init__(self, url: str = "127.0.0.1:50052", token: str | None = None):
        """token: the drafter's shared token (default: $FLASHMAP_DRAFTER_TOKEN, its _FILE, or the
        one `flashmap up` left for this user)."""
        self.channel = grpc.insecure_channel(url)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        token = read_secret(DRAFTER_TOKEN_ENV, DRAFTER_TOKEN_LOCAL) if token is None else token
        self._md = ((DRAFTER_TOKEN_HEADER, token),) if token else None

    def get_steps(self) -> int:
        return self._unary(self.stub.GetSteps, drafter_pb2.GetStepsRequest()).steps

    def set_steps(self, steps: int) -> int:
        return self._unary(self.stub.SetSteps, drafter_pb2.SetStepsRequest(steps=steps)).steps

    def stats(self) -> drafter_pb2.StatsResponse:
        return self._unary(self.stub.Stats, drafter_pb2.StatsRequest())
