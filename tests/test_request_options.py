"""A request's options are defined once (flashmap.request_options.RequestOptions) and every
front carries every one of them: `flashmap generate`'s flags, the SDK's keyword arguments and
GenerateRequest (both ways), and the OpenAI API's body. Each option gets a value other than its
default and must come out of each front as that value, so an option a front forgets fails here.

The dict and list-of-dicts options (chat_template_kwargs, tools) cross as JSON; an extension of
RequestOptions with more of that shape crosses the same generic functions: a new option needs
its field (and a GenerateRequest field) and nothing in the fronts."""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import dataclass, fields, replace

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from flashmap.client import _request
from flashmap.config import add_arguments, from_args, to_argv
from flashmap.request_options import (
    Prompt,
    RequestOptions,
    request_fields,
    request_option,
    value_kind,
)
from flashmap.request_proto import (
    options_from_proto,
    options_to_proto,
    prompt_from_proto,
    prompt_to_proto,
)
from flashmap.types import InvalidRequest
from flashmap.v1 import serving_pb2
from orchestrator.openai_api.protocol import (
    ChatRequest,
    CompletionRequest,
    body_name,
    options_model,
    options_of,
)

SAMPLE = {int: 3, float: 0.5, bool: True, str: "s"}  # valid for every option, none a default
SAMPLE_OF = {"tool_choice": "none"}  # options whose checks take few values


def sample(cls: type, f) -> object:
    """A value of option f other than its default."""
    if f.name in SAMPLE_OF:
        return SAMPLE_OF[f.name]
    kind, t = value_kind(cls, f.name)
    if kind == "scalar":
        return SAMPLE[t]
    if kind == "list":
        return [SAMPLE[t], SAMPLE[t]]
    return [{"k": [1, "x"]}] if typing.get_origin(t) is list else {"k": [1, "x"]}


def samples(cls: type = RequestOptions) -> dict:
    return {f.name: sample(cls, f) for f, _ in request_fields(cls)}


def test_every_option_has_a_sample_other_than_its_default():
    values = samples()
    default = RequestOptions()
    assert set(values) == {f.name for f in fields(RequestOptions)}
    for name, value in values.items():
        assert getattr(default, name) != value, name
    RequestOptions(**values).validate()


@pytest.mark.parametrize("name", sorted(samples()))
def test_each_option_crosses_every_front(name):
    value = samples()[name]
    want = RequestOptions(**{name: value})

    # `flashmap generate`: its flag (the parser the CLI builds), and the flags that make it.
    from flashmap_cli.main import build_parser

    ns = build_parser().parse_args(["generate", *to_argv(want)])
    assert from_args(RequestOptions, ns) == want

    # The SDK's keyword argument, into a GenerateRequest and read back as the server does.
    msg = _request(prompt_ids=[1, 2], **{name: value})
    assert options_from_proto(serving_pb2.GenerateRequest.FromString(msg.SerializeToString())) == (
        want
    )

    # The OpenAI API: the body field, on both endpoints.
    (crossing,) = [c for f, c in request_fields() if f.name == name]
    field_name = body_name(next(f for f in fields(RequestOptions) if f.name == name), crossing)
    body = CompletionRequest(prompt="hi", **{field_name: value})
    assert getattr(body.to_options(), name) == value
    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}], **{field_name: value})
    assert getattr(chat.to_options(), name) == value


def test_openai_defaults_and_one_value_for_a_list():
    """Left out: OpenAI's default where it differs (temperature 1; max_tokens 16 for
    completions, the rest of the context for chat); max_completion_tokens wins over max_tokens;
    a list option takes one value; top_k -1 is off."""
    c = CompletionRequest(prompt="hi").to_options()
    assert (c.temperature, c.max_new_tokens) == (1.0, 16)
    assert replace(c, temperature=0.0, max_new_tokens=64) == RequestOptions()
    messages = [{"role": "user", "content": "hi"}]
    assert ChatRequest(messages=messages).to_options().max_new_tokens is None
    chat = ChatRequest(messages=messages, max_tokens=5, max_completion_tokens=7, stop="\n")
    assert chat.to_options().max_new_tokens == 7 and chat.to_options().stop == ["\n"]
    assert CompletionRequest(prompt="x", top_k=-1).to_options().to_sampling_params().top_k == 0


def test_prompts_cross_grpc():
    for prompt in (
        Prompt(text="hello"),
        Prompt(token_ids=[1, 2, 3]),
        Prompt(token_ids=[]),
        Prompt(messages=[{"role": "user", "content": "hi"}]),
        Prompt(messages=[]),
        Prompt(  # a tool round trip: the call, its answer
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "They ask about Paris.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
            ]
        ),
    ):
        msg = prompt_to_proto(prompt, serving_pb2.GenerateRequest())
        assert prompt_from_proto(
            serving_pb2.GenerateRequest.FromString(msg.SerializeToString())
        ) == (prompt)


def test_logprobs_tools_and_tool_choice_mean_what_openai_means():
    """top_logprobs needs logprobs; logprobs asks the target for the top n (None: nothing);
    completions' logprobs=n is the top n; a named or "required" tool choice needs constrained
    decoding and is refused with a message that says so."""
    from orchestrator.openai_api.protocol import ApiError

    ok = dict(vocab_size=100, max_seq_len=128)
    with pytest.raises(InvalidRequest, match="top_logprobs needs logprobs"):
        RequestOptions(top_logprobs=2).to_request([1], **ok)
    assert RequestOptions().to_request([1], **ok).logprobs is None
    assert RequestOptions(logprobs=True).to_request([1], **ok).logprobs == 0
    assert RequestOptions(logprobs=True, top_logprobs=5).to_request([1], **ok).logprobs == 5
    with pytest.raises(InvalidRequest, match="top_logprobs must be in 0..20"):
        RequestOptions(logprobs=True, top_logprobs=21).validate()
    c = CompletionRequest(prompt="x", logprobs=3).to_options()
    assert (c.logprobs, c.top_logprobs) == (True, 3)
    messages = [{"role": "user", "content": "hi"}]
    chat = ChatRequest(messages=messages, logprobs=True, top_logprobs=2).to_options()
    assert (chat.logprobs, chat.top_logprobs) == (True, 2)
    named = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(ApiError, match="named function needs constrained decoding"):
        ChatRequest(messages=messages, tool_choice=named).to_options()
    with pytest.raises(InvalidRequest, match='"required" needs constrained decoding'):
        RequestOptions(tool_choice="required").validate()
    with pytest.raises(InvalidRequest, match="tools must be a list of JSON objects"):
        RequestOptions(tools=["f"]).validate()
    with pytest.raises(InvalidRequest, match="'messages' is set by the server"):
        RequestOptions(chat_template_kwargs={"messages": []}).validate()
    # Over gRPC the JSON options are JSON text.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msg = _request(messages=messages, tools=tools, chat_template_kwargs={"enable_thinking": False})
    assert (
        json.loads(msg.tools) == tools and msg.chat_template_kwargs == '{"enable_thinking": false}'
    )


def test_a_missing_max_new_tokens_on_grpc_is_refused_as_before():
    options = options_from_proto(serving_pb2.GenerateRequest(temperature=0.5))
    with pytest.raises(InvalidRequest, match="max_new_tokens must be > 0, got 0"):
        options.to_request([1, 2], vocab_size=10, max_seq_len=20)


def test_options_are_checked_with_the_one_message_of_each_limit():
    ok = dict(vocab_size=100, max_seq_len=64)
    for bad, message in [
        (dict(temperature=-2.0), "temperature must be >= 0, got -2.0"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_k=-2), "top_k must be in [-1, 2^31)"),
        (dict(seed=-3), "seed must be in [0, 2**64)"),
        (dict(draft_steps=0), "draft_steps must be in 1..64, got 0"),
        (dict(max_draft_tokens=-1), "max_draft_tokens must be >= 0"),
        (dict(max_new_tokens=0), "max_new_tokens must be > 0, got 0"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            RequestOptions(**bad).to_request([1, 2], **ok)
        assert message in str(e.value)
    gen = RequestOptions(max_new_tokens=None, stop_token_ids=[7], top_k=-1).to_request(
        [1, 2], eos_token_ids=[9], **ok
    )
    assert gen.max_new_tokens == 62 and set(gen.stop_token_ids) == {7, 9}
    assert gen.params.top_k == 0


# --------------------------------------------------------------------------- an extension


@dataclass(frozen=True, kw_only=True)
class Extended(RequestOptions):
    response_format: dict = request_option(help="a JSON schema", default_factory=dict)
    documents: list[dict] = request_option(help="documents to cite", default_factory=list)
    min_tokens: int | None = request_option(None, "tokens to generate at least")


def _extended_request_class():
    """GenerateRequest plus the extension's fields (the JSON ones as strings), as serving.proto
    would declare them."""
    pool = descriptor_pool.DescriptorPool()
    base = descriptor_pb2.FileDescriptorProto()
    serving_pb2.DESCRIPTOR.CopyToProto(base)
    pool.Add(base)
    ext = descriptor_pb2.FileDescriptorProto(
        name="test/extended.proto", package="test", syntax="proto3", dependency=[base.name]
    )
    msg = ext.message_type.add()
    serving_pb2.GenerateRequest.DESCRIPTOR.CopyToProto(msg)
    msg.name = "ExtendedRequest"
    string, optional = descriptor_pb2.FieldDescriptorProto.TYPE_STRING, 1
    msg.field.add(name="response_format", number=100, type=string, label=optional)
    msg.field.add(name="documents", number=101, type=string, label=optional)
    msg.oneof_decl.add(name="_min_tokens")
    msg.field.add(
        name="min_tokens",
        number=102,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
        label=optional,
        proto3_optional=True,
        oneof_index=len(msg.oneof_decl) - 1,
    )
    pool.Add(ext)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("test.ExtendedRequest"))


def test_dict_and_list_valued_options_need_no_front_of_their_own():
    values = samples(Extended)
    assert values["response_format"] == {"k": [1, "x"]} and values["documents"][0] == {
        "k": [1, "x"]
    }
    want = Extended(**values)

    parser = argparse.ArgumentParser()
    add_arguments(parser, Extended)
    assert from_args(Extended, parser.parse_args(to_argv(want))) == want
    assert from_args(Extended, parser.parse_args([])) == Extended()

    cls = _extended_request_class()
    msg = options_to_proto(want, cls())
    assert options_from_proto(cls.FromString(msg.SerializeToString()), Extended) == want
    assert options_from_proto(cls(), Extended).response_format == {}  # unset: the default
    with pytest.raises(InvalidRequest, match="documents must be JSON"):
        options_from_proto(cls(documents="[{"), Extended)

    model = options_model(Extended)
    body = {body_name(f, c): values[f.name] for f, c in request_fields(Extended)}
    assert options_of(model(**body), Extended) == want
    assert options_of(model(), Extended).min_tokens is None
