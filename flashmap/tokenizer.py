"""The target checkpoint's tokenizer and chat template, without torch or transformers.

Reads tokenizer.json with the `tokenizers` library (what transformers' fast tokenizer
wraps), so the orchestrator stays light. The chat template (chat_template.jinja, or
tokenizer_config.json's "chat_template") is rendered with jinja2 the way transformers'
`apply_chat_template` renders it (messages, tools, the chat template arguments), so the OpenAI
chat endpoint and the CLI build the same prompt the checkpoint was trained on. What a template
supports is read from it: thinking (it knows `</think>`, as Qwen3's does) and tools (it renders
a `tools` variable).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from flashmap.chat import (
    THINK_CLOSE,
    ChatFormat,
    check_chat_template_kwargs,
    check_tool_choice,
    check_tools,
    function_tools,
    template_messages,
    thinking_mode,
)
from flashmap.types import InvalidRequest


class TextTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no tokenizer in the target checkpoint (pass token ids instead)"
            )
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = ChatTemplate.from_checkpoint(model_dir, self.config)

    def encode(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequest("prompt is empty")
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (how log-probabilities name it)."""
        return self.tok.decode([int(token_id)], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (InvalidRequest when the checkpoint has no template)."""
        return self._template().render(messages, add_generation_prompt)

    def render_conversation(
        self,
        messages: list[dict],
        tools: list[dict] = (),
        tool_choice: str | None = None,
        template_kwargs: dict | None = None,
    ) -> tuple[str, ChatFormat]:
        """The prompt of a conversation for the assistant's next turn, and how its output reads
        (ChatTemplate.conversation); InvalidRequest for what the template cannot do."""
        return self._template().conversation(messages, tools, tool_choice, template_kwargs)

    def _template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise InvalidRequest("the target checkpoint has no chat template: send a plain prompt")
        return self.chat_template


class ChatTemplate:
    """A checkpoint's Jinja chat template, rendered as transformers renders it: a sandboxed
    environment with trim_blocks / lstrip_blocks and loop controls, the `raise_exception`,
    `strftime_now` and non-escaping `tojson` helpers, and the special tokens as variables."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = (
            lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = env.from_string(source)
        self._errors = (jinja2.exceptions.TemplateError,)
        self.thinks = THINK_CLOSE in source  # it reads and writes think blocks (Qwen3's)
        self.renders_tools = re.search(r"\btools\b", source) is not None

    @classmethod
    def from_checkpoint(cls, model_dir: Path, tokenizer_config: dict) -> ChatTemplate | None:
        path = Path(model_dir) / "chat_template.jinja"
        source = path.read_text() if path.is_file() else tokenizer_config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        special = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            tok = tokenizer_config.get(name)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if isinstance(tok, str):
                special[name] = tok
        return cls(source, special)

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """Render [{"role", "content"}, ...] (flashmap.chat.template_messages: an assistant's
        tool_calls and reasoning_content, a tool's tool_call_id too) with the tools and the
        template's own arguments (`template_kwargs`, e.g. enable_thinking), as transformers
        passes them; InvalidRequest for a malformed conversation or one the template refuses
        (its raise_exception)."""
        messages = template_messages(messages)
        try:
            return self._template.render(
                **{**self.special_tokens, **check_chat_template_kwargs(template_kwargs or {})},
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
            )
        except self._errors as e:
            raise InvalidRequest(f"chat template: {e}") from None

    def conversation(
        self,
        messages: list[dict],
        tools: list[dict] = (),
        tool_choice: str | None = None,
        template_kwargs: dict | None = None,
    ) -> tuple[str, ChatFormat]:
        """The prompt for the assistant's next turn and how its output reads: the thinking mode
        the prompt leaves the model in (flashmap.chat.thinking_mode, from the text the
        generation prompt adds) and whether tool calls are parsed. Tools need a template that
        renders them (InvalidRequest otherwise, rather than a prompt that silently lacks them)."""
        tools = function_tools(check_tools(list(tools)))
        kwargs = dict(template_kwargs or {})
        if tool_choice is not None:
            check_tool_choice(tool_choice)
        if tools and not self.renders_tools:
            raise InvalidRequest(
                "tools: the target's chat template does not render tools (it has no `tools`)"
            )
        text = self.render(messages, True, tools, kwargs)
        fmt = ChatFormat(tool_calls=bool(tools) and tool_choice != "none")
        if self.thinks:
            head = self.render(messages, False, tools, kwargs)
            mode, inside = thinking_mode(text[len(head) :] if text.startswith(head) else "")
            fmt = ChatFormat(mode, inside, fmt.tool_calls)
        return text, fmt


class IncrementalDecoder:
    """Turns a growing id list into text deltas in O(1) per token (the tokenizers library's
    DecodeStream), never splitting a multi-byte character. `ends[i]` is the length of the
    text once token i is decoded, so a caller can cut ids and text at the same place."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.ends: list[int] = []  # [len(ids)] text length after each token
        self.text = ""

    def push(self, new_ids: list[int]) -> str:
        start = len(self.text)
        for t in new_ids:
            piece = self._stream.step(self.tokenizer.tok, int(t))
            if piece:  # None while a character is incomplete
                self.text += piece
            self.ids.append(int(t))
            self.ends.append(len(self.text))
        return self.text[start:]
