"""A request's prompt and options on gRPC (GenerateRequest), both ways: the orchestrator reads
one (orchestrator.grpc_api), the client SDK writes one (flashmap.client).

Options map field by field onto GenerateRequest fields of the same name
(flashmap.request_options: the one definition). An optional proto field that is unset, and an
empty JSON text, leave the option at its default; a field without presence (proto3's plain
scalars) is read as it is, so a GenerateRequest without max_new_tokens asks for 0 tokens and is
refused, as the proto says."""

from __future__ import annotations

import json

from flashmap.request_options import (
    Prompt,
    RequestOptions,
    field_default,
    request_fields,
    value_kind,
)
from flashmap.types import InvalidRequest


def options_from_proto(msg, cls: type = RequestOptions) -> RequestOptions:
    """cls (RequestOptions or an extension of it) from a GenerateRequest (unchecked: the
    caller's RequestOptions.validate / to_request checks it)."""
    values = {}
    for f, crossing in request_fields(cls):
        if crossing.proto is None:
            continue
        name = crossing.proto or f.name
        fd = msg.DESCRIPTOR.fields_by_name[name]
        kind, _ = value_kind(cls, f.name)
        if fd.is_repeated:
            values[f.name] = list(getattr(msg, name))
        elif fd.has_presence and not msg.HasField(name):
            continue
        elif kind == "json":
            text = getattr(msg, name)
            if not text:
                continue
            try:
                values[f.name] = json.loads(text)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"{name} must be JSON text: {e}") from None
        else:
            values[f.name] = getattr(msg, name)
    return cls(**values)


def options_to_proto(options: RequestOptions, msg):
    """Write options into a GenerateRequest (None: the field stays unset); returns msg."""
    cls = type(options)
    for f, crossing in request_fields(cls):
        value = getattr(options, f.name)
        if crossing.proto is None or value is None:
            continue
        name = crossing.proto or f.name
        kind, _ = value_kind(cls, f.name)
        if kind == "json":
            if value != field_default(f):
                setattr(msg, name, json.dumps(value, ensure_ascii=False))
        elif msg.DESCRIPTOR.fields_by_name[name].is_repeated:
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


_MESSAGE_TEXTS = ("reasoning_content", "tool_call_id", "name")  # ChatMessage's optional texts


def prompt_from_proto(msg) -> Prompt:
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        return Prompt(text=msg.text)
    if kind == "token_ids":
        return Prompt(token_ids=list(msg.token_ids.ids))
    if kind == "messages":
        return Prompt(
            messages=[_message_from_proto(m, i) for i, m in enumerate(msg.messages.messages)]
        )
    return Prompt()


def _message_from_proto(m, i: int) -> dict:
    """A ChatMessage as a message dict: its optional fields only when set."""
    out = {"role": m.role, "content": m.content}
    out.update({k: getattr(m, k) for k in _MESSAGE_TEXTS if getattr(m, k)})
    if m.tool_calls:
        try:
            out["tool_calls"] = json.loads(m.tool_calls)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"messages[{i}].tool_calls must be JSON text: {e}") from None
    return out


def _message_to_proto(m: dict, out) -> None:
    out.role, out.content = m["role"], m.get("content") or ""
    for k in _MESSAGE_TEXTS:
        if m.get(k):
            setattr(out, k, m[k])
    if m.get("tool_calls"):
        out.tool_calls = json.dumps(m["tool_calls"], ensure_ascii=False)


def prompt_to_proto(prompt: Prompt, msg):
    """Write the prompt into a GenerateRequest's oneof; returns msg."""
    if prompt.token_ids is not None:
        msg.token_ids.SetInParent()  # no ids are still ids (the server refuses them)
        msg.token_ids.ids.extend(int(t) for t in prompt.token_ids)
    elif prompt.messages is not None:
        msg.messages.SetInParent()  # an empty conversation is still a conversation
        for m in prompt.messages:
            _message_to_proto(m, msg.messages.messages.add())
    elif prompt.text is not None:
        msg.text = prompt.text
    return msg
