"""The public gRPC front (proto/flashmap/v1/serving.proto: Generate, Abort, ModelInfo, Health),
beside the OpenAI-compatible HTTP front (orchestrator.openai_api); both build requests with
Orchestrator.make_request (a Prompt and RequestOptions: flashmap.request_proto reads them from
a GenerateRequest) and run them with Orchestrator.stream."""

from __future__ import annotations

import asyncio
import time

import grpc

from flashmap.auth import API_KEY_HEADER, bearer
from flashmap.grpc_serving import TokenAuth, add_service, serve_grpc
from flashmap.request_options import RequestOptions
from flashmap.request_proto import options_from_proto, prompt_from_proto
from flashmap.types import GenerationRequest, InvalidRequest
from flashmap.v1 import serving_pb2, serving_pb2_grpc
from flashmap.wire import stats_to_proto
from orchestrator.requests import Piece, chat_support
from orchestrator.scheduler import SERVICE_NAME, Orchestrator


def request_of(
    orch: Orchestrator, req: serving_pb2.GenerateRequest
) -> tuple[GenerationRequest, RequestOptions]:
    """The validated request a GenerateRequest asks for, and its options (InvalidRequest if it
    is refused)."""
    options = options_from_proto(req)
    return orch.make_request(prompt_from_proto(req), options, req.request_id), options


def chunk_of(piece: Piece) -> serving_pb2.TokenChunk:
    return serving_pb2.TokenChunk(
        token_ids=piece.token_ids,
        text=piece.text,
        reasoning_content=piece.reasoning,
        tool_calls=[
            serving_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
            for c in piece.tool_calls
        ],
        logprobs=[
            serving_pb2.TokenLogprob(
                token_id=x.token, logprob=x.logprob, top_ids=x.top_ids, top_logprobs=x.top_logprobs
            )
            for x in piece.logprobs or ()
        ],
    )


class FlashMapServicer(serving_pb2_grpc.FlashMapServicer):
    def __init__(self, orch: Orchestrator):
        self.orch = orch

    async def Generate(self, request, context):
        orch = self.orch
        try:
            # Ids that fit the context: nothing to tokenise, and the hop to the pool would cost
            # more than building the request here.
            if (
                request.WhichOneof("prompt") == "token_ids"
                and len(request.token_ids.ids) <= orch.info.max_seq_len
            ):
                gen, options = request_of(orch, request)
            else:
                gen, options = await orch.request_async(request_of, orch, request)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = gen.request_id
        left = context.time_remaining()
        stream = orch.stream(
            gen,
            options.stop,
            deadline=None if left is None else time.monotonic() + left,
        )
        try:
            async for item in stream:
                if isinstance(item, Piece):
                    yield serving_pb2.GenerateResponse(request_id=rid, chunk=chunk_of(item))
                    continue
                if item.error is not None:
                    await context.abort(*item.error)
                yield serving_pb2.GenerateResponse(
                    request_id=rid,
                    final=serving_pb2.FinalResult(
                        finish_reason=item.finish_reason,
                        usage=serving_pb2.Usage(
                            prompt_tokens=item.prompt_tokens,
                            completion_tokens=item.completion_tokens,
                        ),
                        stats=stats_to_proto(item.stats),
                        time_to_first_token_s=item.ttft_s,
                        total_s=item.total_s,
                        thinking=gen.chat.thinking if gen.chat is not None else "",
                    ),
                )
        finally:
            # However the call ends (cancelled, deadline, the client gone while a chunk was being
            # written), the request leaves now: no zombie holds a slot on the target or the drafter.
            await stream.aclose()

    async def Abort(self, request, context):
        return serving_pb2.AbortResponse(found=self.orch.abort(request.request_id))

    async def ModelInfo(self, request, context):
        o = self.orch
        chat = chat_support(o.tokenizer)
        return serving_pb2.ModelInfoResponse(
            model=o.info.model_name,
            drafter=o.drafter_name(),
            vocab_size=o.info.vocab_size,
            max_seq_len=o.info.max_seq_len,
            block_size=o.drafter.block_size if o.drafter else 0,
            draft_steps=o.drafter.steps if o.drafter else 0,
            eos_token_ids=list(o.info.eos_token_ids),
            max_concurrent=o.max_concurrent,
            max_queue=o.cfg.max_queue,
            chat_template=chat["template"],
            chat_thinking=chat["thinking"],
            chat_tools=chat["tools"],
        )

    async def Health(self, request, context):
        """What the health loop last learned (never a call that could hang on a stalled part)."""
        o = self.orch
        return serving_pb2.HealthResponse(
            ready=o.health.ok,
            target_ready=o.health.ok,
            drafter_ready=bool(o.drafter and o.drafter.connected),
            active_requests=len(o.active),
            queued_requests=len(o.waiting),
        )


async def serve_grpc_api(
    orch: Orchestrator, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    """Serve Generate (and grpc.health, /metrics) until `stop` is set or the process is stopped."""
    cfg = orch.cfg
    service = serving_pb2.DESCRIPTOR.services_by_name["FlashMap"]
    # With API keys, every call needs one but the health checks (ours and grpc.health.v1: probes).
    auth = (
        (TokenAuth(API_KEY_HEADER, bearer(cfg.api_key), open_methods=(f"/{SERVICE_NAME}/Health",)),)
        if cfg.api_key
        else ()
    )
    await serve_grpc(
        "orchestrator",
        lambda server: add_service(server, FlashMapServicer(orch), service, cfg.max_message_bytes),
        [SERVICE_NAME],
        cfg.host,
        cfg.port,
        cfg.metrics_port,
        registry=orch.metrics.registry,
        ready=ready,
        stop=stop,
        max_message_bytes=cfg.max_message_bytes,
        interceptors=auth,
        # Messages up to 4x the limit are read and refused with a status (serve_grpc).
        transport_bytes=min(4 * cfg.max_message_bytes, 2**31 - 1),
        tls=cfg.tls,
        reflection_on=cfg.reflection,
        health_servicer=orch.health.servicer,
    )
