"""Thinking, tools and log-probabilities through the real stack (Triton, the drafter service with
the untrained FlashMap drafter, the orchestrator as processes), driven by the official `openai`
client, the client SDK and `flashmap generate`.

The target is a tiny Qwen3 carrying Qwen3's own chat template and its think / tool-call tokens,
scripted (target_service.random_checkpoint.script_next_tokens) so that its greedy answer after
the assistant's turn thinks, answers and calls a tool:

    <think>Let me think.</think>\\n\\nThe answer is 4.
    <tool_call>\\n{"name": "get_weather", ...}\\n</tool_call><|im_end|>    (one line)

and with thinking off (the template closes an empty think block) answers and calls the tool
without thinking. Speculation is on for every request ("full"); the answers' token ids equal
the target alone's (stack_helpers.Reference, near-ties ruled out), so the split into reasoning,
answer and tool calls is of the target's own text, and the log-probabilities equal
transformers' log-softmax over the same text, at T = 0 and at T > 0 with a seed.
"""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch

from flashmap_cli.stack import Stack, StackConfig
from tests.stack_helpers import Reference, one_thread_per_process  # noqa: F401 - autouse fixture

CALL_JSON = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
SCRIPT = [
    ("\n", "<think>"),
    ("<think>", "Let me think."),
    ("Let me think.", "</think>"),
    ("</think>", "\n\n"),
    ("\n\n", "The answer is 4."),
    ("The answer is 4.", "<tool_call>"),
    ("<tool_call>", CALL_JSON),
    (CALL_JSON, "</tool_call>"),
    ("</tool_call>", "<|im_end|>"),
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is 2 + 2, and the weather in Paris?"}]
ARGUMENTS = {"city": "Paris"}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from target_service.random_checkpoint import make_random_qwen3

    return make_random_qwen3(
        tmp_path_factory.mktemp("qwen3-chat") / "tiny-qwen3-chat",
        seed=5,
        chat_template="qwen3",
        added_tokens=["\n\n", "Let me think.", "The answer is 4.", CALL_JSON],
        script=SCRIPT,
    )


@pytest.fixture(scope="module")
def stack(target_dir, tmp_path_factory):
    cfg = StackConfig.on_free_ports(
        target_dir=str(target_dir),
        n_slots=4,
        max_seq_len=1024,
        speculation="full",
        log_dir=str(tmp_path_factory.mktemp("logs-openai-chat")),
    )
    with Stack(cfg) as st:
        yield st


@pytest.fixture(scope="module")
def oai(stack):
    with openai.OpenAI(
        base_url=stack.cfg.http_url, api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


@pytest.fixture(scope="module")
def hf(target_dir):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(target_dir), model


@pytest.fixture(scope="module")
def ref(target_dir):
    return Reference(target_dir)


def _prompt_ids(hf, messages, tools=None, **kwargs) -> list[int]:
    tok, _ = hf
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def _chat(oai, stream=False, **kw):
    body = dict(model="tiny-qwen3-chat", messages=MESSAGES, temperature=0, max_tokens=64) | kw
    extra = {"return_token_ids": True} | body.pop("extra_body", {})
    return oai.chat.completions.create(**body, stream=stream, extra_body=extra)


def _streamed(chunks) -> dict:
    """A streamed chat answer joined: content, reasoning, tool calls (by index), ids, logprobs."""
    out = {"content": "", "reasoning": "", "calls": {}, "ids": [], "logprobs": [], "finish": None}
    for ch in chunks:
        (c,) = ch.choices
        d = c.delta
        out["content"] += d.content or ""
        out["reasoning"] += getattr(d, "reasoning_content", None) or ""
        for t in d.tool_calls or ():
            call = out["calls"].setdefault(t.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += t.id or ""
            call["name"] += t.function.name or ""
            call["arguments"] += t.function.arguments or ""
        out["ids"] += c.token_ids
        if c.logprobs is not None:
            out["logprobs"] += c.logprobs.content
        out["finish"] = c.finish_reason or out["finish"]
    out["thinking"] = chunks[0].model_extra.get("thinking")
    return out


@pytest.mark.timeout(300)
def test_the_template_says_what_it_supports(stack, oai):
    from flashmap.client import Client

    (card,) = oai.models.list().data
    assert card.model_extra["chat_template"] == {"template": True, "thinking": True, "tools": True}
    with Client(stack.cfg.url, timeout=60) as c:
        info = c.model_info()
    assert info.chat_template and info.chat_thinking and info.chat_tools


@pytest.mark.timeout(300)
@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_and_tool_calls_whole_and_streamed(oai, hf, ref, thinking):
    """Thinking on: the reasoning comes apart from the answer; off: no reasoning. The tool call
    is parsed in both, whole and streamed alike; the ids are the target alone's."""
    kwargs = {} if thinking else {"enable_thinking": False}
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    prompt = _prompt_ids(hf, MESSAGES, TOOLS, **kwargs)
    r = _chat(oai, tools=TOOLS, extra_body=extra)
    (c,) = r.choices
    assert c.prompt_token_ids == prompt
    assert r.model_extra["thinking"] == ("on" if thinking else "off")
    assert c.finish_reason == "tool_calls"
    assert c.message.reasoning_content == ("Let me think." if thinking else None)
    assert c.message.content == ("\n\n" if thinking else "") + "The answer is 4."
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS and call.id.startswith("call_")
    # Greedy and speculative: the target alone's tokens (run on past the end of the turn).
    (exp,) = ref([prompt], len(c.token_ids))
    assert c.token_ids == exp
    assert r.model_extra["flashmap"]["drafts"] > 0, "not speculative"

    s = _streamed(list(_chat(oai, stream=True, tools=TOOLS, extra_body=extra)))
    assert s["thinking"] == r.model_extra["thinking"] and s["ids"] == c.token_ids
    assert (s["content"], s["reasoning"] or None) == (
        c.message.content,
        c.message.reasoning_content,
    )
    assert [(x["name"], json.loads(x["arguments"])) for x in s["calls"].values()] == [
        ("get_weather", ARGUMENTS)
    ]
    assert s["finish"] == "tool_calls"


@pytest.mark.timeout(300)
def test_without_tools_or_with_tool_choice_none_the_call_stays_text(oai, hf):
    plain = _chat(oai).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "stop"
    assert plain.message.content.startswith("\n\nThe answer is 4.<tool_call>")
    assert plain.prompt_token_ids == _prompt_ids(hf, MESSAGES)
    none = _chat(oai, tools=TOOLS, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content == plain.message.content
    assert none.prompt_token_ids == _prompt_ids(hf, MESSAGES, TOOLS)  # rendered all the same


@pytest.mark.timeout(300)
def test_a_tool_round_trip_renders_as_transformers(oai, hf):
    """The assistant's call (arguments as JSON text, as the openai client sends them) and the
    tool's answer go back into the template as transformers renders them."""
    first = _chat(oai, tools=TOOLS).choices[0].message
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": first.content,
            "reasoning_content": first.reasoning_content,
            "tool_calls": [t.model_dump() for t in first.tool_calls],
        },
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    r = _chat(oai, messages=history, tools=TOOLS, max_tokens=4)
    as_hf = [
        {
            **m,
            "tool_calls": [
                {**t, "function": {**t["function"], "arguments": ARGUMENTS}}
                for t in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in history
    ]
    assert r.choices[0].prompt_token_ids == _prompt_ids(hf, as_hf, TOOLS)


def _teacher_forced(hf, prompt, out) -> torch.Tensor:
    _, model = hf
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out]), use_cache=False).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) + len(out) - 1]


def _assert_logprobs(hf, prompt, ids, entries, top):
    tok, _ = hf
    ref = _teacher_forced(hf, prompt, ids)
    assert len(entries) == len(ids)
    want = ref.gather(1, torch.tensor(ids)[:, None])[:, 0].numpy()
    np.testing.assert_allclose([e.logprob for e in entries], want, atol=1e-4)
    top_lp, top_ids = ref.topk(top, dim=-1)
    for j, e in enumerate(entries):
        assert e.token == tok.decode(
            [ids[j]], clean_up_tokenization_spaces=False
        ) and e.bytes == list(e.token.encode())
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], top_lp[j], atol=1e-4)
        assert [t.token for t in e.top_logprobs] == [
            tok.decode([t], clean_up_tokenization_spaces=False) for t in top_ids[j]
        ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_targets_whole_and_streamed(oai, hf, temperature):
    """Each token's log-probability and the top 3 equal transformers' over the same text, under
    speculation, at T = 0 and at T = 1 with a seed."""
    kw = dict(
        tools=TOOLS,
        temperature=temperature,
        seed=7,
        logprobs=True,
        top_logprobs=3,
        max_tokens=24,
        extra_body={"ignore_eos": True},
    )
    prompt = _prompt_ids(hf, MESSAGES, TOOLS)
    r = _chat(oai, **kw)
    (c,) = r.choices
    _assert_logprobs(hf, prompt, c.token_ids, c.logprobs.content, 3)
    assert r.model_extra["flashmap"]["drafts"] > 0
    s = _streamed(list(_chat(oai, stream=True, **kw)))
    if temperature == 0:  # at T > 0 a draft that came late would draw the seeds otherwise
        assert s["ids"] == c.token_ids
    _assert_logprobs(hf, prompt, s["ids"], s["logprobs"], 3)


@pytest.mark.timeout(300)
def test_completions_logprobs(oai, hf):
    """Completions' logprobs=n: tokens, their log-probabilities, the top n and text offsets."""
    tok, _ = hf
    prompt = _prompt_ids(hf, MESSAGES)
    r = oai.completions.create(
        model="tiny-qwen3-chat",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    (c,) = r.choices
    ref = _teacher_forced(hf, prompt, c.token_ids)
    lp = c.logprobs
    assert lp.tokens == [tok.decode([t], clean_up_tokenization_spaces=False) for t in c.token_ids]
    want = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(lp.token_logprobs, want, atol=1e-4)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


@pytest.mark.timeout(300)
def test_the_sdk_and_the_cli_get_the_same(stack, oai, capsys):
    from flashmap.client import Client
    from flashmap_cli.main import main

    want = _chat(oai, tools=TOOLS, logprobs=True).choices[0]
    with Client(stack.cfg.url, timeout=60) as c:
        out = c.generate(messages=MESSAGES, tools=TOOLS, max_new_tokens=64, logprobs=True)
    assert out.thinking == "on" and out.token_ids == want.token_ids
    assert (out.reasoning_content, out.text) == (
        want.message.reasoning_content,
        want.message.content,
    )
    assert [(t.name, json.loads(t.arguments)) for t in out.tool_calls] == [
        ("get_weather", ARGUMENTS)
    ]
    np.testing.assert_allclose(
        [x.logprob for x in out.logprobs], [e.logprob for e in want.logprobs.content], atol=1e-6
    )
    args = ["generate", "--url", stack.cfg.url, "--chat", MESSAGES[0]["content"], "--json"]
    args += [
        "--tools",
        json.dumps(TOOLS[0]),
        "--chat-template-kwargs",
        '{"enable_thinking": false}',
    ]
    assert main([*args, "--max-new-tokens", "64", "--logprobs", "--top-logprobs", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["thinking"] == "off" and got["reasoning_content"] == ""
    assert got["text"] == "The answer is 4." and got["tool_calls"][0]["name"] == "get_weather"
    assert len(got["logprobs"]) == len(got["token_ids"]) and len(got["logprobs"][0]["top_ids"]) == 2


@pytest.mark.timeout(300)
def test_what_cannot_be_honoured_is_refused(oai):
    cases = [
        (dict(tool_choice="required", tools=TOOLS), "constrained decoding", None),
        (
            dict(
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, tools=TOOLS
            ),
            "constrained decoding",
            "tool_choice",
        ),
        (dict(top_logprobs=2), "top_logprobs needs logprobs", None),
        (dict(logprobs=True, top_logprobs=30), "top_logprobs must be in 0..20", None),
        (dict(tools=[{"type": "function", "function": {}}]), "needs a name", None),
        (dict(extra_body={"chat_template_kwargs": {"messages": 1}}), "set by the server", None),
    ]
    for kw, words, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(oai, **kw)
        assert words in e.value.body["message"] and e.value.body["param"] == param, kw
    with pytest.raises(openai.BadRequestError, match="go with a conversation"):
        oai.completions.create(model="tiny-qwen3-chat", prompt="hi", extra_body={"tools": TOOLS})
