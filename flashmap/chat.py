"""A conversation's edges: what a request may pass to the chat template besides its messages
(chat template arguments, tools, the tool choice; checked here once for every front), and how
the generated text reads back (`ChatReader`): the reasoning of a template that thinks, the
answer, and the tool calls, in whole responses and in streamed deltas alike.

The reading follows vLLM's qwen3 reasoning parser and hermes tool parser:
- reasoning: an output that opens with `<think>` (after whitespace), or that starts inside a
  think block the prompt opened, is reasoning up to `</think>` (or to its end, if it is cut
  off while thinking); the text after it is the answer. An output without a think block is
  all answer (a template whose thinking is off closes an empty block in the prompt);
- tool calls (with tools, tool_choice not "none"): each `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` is a call (arguments as JSON text); one whose JSON does not parse stays
  text of the answer; whitespace between the answer and a call is dropped.
Text that may still become a tag is held back until it is decided, so streamed deltas join to
exactly the whole response.

Standard library only: the orchestrator and the CLI import it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from flashmap.types import InvalidRequest

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CHOICES = ("auto", "none")
# Template variables the server sets itself (a chat template argument may not replace them).
RESERVED = ("messages", "tools", "add_generation_prompt")


# ----------------------------------------------------------------------------- request side


def check_chat_template_kwargs(kwargs: dict) -> dict:
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequest("chat_template_kwargs must be a JSON object")
    taken = [k for k in kwargs if k in RESERVED]
    if taken:
        raise InvalidRequest(f"chat_template_kwargs: {taken[0]!r} is set by the server")
    return kwargs


def check_tools(tools: list) -> list:
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("tools must be a list of JSON objects")
    return tools


def check_tool_choice(choice: str) -> str:
    if choice == "required":
        raise InvalidRequest(
            'tool_choice "required" needs constrained decoding, which this server does not do '
            '(it decodes the target\'s own distribution): use "auto" or "none"'
        )
    if choice not in TOOL_CHOICES:
        raise InvalidRequest(f'tool_choice must be "auto" or "none", got {choice!r}')
    return choice


def function_tools(tools: list[dict]) -> list[dict]:
    """OpenAI's tool shape, checked: [{"type": "function", "function": {"name", ...}}]."""
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}].function needs a name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON object")
    return tools


def template_messages(messages: list[dict]) -> list[dict]:
    """A conversation as chat templates read it: string content (None: ""), an assistant's
    tool calls with their arguments as objects (as vLLM hands them to templates), a tool
    message's tool_call_id, a message's reasoning_content. InvalidRequest for anything else."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must have a string 'role' and a string 'content'")
        content = m.get("content")
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}] must have a string 'role' and a string 'content'")
        msg = {"role": m["role"], "content": content}
        for key in ("reasoning_content", "tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise InvalidRequest(f"messages[{i}].{key} must be a string")
                msg[key] = m[key]
        if m.get("tool_calls"):
            msg["tool_calls"] = [_template_call(c, i) for c in m["tool_calls"]]
        out.append(msg)
    return out


def _template_call(call, i: int) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"messages[{i}].tool_calls: each needs a function with a name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # the template gets the text as it is
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


# ----------------------------------------------------------------------------- output side


@dataclass(frozen=True)
class ChatFormat:
    """How a conversation's output reads, from its rendered prompt."""

    thinking: str = "unsupported"  # the mode that ran: "on", "off", or the template has none
    in_reasoning: bool = False  # the prompt opened a think block: the output starts inside it
    tool_calls: bool = False  # tool calls are parsed (tools given, tool_choice not "none")

    @property
    def reasoning(self) -> bool:
        return self.thinking != "unsupported"


def thinking_mode(generation_prompt: str) -> tuple[str, bool]:
    """(mode, in_reasoning) of a thinking template from its generation prompt (the text it
    adds for the assistant's turn): a think block left open is thinking already begun; a
    closed one is thinking off (Qwen3's enable_thinking=false); none: the model opens its own."""
    opened, closed = generation_prompt.rfind(THINK_OPEN), generation_prompt.rfind(THINK_CLOSE)
    if opened > closed:
        return "on", True
    return ("off", False) if closed >= 0 else ("on", False)


@dataclass
class ToolCall:
    """A parsed call: its id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function"}
        d["function"] = {"name": self.name, "arguments": self.arguments}
        return d if index is None else {"index": index, **d}


@dataclass
class ChatDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChatReader:
    """Splits a conversation's output text, given piece by piece, into reasoning, answer and
    tool calls (module docstring); `finish` gives what was held back once the output ends."""

    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt
        if fmt.in_reasoning:
            self.state = "reasoning"
        else:
            self.state = "start" if fmt.reasoning else "content"
        self.buf = ""
        self.space = ""  # answer whitespace held back: a tool call may follow it
        self.after_call = False  # answer whitespace right after a call is dropped

    def push(self, text: str) -> ChatDelta:
        self.buf += text
        out = ChatDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ChatDelta:
        out = self.push("")
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            out.reasoning += rest
        elif self.state == "tool":
            self._answer(out, CALL_OPEN + rest)
        else:
            self._answer(out, rest)
        out.content += self.space
        self.space = ""
        return out

    def _step(self, out: ChatDelta) -> bool:
        """Consume what can be decided of the buffer; True while there is more to decide."""
        buf = self.buf
        if self.state == "start":
            body = buf.lstrip()
            if body.startswith(THINK_OPEN):
                self.buf, self.state = body[len(THINK_OPEN) :], "reasoning"
                return True
            if THINK_OPEN.startswith(body):  # still maybe a think block
                return False
            self.state = "content"
            return True
        if self.state == "reasoning":
            i = buf.find(THINK_CLOSE)
            if i >= 0:
                out.reasoning += buf[:i]
                self.buf, self.state = buf[i + len(THINK_CLOSE) :], "content"
                return True
            keep = _partial_tag(buf, THINK_CLOSE)
            out.reasoning += buf[: len(buf) - keep]
            self.buf = buf[len(buf) - keep :]
            return False
        if self.state == "tool":
            j = buf.find(CALL_CLOSE)
            if j < 0:
                return False
            self.buf, self.state = buf[j + len(CALL_CLOSE) :], "content"
            call = _parse_call(buf[:j])
            if call is None:  # not a call after all: the text stays the answer's
                self._answer(out, CALL_OPEN + buf[: j + len(CALL_CLOSE)])
            else:
                self.space, self.after_call = "", True
                out.tool_calls.append(call)
            return True
        if not self.fmt.tool_calls:
            out.content += buf
            self.buf = ""
            return False
        i = buf.find(CALL_OPEN)
        if i >= 0:
            self._answer(out, buf[:i])
            self.space = ""
            self.buf, self.state = buf[i + len(CALL_OPEN) :], "tool"
            return True
        keep = _partial_tag(buf, CALL_OPEN)
        self._answer(out, buf[: len(buf) - keep])
        self.buf = buf[len(buf) - keep :]
        return False

    def _answer(self, out: ChatDelta, text: str) -> None:
        """Answer text. With tool calls, whitespace that touches a call is dropped: trailing
        whitespace waits for what follows it, and a call's trailing whitespace goes."""
        if not self.fmt.tool_calls:
            out.content += text
            return
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        out.content += body


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of text that is a beginning of tag (it may become tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(
        f"call_{uuid.uuid4().hex[:24]}",
        obj["name"],
        args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
    )
