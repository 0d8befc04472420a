"""The chat template rendered without transformers (flashmap.tokenizer.ChatTemplate) gives
the text transformers' apply_chat_template gives: for the demo target's ChatML template, for a
template in the style of Qwen3's (namespace, loop variables, tojson, raise_exception) and for
Qwen3's own (tools, tool calls and answers, reasoning, enable_thinking); and what it refuses, it
refuses with InvalidRequest. What a template supports and the thinking mode it leaves the model
in; and the output read back (flashmap.chat.ChatReader) into answer, reasoning and tool calls,
the same whole and in any pieces."""

from __future__ import annotations

import json

import pytest

from flashmap.tokenizer import ChatTemplate, TextTokenizer
from flashmap.types import InvalidRequest
from flashmap_cli.stack import DEMO_TARGET
from target_service.random_checkpoint import QWEN3_CHAT_TEMPLATE

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    [{"role": "user", "content": 'unicode: \u00e9\u4e2d\U0001f600 and <tags> & "quotes"'}],
]

# Shaped like Qwen3's template: a namespace carried through a reversed loop, loop.last,
# string tests, raise_exception, and whitespace control that relies on trim_blocks.
QWEN_STYLE = """{%- if messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == 'user' and not message.content.startswith('<tool_response>') and ns.last_query == -1 %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role not in ('system', 'user', 'assistant') %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- elif message.role != 'system' or not loop.first %}
{{ '<|im_start|>' + message.role }}
{% if loop.index0 == ns.last_query %}{{ '[last query] ' }}{% endif %}{{ message.content }}<|im_end|>
    {%- if loop.last %}{{ '\\n' }}{% endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"""


def _hf(template: str):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()), chat_template=template, eos_token="<|im_end|>"
    )


@pytest.mark.parametrize("source", ["demo", "qwen-style"])
def test_rendering_equals_transformers(source):
    if source == "demo":
        ours, hf = TextTokenizer(DEMO_TARGET).chat_template, None
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(DEMO_TARGET)
    else:
        ours, hf = ChatTemplate(QWEN_STYLE, {"eos_token": "<|im_end|>"}), _hf(QWEN_STYLE)
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            want = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert ours.render(msgs, gen) == want, (msgs, gen)


def test_tojson_does_not_escape_html():
    t = ChatTemplate("{{ messages | tojson }}")
    msgs = [{"role": "user", "content": "<b>&</b> \u00e9"}]
    assert t.render(msgs, False) == json.dumps(msgs, ensure_ascii=False)


def test_refusals_are_invalid_request(tmp_path):
    t = ChatTemplate(QWEN_STYLE)
    with pytest.raises(InvalidRequest, match="chat template: unknown role tool"):
        t.render([{"role": "tool", "content": "x"}])
    for bad in ([], "hi", [{"role": "user"}], [{"role": "user", "content": 3}], [["user", "hi"]]):
        with pytest.raises(InvalidRequest):
            t.render(bad)
    # A checkpoint without a template: a clear refusal, not a crash.
    (tmp_path / "tokenizer.json").write_text((DEMO_TARGET / "tokenizer.json").read_text())
    tok = TextTokenizer(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_template_from_tokenizer_config(tmp_path):
    """Without chat_template.jinja, tokenizer_config.json's template (a string, or named
    templates) is used; the special tokens are variables of the template."""
    (tmp_path / "tokenizer.json").write_text((DEMO_TARGET / "tokenizer.json").read_text())
    cfg = {
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ messages[0].content }}{{ eos_token }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert (
        TextTokenizer(tmp_path).render_chat([{"role": "user", "content": "hi"}]) == "hi<|im_end|>"
    )


# --------------------------------------------------------------------------- Qwen3's own template

QWEN3 = __import__(
    "target_service.random_checkpoint", fromlist=["x"]
).QWEN3_CHAT_TEMPLATE.read_text()
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
TOOL_ROUND = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris? \u00e9"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "They ask about Paris.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "<think>\nok\n</think>\n\nIt is sunny."},
    {"role": "user", "content": "Thanks"},
]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
def test_qwen3_template_renders_as_transformers(kwargs):
    """Qwen3's template with tools, tool calls and answers, reasoning, and enable_thinking."""
    ours, hf = ChatTemplate(QWEN3, {"eos_token": "<|im_end|>"}), _hf(QWEN3)
    for msgs in [*CONVERSATIONS, TOOL_ROUND]:
        for tools in (None, TOOLS):
            for gen in (True, False):
                want = hf.apply_chat_template(
                    msgs, tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs
                )
                assert ours.render(msgs, gen, tools, kwargs) == want, (msgs, tools, gen)


def test_what_a_template_supports_and_the_thinking_mode_it_leaves():
    qwen3 = ChatTemplate(QWEN3)
    msgs = [{"role": "user", "content": "hi"}]
    assert qwen3.thinks and qwen3.renders_tools
    text, fmt = qwen3.conversation(msgs)
    assert (fmt.thinking, fmt.in_reasoning, fmt.tool_calls) == ("on", False, False)
    assert text.endswith("<|im_start|>assistant\n")
    text, fmt = qwen3.conversation(msgs, TOOLS, None, {"enable_thinking": False})
    assert (fmt.thinking, fmt.in_reasoning, fmt.tool_calls) == ("off", False, True)
    assert text.endswith("<think>\n\n</think>\n\n") and '"get_weather"' in text
    assert not qwen3.conversation(msgs, TOOLS, "none")[1].tool_calls
    # A template that opens the think block itself (as Qwen3's thinking-only models do).
    forced = ChatTemplate(
        QWEN3.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    )
    assert forced.conversation(msgs)[1].in_reasoning
    # The demo's ChatML: no thinking, no tools (refused, not left out of the prompt).
    demo = TextTokenizer(DEMO_TARGET)
    assert not demo.chat_template.thinks and not demo.chat_template.renders_tools
    assert demo.render_conversation(msgs, (), None, {"enable_thinking": False})[1].thinking == (
        "unsupported"
    )
    with pytest.raises(InvalidRequest, match="does not render tools"):
        demo.render_conversation(msgs, TOOLS)
    with pytest.raises(InvalidRequest, match=r"tools\[0\].function needs a name"):
        qwen3.conversation(msgs, [{"type": "function", "function": {}}])


# --------------------------------------------------------------------------- reading the output

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
READS = [
    # (format, output) -> (content, reasoning, [(name, arguments)])
    (("on", False, False), "<think>\nhm\n</think>\n\nFour.", ("\n\nFour.", "\nhm\n", [])),
    (("on", False, False), "  <think>cut off", ("", "cut off", [])),
    (("on", False, False), "No think block.", ("No think block.", "", [])),
    (("on", False, False), "Text <think>x</think>", ("Text <think>x</think>", "", [])),
    (("on", True, False), "already thinking</think>Answer", ("Answer", "already thinking", [])),
    (("off", False, False), "Plain <think", ("Plain <think", "", [])),
    (("unsupported", False, False), "<think>a</think>b", ("<think>a</think>b", "", [])),
    (
        ("on", False, True),
        f"<think>w</think>\n\nLet me check.\n{CALL}\n{CALL}",
        ("\n\nLet me check.", "w", [("get_weather", '{"city": "Paris"}')] * 2),
    ),
    (("off", False, True), f"{CALL}\nDone.", ("Done.", "", [("get_weather", '{"city": "Paris"}')])),
    (
        ("off", False, True),
        "<tool_call>not json</tool_call> x",
        ("<tool_call>not json</tool_call> x", "", []),
    ),
    (("off", False, True), '<tool_call>{"name": "f"', ('<tool_call>{"name": "f"', "", [])),
    (("off", False, False), CALL, (CALL, "", [])),  # no tools asked for: text
    (("off", False, True), "a <tool_c", ("a <tool_c", "", [])),
]


@pytest.mark.parametrize("fmt,output,want", READS)
def test_output_reads_the_same_whole_and_in_any_pieces(fmt, output, want):
    import random

    from flashmap.chat import ChatFormat, ChatReader

    fmt = ChatFormat(*fmt)

    def read(pieces):
        reader, content, reasoning, calls = ChatReader(fmt), "", "", []
        for d in [*(reader.push(p) for p in pieces), reader.finish()]:
            content, reasoning, calls = (
                content + d.content,
                reasoning + d.reasoning,
                calls + d.tool_calls,
            )
        return content, reasoning, [(c.name, c.arguments) for c in calls]

    assert read([output]) == want
    assert read(list(output)) == want  # a character at a time
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(output)), min(4, len(output) - 1)))
        assert read([output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]) == want
