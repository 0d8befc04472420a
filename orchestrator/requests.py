"""A request as the front ends (gRPC Generate, the OpenAI API) see it: built and validated from
its prompt and its options (`build_request`; flashmap.request_options; a conversation through the
chat template with its arguments and tools), and its committed tokens given back as text
(`TextPieces`: pieces held back while they could start a stop string; a conversation's split
into reasoning, answer and tool calls by flashmap.chat.ChatReader), with each token's
log-probability when asked, then one `Outcome`.

Validation happens here once (RequestOptions.to_request: the options' checks and
GenerationRequest.validate, flashmap.types' limits); the scheduler, the drafter and the target
trust what comes out."""

from __future__ import annotations

import bisect
import uuid
from dataclasses import dataclass, field

import grpc

from flashmap.chat import ChatFormat, ChatReader, ToolCall
from flashmap.request_options import Prompt, RequestOptions
from flashmap.types import GenerationRequest, InvalidRequest, SpecStats, TokenLogprob
from orchestrator.target_client import TargetUnavailable


@dataclass
class Piece:
    """Tokens committed for one request and their text (may be empty while a character is
    incomplete; a conversation's answer only, its reasoning and tool calls apart)."""

    token_ids: list[int]
    text: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] when the request asks


@dataclass
class Outcome:
    """How a request ended: one per request, the same in the stream, the usage and the metrics."""

    finish_reason: str  # length | stop | abort | error
    prompt_tokens: int
    completion_tokens: int  # the tokens streamed
    stats: SpecStats
    ttft_s: float = 0.0
    total_s: float = 0.0
    error: tuple[grpc.StatusCode, str] | None = None  # the request failed: status for the client

    @staticmethod
    def failed(code: grpc.StatusCode, message: str) -> Outcome:
        return Outcome("error", 0, 0, SpecStats(), error=(code, message))

    @staticmethod
    def part_failed(e: BaseException) -> Outcome:
        """A request that a part (the target, its deadline) failed."""
        if isinstance(e, InvalidRequest):
            code = grpc.StatusCode.INVALID_ARGUMENT
        elif isinstance(e, TimeoutError):
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            code = grpc.StatusCode.UNAVAILABLE
        plain = isinstance(e, TimeoutError) and not isinstance(e, TargetUnavailable)
        return Outcome.failed(code, str(e) if plain else f"target verify failed: {e}")


def build_request(
    cfg, tokenizer, info, prompt: Prompt, options: RequestOptions, request_id: str = ""
) -> GenerationRequest:
    """A validated GenerationRequest of a prompt and its options, or InvalidRequest with a
    one-line message. cfg: the OrchestratorConfig (prompt and id limits); tokenizer: the
    target's (None: token ids only); info: the target's TargetInfo (vocabulary, context,
    end-of-sequence ids); request_id "": a new one. Renders a conversation with the chat
    template and tokenises a text prompt: call it off the event loop."""
    if len(request_id) > cfg.max_request_id_len or not request_id.isprintable():
        raise InvalidRequest(
            f"request_id must be printable and at most {cfg.max_request_id_len} characters"
        )
    text = prompt.text
    if (text is not None or prompt.messages is not None) and tokenizer is None:
        raise InvalidRequest("this server has no tokenizer: send token ids")
    chat = None
    if prompt.messages is not None:
        text, chat = tokenizer.render_conversation(
            prompt.messages, options.tools, options.tool_choice, options.chat_template_kwargs
        )
    elif options.chat_options:
        raise InvalidRequest(
            "chat_template_kwargs, tools and tool_choice go with a conversation (messages)"
        )
    if text is not None:
        if (
            len(text) > cfg.max_prompt_bytes
            or len(text.encode("utf-8", "replace")) > cfg.max_prompt_bytes
        ):
            raise InvalidRequest(f"prompt text is longer than {cfg.max_prompt_bytes} bytes")
        ids = tokenizer.encode(text)
    elif prompt.token_ids is not None:
        ids = prompt.token_ids
    else:
        raise InvalidRequest("prompt is empty")
    gen = options.to_request(
        ids,
        vocab_size=info.vocab_size,
        max_seq_len=info.max_seq_len,
        eos_token_ids=info.eos_token_ids,
        request_id=request_id or uuid.uuid4().hex,
    )
    gen.chat = chat
    return gen


def chat_support(tokenizer) -> dict[str, bool]:
    """What the target's chat template supports: a template at all, thinking, tools."""
    template = tokenizer.chat_template if tokenizer is not None else None
    if template is None:
        return {"template": False, "thinking": False, "tools": False}
    return {"template": True, "thinking": template.thinks, "tools": template.renders_tools}


class TextPieces:
    """One request's committed tokens as pieces of text. Text that could be the start of a stop
    string is held back (and its ids with it); at the first stop string the request stops at
    the token whose text reaches it, so the ids, the text and the usage all end there. Without
    a decoder (no tokenizer: no stop strings either) the pieces are the ids alone. For a
    conversation (chat: its ChatFormat) each piece's text is split into answer, reasoning and
    tool calls; with log-probabilities each piece carries its tokens'."""

    def __init__(self, decoder, stops: list[str], chat: ChatFormat | None = None):
        self.decoder = decoder  # flashmap.tokenizer.IncrementalDecoder, or None
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.sent_ids = self.sent_chars = 0
        self.stopped = False
        self.reader = ChatReader(chat) if chat is not None else None
        self.logprobs: list[TokenLogprob] | None = None  # of every token pushed, when given

    def push(self, new: list[int], logprobs: list[TokenLogprob] | None = None) -> Piece | None:
        """The piece these tokens free, if any; `stopped` says when a stop string was reached."""
        if logprobs is not None:
            self.logprobs = [] if self.logprobs is None else self.logprobs
            self.logprobs.extend(logprobs)
        d = self.decoder
        if d is None:
            self.sent_ids += len(new)
            return Piece(new, "", logprobs=None if logprobs is None else list(logprobs))
        d.push(new)
        keep = bisect.bisect_right(d.ends, len(d.text) - max(self.longest - 1, 0), lo=self.sent_ids)
        start = max(0, self.sent_chars - self.longest)
        cut = _find_stop(d.text, self.stops, start) if self.stops else None
        if cut is not None:  # keep the tokens whose text ends before the stop string
            keep = bisect.bisect_right(d.ends, cut, lo=self.sent_ids)
            self.stopped = True
        end = d.ends[keep - 1] if keep else 0
        if keep <= self.sent_ids:
            return None
        return self._piece(keep, end)

    def tail(self) -> Piece | None:
        """What was held back, once the request has ended (the reader's last text too)."""
        d = self.decoder
        if d is None:
            return None
        keep, end = self.sent_ids, self.sent_chars
        if not self.stopped:
            keep, end = len(d.ids), len(d.text)
        piece = self._piece(keep, end, last=True)
        return (
            piece if piece.token_ids or piece.text or piece.reasoning or piece.tool_calls else None
        )

    def _piece(self, keep: int, end: int, last: bool = False) -> Piece:
        """Tokens sent_ids..keep and text sent_chars..end as the next piece."""
        d = self.decoder
        ids, text = d.ids[self.sent_ids : keep], d.text[self.sent_chars : end]
        logprobs = None if self.logprobs is None else self.logprobs[self.sent_ids : keep]
        self.sent_ids, self.sent_chars = keep, end
        if self.reader is None:
            return Piece(ids, text, logprobs=logprobs)
        delta = self.reader.push(text)
        if last:
            more = self.reader.finish()
            delta.content += more.content
            delta.reasoning += more.reasoning
            delta.tool_calls += more.tool_calls
        return Piece(ids, delta.content, delta.reasoning, delta.tool_calls, logprobs)


def _find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Where the first stop string starts in text[start:] (as an index of text), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
