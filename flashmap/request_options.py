"""The options of a generation request, defined once: RequestOptions (as vLLM's SamplingParams,
with `to_sampling_params()`), and the prompt they apply to (Prompt).

A field of RequestOptions is one option a client sets: its type, its default, its check (the
flashmap.types check_* functions: one message at every entry point) and its help. Every front
takes the options from these fields, by small generic functions over them:
- gRPC Generate: GenerateRequest's field of the same name, both ways (flashmap.request_proto:
  the orchestrator reads one, the client SDK writes one);
- the OpenAI API: a body field, under OpenAI's own name where it has one (`max_tokens`); the
  others are extensions a client sends in `extra_body` (orchestrator.openai_api.protocol);
- `flashmap generate`: a flag (flashmap.config.add_arguments over this class);
- the client SDK: Client.generate's keyword arguments.

Adding an option is a field here and, when it crosses gRPC, a GenerateRequest field of the same
name in proto/flashmap/v1/serving.proto. A value the wire has no type for (a dict, a list of
dicts: chat template arguments, tools) crosses gRPC as JSON text in a `string` field, the CLI
as JSON text, the OpenAI API as JSON.

Standard library and numpy only (flashmap.types): every part and the SDK import it.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from flashmap.chat import check_chat_template_kwargs, check_tool_choice, check_tools
from flashmap.config import Option
from flashmap.types import (
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    check_draft_steps,
    check_max_draft_tokens,
    check_max_new_tokens,
    check_seed,
    check_temperature,
    check_top_k,
    check_top_logprobs,
    check_top_p,
    check_tree_blocks,
)

SCALARS = (bool, int, float, str)


class _OwnDefault:
    def __repr__(self) -> str:
        return "OWN_DEFAULT"


OWN_DEFAULT: Any = _OwnDefault()  # an OpenAI body that leaves the option out: the option's default


@dataclass(frozen=True)
class Crossing:
    """Where an option crosses the fronts that do not take its name as it is."""

    proto: str | None = ""  # GenerateRequest's field ("": the option's name; None: not on gRPC)
    openai: str | None = ""  # the OpenAI body's field ("": the name; None: not in that API)
    # What an OpenAI body means when it leaves the field out, where OpenAI's default differs.
    openai_default: Any = OWN_DEFAULT


def request_option(
    default: Any = MISSING,
    help: str = "",
    *,
    check=None,
    flag: str = "",
    proto: str | None = "",
    openai: str | None = "",
    openai_default: Any = OWN_DEFAULT,
    default_factory: Any = MISSING,
) -> Any:
    """A RequestOptions field: its help and flag (flashmap.config.Option, so the CLI's flag is
    made as any config's), its check (raises InvalidRequest) and how it crosses the fronts."""
    return field(
        default=default,
        default_factory=default_factory,
        metadata={
            "option": Option(help, flag=flag, check=check),
            "request": Crossing(proto, openai, openai_default),
        },
    )


@dataclass(frozen=True, kw_only=True)
class RequestOptions:
    """What a client asks of a generation, besides its prompt (module docstring)."""

    max_new_tokens: int | None = request_option(
        64,
        "tokens to generate at most (None: up to the end of the context)",
        check=check_max_new_tokens,
        openai="max_tokens",
    )
    temperature: float = request_option(
        0.0, "0 = greedy", check=check_temperature, openai_default=1.0
    )
    top_k: int = request_option(
        0, "sample among the k most likely tokens (0 or -1 = off)", check=check_top_k
    )
    top_p: float = request_option(
        1.0,
        "sample among the most likely tokens that together reach this probability (1 = off)",
        check=check_top_p,
    )
    seed: int | None = request_option(None, "a seeded request is reproducible", check=check_seed)
    stop: list[str] = request_option(
        help="stop string: the text, its ids and the usage end before it (repeatable)",
        default_factory=list,
    )
    stop_token_ids: list[int] = request_option(
        help="extra stop token id (repeatable)", flag="--stop-id", default_factory=list
    )
    ignore_eos: bool = request_option(False, "do not stop at the target's end-of-sequence ids")
    draft_steps: int | None = request_option(
        None,
        "flow-map jumps (1, 2) or N Euler steps of the teacher (default: the drafter's)",
        check=check_draft_steps,
    )
    max_draft_tokens: int | None = request_option(
        None,
        "most draft tokens verified per round (0: speculation off; default: the block)",
        check=check_max_draft_tokens,
    )
    tree_blocks: int | None = request_option(
        None,
        "blocks drafted from independent noise and verified as one tree (1: one block; "
        "default: the server's)",
        check=check_tree_blocks,
    )
    # A conversation's: rendered by the target's chat template (flashmap.chat).
    chat_template_kwargs: dict = request_option(
        help='arguments of the chat template, a JSON object (e.g. {"enable_thinking": false})',
        check=check_chat_template_kwargs,
        default_factory=dict,
    )
    tools: list[dict] = request_option(
        help='a tool the model may call, a JSON object as OpenAI\'s {"type": "function", '
        '"function": {"name", "description", "parameters"}} (repeatable); the chat template '
        "renders them and the calls are parsed from the output",
        check=check_tools,
        default_factory=list,
    )
    tool_choice: str | None = request_option(
        None,
        'with tools: "auto" (default: calls are parsed) or "none" (the text stays text)',
        check=check_tool_choice,
    )
    logprobs: bool = request_option(
        False,
        "the target's log-probability of each generated token (its raw distribution, before "
        "temperature, top-k and top-p; exact under speculation)",
    )
    top_logprobs: int = request_option(
        0, "with logprobs: also the n most likely tokens at each position", check=check_top_logprobs
    )

    def validate(self) -> RequestOptions:
        """Every field's check (InvalidRequest with a one-line message); None is never checked."""
        for f, _ in request_fields(type(self)):
            check = f.metadata["option"].check
            value = getattr(self, f.name)
            if check is not None and value is not None:
                check(value)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs")
        return self

    @property
    def chat_options(self) -> bool:
        """Options that only a conversation takes (its chat template's)."""
        return bool(self.chat_template_kwargs or self.tools or self.tool_choice is not None)

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=float(self.temperature),
            top_k=max(int(self.top_k), 0),  # -1: off, as 0
            top_p=float(self.top_p),
            seed=self.seed,
        )

    def to_request(
        self,
        prompt_ids: list[int],
        *,
        vocab_size: int,
        max_seq_len: int,
        eos_token_ids=(),
        request_id: str = "",
    ) -> GenerationRequest:
        """The validated GenerationRequest of a tokenised prompt with these options (the
        edge: what comes out is trusted), or InvalidRequest."""
        self.validate()
        max_new = self.max_new_tokens
        if max_new is None:  # at least 1, so a full context gets validate()'s message
            max_new = max(1, max_seq_len - len(prompt_ids))
        stop_ids = tuple(self.stop_token_ids) + (() if self.ignore_eos else tuple(eos_token_ids))
        gen = GenerationRequest(
            [int(t) for t in prompt_ids],
            int(max_new),
            self.to_sampling_params(),
            stop_ids,
            self.draft_steps,
            request_id,
            self.max_draft_tokens,
            self.tree_blocks,
            self.top_logprobs if self.logprobs else None,
        )
        gen.validate(vocab_size, max_seq_len)
        return gen


@dataclass(frozen=True)
class Prompt:
    """What a request continues: one of a text, token ids, or a conversation (`messages`,
    [{"role", "content"}], and an assistant's "tool_calls" and "reasoning_content", a tool
    message's "tool_call_id") that the server renders with the target's chat template."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None


# ----------------------------------------------------------------------------- for the fronts


def request_fields(cls: type = RequestOptions) -> list[tuple[Field, Crossing]]:
    """The options of cls (RequestOptions, or a class that extends it) with their crossings."""
    return [(f, f.metadata["request"]) for f in fields(cls) if "request" in f.metadata]


def value_kind(cls: type, name: str) -> tuple[str, type]:
    """How option `name` of cls is carried: ("scalar", t), ("list", element type) for a list
    of scalars, or ("json", t) for anything else (a dict, a list of dicts)."""
    t = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) is not None and type(None) in typing.get_args(t) and len(args) == 1:
        t = args[0]  # X | None
    if t in SCALARS:
        return "scalar", t
    if typing.get_origin(t) is list and typing.get_args(t)[0] in SCALARS:
        return "list", typing.get_args(t)[0]
    return "json", t


def field_default(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default
