"""Calls to the FlashMap target over Triton's gRPC stream (ModelStreamInfer).

The target model is decoupled (target_service/model_repository/flashmap_target): Triton hands
it the next batch while one computes, and it answers every request on the stream it came on.
A decoupled model takes no unary ModelInfer, so every caller speaks the stream:

    stream = TritonStream(url, metadata)             # one bidirectional call, many requests
    res = await stream.call(infer_request("flashmap_target", inputs, ["ROWS_OUT"], corrid=7,
                                          start=True, end=True), timeout_s=30)
    res.as_numpy("ROWS_OUT")                         # tritonclient's InferResult
    res = call_once(url, request, metadata)          # one request, blocking (health probes)

Requests are matched to answers by their id. An answer that failed carries its message only
(no status code): `StreamError.code` is the model's row code when the message names one
(flashmap.target_wire.tag_error) and None for Triton's own errors. The stream failing as a whole
(server gone, refused key) fails every request on it with `StreamBroken` and its gRPC
status; the next call opens a new stream.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

from flashmap import target_wire

# Reconnect to a restarted server within a second, not gRPC's default back-off (up to 2 min);
# a packed round's features (all rows, prompts included) pass gRPC's default 4 MiB.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
]


class StreamError(Exception):
    """The target answered a request with an error: code = the model's row code (target_wire.ROW_*)
    or None (an error of Triton's own, such as a sequence without START)."""

    def __init__(self, code: int | None, message: str):
        super().__init__(message)
        self.code = code


class StreamBroken(Exception):
    """The stream itself failed (status: its grpc.StatusCode) or closed before the answer."""

    def __init__(self, status: grpc.StatusCode | None, message: str):
        super().__init__(message)
        self.status = status


def infer_request(
    model: str,
    inputs: dict[str, np.ndarray],
    outputs: list[str],
    corrid: int = 0,
    start: bool = False,
    end: bool = False,
) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest of named arrays (object arrays as BYTES), in Triton's sequence
    `corrid` (0: none) with its START / END flags; `TritonStream.call` gives it its id."""
    req = service_pb2.ModelInferRequest(model_name=model)
    for name, a in inputs.items():
        t = req.inputs.add()
        t.name, t.datatype = name, np_to_triton_dtype(a.dtype)
        t.shape.extend(a.shape)
        raw = (
            serialize_byte_tensor(a).item()
            if a.dtype == np.object_
            else np.ascontiguousarray(a).tobytes()
        )
        req.raw_input_contents.append(raw)
    for name in outputs:
        req.outputs.add().name = name
    if corrid:
        req.parameters["sequence_id"].int64_param = int(corrid)
        req.parameters["sequence_start"].bool_param = bool(start)
        req.parameters["sequence_end"].bool_param = bool(end)
    return req


def result(resp: service_pb2.ModelStreamInferResponse) -> InferResult:
    """The answer's outputs (InferResult.as_numpy), or StreamError."""
    if resp.error_message:
        raise StreamError(*target_wire.split_error(resp.error_message))
    return InferResult(resp.infer_response)


class TritonStream:
    """One ModelStreamInfer call carrying many requests; create and use it in one event loop."""

    def __init__(self, url: str, metadata: tuple = ()):
        self.url = url
        self._metadata = metadata
        self._channel: grpc.aio.Channel | None = None
        self._queue: asyncio.Queue | None = None  # requests to write; None ends the call
        self._pending: dict[str, asyncio.Future] = {}  # request id -> its answer
        self._reader: asyncio.Task | None = None
        self._ids = itertools.count(1)

    async def call(
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None = None
    ) -> InferResult:
        """Send one request, await its answer (StreamError, StreamBroken, asyncio.TimeoutError).
        An answer read after the deadline is late, as gRPC deadlines are, even when the loop
        (busy, or descheduled) reads it in the same pass as the timer."""
        if self._reader is None or self._reader.done():
            self._open()
        rid = str(next(self._ids))
        request.id = rid
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        fut = loop.create_future()
        self._pending[rid] = fut
        self._queue.put_nowait(request)
        try:
            resp = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._pending.pop(rid, None)  # a late answer to a timed-out request is dropped
        if deadline is not None and loop.time() > deadline:
            raise TimeoutError
        return result(resp)

    def _open(self) -> None:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.url, options=CHANNEL_OPTIONS)
        self._queue = asyncio.Queue()
        call = service_pb2_grpc.GRPCInferenceServiceStub(self._channel).ModelStreamInfer(
            self._requests(self._queue), metadata=self._metadata
        )
        self._reader = asyncio.ensure_future(self._read(call, self._queue))

    @staticmethod
    async def _requests(q: asyncio.Queue):
        while (req := await q.get()) is not None:
            yield req

    async def _read(self, call, q: asyncio.Queue) -> None:
        error = StreamBroken(None, f"target at {self.url}: the stream closed")
        try:
            async for resp in call:
                fut = self._pending.get(resp.infer_response.id)
                if fut is not None and not fut.done():
                    fut.set_result(resp)
        except grpc.aio.AioRpcError as e:
            error = StreamBroken(e.code(), f"target at {self.url}: {e.code().name}: {e.details()}")
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            q.put_nowait(None)
            for fut in list(self._pending.values()):  # every request on it was lost with it
                if not fut.done():
                    fut.set_exception(error)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()


def call_once(
    url: str, request: service_pb2.ModelInferRequest, metadata: tuple = (), timeout_s: float = 5.0
) -> InferResult:
    """One request on a stream of its own, blocking (health probes, scripts): its answer, or
    StreamError / StreamBroken (grpc.StatusCode.DEADLINE_EXCEEDED past timeout_s)."""
    with grpc.insecure_channel(url, options=CHANNEL_OPTIONS) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([request]), metadata=metadata, timeout=timeout_s
        )
        try:
            for resp in call:
                return result(resp)
        except grpc.RpcError as e:
            raise StreamBroken(
                e.code(), f"target at {url}: {e.code().name}: {e.details()}"
            ) from None
        finally:
            call.cancel()
    raise StreamBroken(None, f"target at {url}: the stream closed without an answer")
