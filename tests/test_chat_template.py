"""The chat template rendered without transformers (flashmap.tokenizer.ChatTemplate) gives
the text transformers' apply_chat_template gives: for the demo target's ChatML template and
for a template in the style of Qwen3's (namespace, loop variables, tojson, raise_exception);
and what it refuses, it refuses with InvalidRequest."""

from __future__ import annotations

import json

import pytest

from flashmap.tokenizer import ChatTemplate, TextTokenizer
from flashmap.types import InvalidRequest
from flashmap_cli.stack import DEMO_TARGET

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
