"""The OpenAI API's protocol: the request bodies and their mapping onto a Prompt and
RequestOptions, the error shape, and the response and chunk shapes.

The generation fields of a body come from flashmap.request_options.RequestOptions, one body
field per option under OpenAI's name where it has one (`max_tokens`) and the option's own
otherwise; those OpenAI lacks (top_k, ignore_eos, stop_token_ids, draft_steps,
max_draft_tokens, ...) are the extensions a client sends in `extra_body`. A field the body
leaves out (or sends as null) takes OpenAI's default where it differs (temperature 1; max_tokens
16 for completions, the rest of the context for chat), else the option's. A list option takes
one value too (`"stop": "\\n"`). The rest are OpenAI's own: model, n, stream, stream_options,
return_token_ids (token ids in each choice and chunk, as vLLM names it) and the fields accepted
at their neutral value only.
"""

from __future__ import annotations

import json
import time
import typing
from dataclasses import replace
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, create_model

from flashmap.request_options import (
    OWN_DEFAULT,
    Prompt,
    RequestOptions,
    request_fields,
    value_kind,
)

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


class _OpenAIFields(BaseModel):
    """The fields of both endpoints that are OpenAI's alone. None = OpenAI's default."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # optional here: the one served model
    n: int | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False


def body_name(f, crossing) -> str:
    return crossing.openai or f.name


def _body_type(cls: type, name: str) -> Any:
    """An option's type in a body: a list of scalars takes one value too; None: left out."""
    kind, t = value_kind(cls, name)
    if kind == "list":
        return t | list[t] | None
    hint = typing.get_type_hints(cls)[name]
    return hint | None


def options_model(cls: type = RequestOptions) -> type[BaseModel]:
    """The body fields of cls's options (all optional) on top of OpenAI's own."""
    derived = {
        body_name(f, c): (_body_type(cls, f.name), None)
        for f, c in request_fields(cls)
        if c.openai is not None
    }
    return create_model("SamplingBody", __base__=_OpenAIFields, **derived)


_Sampling = options_model()


def options_of(body: BaseModel, cls: type = RequestOptions, **defaults) -> RequestOptions:
    """The options a body asks for. defaults: this endpoint's values for options the body leaves
    out, before OpenAI's (Crossing.openai_default) and the option's own."""
    values = {}
    for f, c in request_fields(cls):
        if c.openai is None:
            continue
        value = getattr(body, body_name(f, c))
        if value is None:
            if f.name in defaults:
                value = defaults[f.name]
            elif c.openai_default is not OWN_DEFAULT:
                value = c.openai_default
            else:
                continue
        elif value_kind(cls, f.name)[0] == "list" and not isinstance(value, list):
            value = [value]
        values[f.name] = value
    return cls(**values)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def to_prompt(self) -> Prompt:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"one prompt per request, got {len(p)}", param="prompt")
            p = p[0]
        return Prompt(text=p) if isinstance(p, str) else Prompt(token_ids=p)

    def to_options(self) -> RequestOptions:
        return options_of(self, max_new_tokens=16)  # OpenAI's default for completions


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

    def to_prompt(self) -> Prompt:
        return Prompt(
            messages=[
                {"role": m.role, "content": _message_text(m, i)}
                for i, m in enumerate(self.messages)
            ]
        )

    def to_options(self) -> RequestOptions:
        options = options_of(self, max_new_tokens=None)  # None: the rest of the context
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            options = replace(options, max_new_tokens=self.max_completion_tokens)
        return options


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


def check_supported(body: _Sampling) -> None:
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


def dumps(obj: Any) -> str:
    # numpy scalars can reach the stats; everything else is plain JSON
    return json.dumps(
        obj,
        ensure_ascii=False,
        separators=(",", ":"),
        default=lambda o: o.item() if hasattr(o, "item") else str(o),
    )


class Shape:
    """OpenAI's JSON for one endpoint: whole responses and streamed chunks, completions or chat.
    Responses carry the request's speculative statistics under "flashmap" (streamed: in the
    chunk that has the finish_reason)."""

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
