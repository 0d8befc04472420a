"""One request's stream, from its admission to its one Outcome: the pieces of text as its tokens
commit (TextPieces: stop strings, the chat's reasoning and tool calls), then how it ended, in
the log and the requests metric. Every front end (gRPC Generate, the OpenAI API) serves this,
through Orchestrator.stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from flashmap.logs import fields
from flashmap.tokenizer import IncrementalDecoder
from flashmap.types import GenerationRequest, InvalidRequest
from orchestrator.requests import Outcome, Piece, TextPieces

log = logging.getLogger("flashmap.orchestrator")


async def request_stream(
    orch, gen: GenerationRequest, stops: list[str] = (), deadline: float | None = None
) -> AsyncIterator[Piece | Outcome]:
    """Run one request: its pieces as they commit, then one Outcome (every front end, gRPC
    and HTTP, serves this). Stop strings end the request at the first token whose text
    reaches one (TextPieces); the ids, the text and the usage all stop there. deadline
    (time.monotonic()): past it the request ends with DEADLINE_EXCEEDED."""
    if not orch.health.ok:
        yield Outcome.failed(grpc.StatusCode.UNAVAILABLE, "the target is unavailable (see Health)")
        return
    try:
        a = orch.submit(gen, deadline)
    except InvalidRequest as e:
        yield Outcome.failed(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return
    except OverflowError as e:
        yield Outcome.failed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return
    stops = [x for x in stops if x]
    if stops and orch.tokenizer is None:
        orch.abort(gen.request_id)
        yield Outcome.failed(
            grpc.StatusCode.INVALID_ARGUMENT, "stop strings need the target's tokenizer"
        )
        return
    text = TextPieces(orch.tokenizer and IncrementalDecoder(orch.tokenizer), stops, gen.chat)
    status = "abort"  # what the requests metric records if the client goes away first
    try:
        while (new := await a.queue.get()) is not None:
            piece = text.push(*new)
            if text.stopped:
                a.seq.finish("stop")
                orch.wake()
            if piece is not None:
                yield piece
            if text.stopped:
                while await a.queue.get() is not None:
                    pass
                break
        if (piece := text.tail()) is not None:
            yield piece
        if a.seq.error is not None:
            status = "error"
            yield Outcome.part_failed(a.seq.error)
            return
        s = a.seq.stats
        s.draft_steps = orch.steps_of(a)
        total = time.perf_counter() - a.t_arrival
        status = "stop" if text.stopped else (a.seq.finish_reason or "abort")
        outcome = Outcome(
            status,
            a.seq.n_prompt,
            text.sent_ids,
            s,
            (a.t_first - a.t_arrival) if a.t_first else 0.0,
            total,
        )
        log.info(
            "request finished",
            extra=fields(
                request_id=gen.request_id,
                finish_reason=status,
                prompt_tokens=outcome.prompt_tokens,
                completion_tokens=text.sent_ids,
                mean_acceptance_length=round(s.mean_acceptance_length, 3),
                fallback_rounds=s.fallback_rounds,
                total_s=round(total, 4),
            ),
        )
        yield outcome
    except (asyncio.CancelledError, GeneratorExit):
        orch.abort(gen.request_id)  # client went away: free the slot on target and drafter
        raise
    finally:
        orch.metrics.requests.labels(model=orch.info.model_name, status=status).inc()
