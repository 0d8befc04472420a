"""The OpenAI API's answers: whole responses and streamed chunks, completions or chat, made of
the request's pieces (orchestrator.requests.Piece) and its Outcome.

A chat message carries the answer's text as `content`, the reasoning of a template that thinks
as `reasoning_content` (vLLM's name; null when there was none), and the calls the model made as
`tool_calls` (finish_reason "tool_calls"); streamed, each chunk's delta carries what its piece
freed, a tool call whole in the chunk where it closed. A chat response says which thinking mode
its prompt left the model in (`thinking`; streamed: in the first chunk). Log-probabilities, when
asked, are OpenAI's shapes: chat's `logprobs.content` entries, completions' `tokens`,
`token_logprobs`, `top_logprobs` and `text_offset`. Every response carries the request's
speculative statistics under "flashmap" (streamed: in the chunk that has the finish_reason).
"""

from __future__ import annotations

import time
from typing import Any

from orchestrator.requests import Piece


def joined(pieces: list[Piece]) -> Piece:
    """A whole response's pieces as one."""
    out = Piece([], "", logprobs=[] if any(p.logprobs is not None for p in pieces) else None)
    for p in pieces:
        out.token_ids += p.token_ids
        out.text += p.text
        out.reasoning += p.reasoning
        out.tool_calls += p.tool_calls
        if p.logprobs is not None:
            out.logprobs += p.logprobs
    return out


class Shape:
    """OpenAI's JSON for one request on one endpoint. token_text(id): a token's text (how
    log-probabilities name it)."""

    def __init__(self, chat: bool, model: str, gen, return_token_ids: bool, token_text=None):
        self.chat, self.model, self.gen, self.ids = chat, model, gen, return_token_ids
        self.id = gen.request_id
        self.created = int(time.time())
        self.token_text = token_text or (lambda t: f"token_id:{t}")
        self.calls = 0  # tool calls streamed so far (their indexes)
        self.offset = 0  # completions' text_offset of the next token

    def head(self, chunk: bool) -> dict:
        obj = (
            ("chat.completion.chunk" if chunk else "chat.completion")
            if self.chat
            else "text_completion"
        )
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def wants(self, piece: Piece) -> bool:
        """Whether a streamed piece makes a chunk (one that carries nothing asked for does not)."""
        return bool(
            piece.text
            or piece.reasoning
            or piece.tool_calls
            or (piece.token_ids and (self.ids or piece.logprobs))
        )

    def _thinking(self) -> dict:
        fmt = self.gen.chat
        return {"thinking": fmt.thinking} if self.chat and fmt is not None else {}

    def _finish(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" else reason

    def _choice(self, piece: Piece, finish: str | None, chunk: bool, first: bool = False) -> dict:
        c: dict[str, Any] = {"index": 0}
        if not self.chat:
            c["text"] = piece.text
        elif chunk:
            c["delta"] = self._delta(piece, first)
        else:
            c["message"] = self._message(piece)
        c["logprobs"] = self._logprobs(piece.logprobs) if piece.logprobs is not None else None
        c["finish_reason"] = finish
        if self.ids:
            c["token_ids"] = piece.token_ids
            if not chunk or first:
                c["prompt_token_ids"] = list(self.gen.prompt_ids)
        return c

    def _message(self, piece: Piece) -> dict:
        fmt = self.gen.chat
        said = piece.text or not (piece.reasoning or piece.tool_calls)
        msg: dict[str, Any] = {"role": "assistant", "content": piece.text if said else None}
        if fmt is not None and fmt.reasoning:
            msg["reasoning_content"] = piece.reasoning or None
        if piece.tool_calls:
            msg["tool_calls"] = [c.as_openai() for c in piece.tool_calls]
        return msg

    def _delta(self, piece: Piece, first: bool) -> dict:
        d: dict[str, Any] = {"role": "assistant"} if first else {}
        if piece.text or first:
            d["content"] = piece.text
        if piece.reasoning:
            d["reasoning_content"] = piece.reasoning
        if piece.tool_calls:
            d["tool_calls"] = [c.as_openai(self.calls + i) for i, c in enumerate(piece.tool_calls)]
            self.calls += len(piece.tool_calls)
        return d

    def _logprobs(self, logprobs: list) -> dict:
        if self.chat:
            return {"content": [self._entry(x) for x in logprobs], "refusal": None}
        tokens = [self.token_text(x.token) for x in logprobs]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [x.logprob for x in logprobs],
            "top_logprobs": [
                {self.token_text(t): lp for t, lp in zip(x.top_ids, x.top_logprobs)}
                for x in logprobs
            ],
            "text_offset": offsets,
        }

    def _entry(self, x) -> dict:
        def one(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        top = [one(t, lp) for t, lp in zip(x.top_ids, x.top_logprobs)]
        return {**one(x.token, x.logprob), "top_logprobs": top}

    @staticmethod
    def usage(o) -> dict:
        return {
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
        }

    @staticmethod
    def stats(o) -> dict:
        return {**o.stats.as_dict(), "time_to_first_token_s": o.ttft_s, "total_s": o.total_s}

    def response(self, piece: Piece, o) -> dict:
        finish = self._finish(o.finish_reason, bool(piece.tool_calls))
        return {
            **self.head(False),
            **self._thinking(),
            "choices": [self._choice(piece, finish, False)],
            "usage": self.usage(o),
            "flashmap": self.stats(o),
        }

    def chunk(self, piece: Piece, first: bool = False) -> dict:
        head = {**self.head(True), **(self._thinking() if first else {})}
        return {**head, "choices": [self._choice(piece, None, True, first)]}

    def finish_chunk(self, o) -> dict:
        """The chunk with the finish reason (and the statistics)."""
        finish = self._finish(o.finish_reason, self.calls > 0)
        empty = Piece([], "")
        return {
            **self.head(True),
            "choices": [self._choice(empty, finish, True)],
            "flashmap": self.stats(o),
        }
