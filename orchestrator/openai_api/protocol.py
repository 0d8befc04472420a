"""The OpenAI API's protocol: the request bodies and their mapping onto a Prompt and
RequestOptions, and the error shape (the answers' shapes: orchestrator.openai_api.responses).

The generation fields of a body come from flashmap.request_options.RequestOptions, one body
field per option under OpenAI's name where it has one (`max_tokens`) and the option's own
otherwise; those OpenAI lacks (top_k, ignore_eos, stop_token_ids, draft_steps,
max_draft_tokens, ...) are the extensions a client sends in `extra_body`. A field the body
leaves out (or sends as null) takes OpenAI's default where it differs (temperature 1; max_tokens
16 for completions, the rest of the context for chat), else the option's. A list option takes
one value too (`"stop": "\\n"`). The rest are OpenAI's own: model, n, stream, stream_options,
return_token_ids (token ids in each choice and chunk, as vLLM names it) and the fields accepted
at their neutral value only. Chat takes OpenAI's tools, tool_choice ("auto", "none"; "required"
and a named function need constrained decoding and are refused), logprobs and top_logprobs, and
vLLM's chat_template_kwargs; completions take OpenAI's `logprobs: n` (the top n).

In the answers, a chat message carries `reasoning_content` (vLLM's name) when the chat template
thinks, `tool_calls` when the model called tools (finish_reason "tool_calls"), and a chat
response says which thinking mode ran (`thinking`: "on", "off", or "unsupported"; streamed: in
the first chunk). Log-probabilities are the target's raw distribution's (before temperature,
top-k and top-p), from the verify pass: exact under speculation.
"""

from __future__ import annotations

import json
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
    parallel_tool_calls: bool | None = None
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
    logprobs: int | None = None  # OpenAI's completions: the top n (and each token's own)

    def to_prompt(self) -> Prompt:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"one prompt per request, got {len(p)}", param="prompt")
            p = p[0]
        return Prompt(text=p) if isinstance(p, str) else Prompt(token_ids=p)

    def to_options(self) -> RequestOptions:
        options = options_of(self, max_new_tokens=16)  # OpenAI's default for completions
        if self.logprobs is not None:
            if self.top_logprobs not in (None, self.logprobs):
                raise ApiError(
                    400, "completions take logprobs=n (the top n), not top_logprobs", "top_logprobs"
                )
            options = replace(options, logprobs=True, top_logprobs=int(self.logprobs))
        return options


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # refusal: null, audio: null ... from clients
    role: str
    content: str | list[_ContentPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[_Message]
    max_completion_tokens: int | None = None
    tool_choice: str | dict | None = None  # OpenAI's named function too: refused, clearly

    def to_prompt(self) -> Prompt:
        messages = []
        for i, m in enumerate(self.messages):
            msg = {"role": m.role, "content": _message_text(m, i)}
            for key in ("reasoning_content", "tool_calls", "tool_call_id", "name"):
                if getattr(m, key):
                    msg[key] = getattr(m, key)
            messages.append(msg)
        return Prompt(messages=messages)

    def to_options(self) -> RequestOptions:
        choice = self.tool_choice
        if isinstance(choice, dict):
            raise ApiError(
                400,
                "tool_choice: a named function needs constrained decoding, which this server "
                'does not do (it decodes the target\'s own distribution): use "auto" or "none"',
                param="tool_choice",
            )
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
    "parallel_tool_calls": (None, True),  # the model makes the calls it makes
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
