"""A request as the front ends (gRPC Generate, the OpenAI API) see it: built and validated from
its prompt and its options (`build_request`; flashmap.request_options), and its committed tokens
given back as text (`TextPieces`: pieces held back while they could start a stop string), then
one `Outcome`.

Validation happens here once (RequestOptions.to_request: the options' checks and
GenerationRequest.validate, flashmap.types' limits); the scheduler, the drafter and the target
trust what comes out."""

from __future__ import annotations

import bisect
import uuid
from dataclasses import dataclass

import grpc

from flashmap.request_options import Prompt, RequestOptions
from flashmap.types import GenerationRequest, InvalidRequest, SpecStats
from orchestrator.target_client import TargetUnavailable


@dataclass
class Piece:
    """Tokens committed for one request and their text (may be empty while a character is incomplete)."""

    token_ids: list[int]
    text: str


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
    if prompt.messages is not None:
        text = tokenizer.render_chat(prompt.messages, add_generation_prompt=True)
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
    return options.to_request(
        ids,
        vocab_size=info.vocab_size,
        max_seq_len=info.max_seq_len,
        eos_token_ids=info.eos_token_ids,
        request_id=request_id or uuid.uuid4().hex,
    )


class TextPieces:
    """One request's committed tokens as pieces of text. Text that could be the start of a stop
    string is held back (and its ids with it); at the first stop string the request stops at
    the token whose text reaches it, so the ids, the text and the usage all end there. Without
    a decoder (no tokenizer: no stop strings either) the pieces are the ids alone."""

    def __init__(self, decoder, stops: list[str]):
        self.decoder = decoder  # flashmap.tokenizer.IncrementalDecoder, or None
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.sent_ids = self.sent_chars = 0
        self.stopped = False

    def push(self, new: list[int]) -> Piece | None:
        """The piece these tokens free, if any; `stopped` says when a stop string was reached."""
        d = self.decoder
        if d is None:
            self.sent_ids += len(new)
            return Piece(new, "")
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
        piece = Piece(d.ids[self.sent_ids : keep], d.text[self.sent_chars : end])
        self.sent_ids, self.sent_chars = keep, end
        return piece

    def tail(self) -> Piece | None:
        """What was held back, once the request has ended without a stop string."""
        d = self.decoder
        if d is None or self.stopped or len(d.ids) <= self.sent_ids:
            return None
        piece = Piece(d.ids[self.sent_ids :], d.text[self.sent_chars :])
        self.sent_ids, self.sent_chars = len(d.ids), len(d.text)
        return piece


def _find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Where the first stop string starts in text[start:] (as an index of text), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
