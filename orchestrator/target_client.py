"""Orchestrator-side async client of the Triton-hosted target (model "flashmap_target").

numpy + grpc + tritonclient only: the orchestrator has no torch. Tensors are encoded and
decoded by flashmap.target_wire, the same codec the model uses. The model is decoupled: every request
goes on one gRPC stream (flashmap.triton_stream), matched to its answer by id.

    client = TargetClient("127.0.0.1:8001")
    info = await client.info()                      # vocab size, feature layers, slots, eos ids ...
    out = await client.verify_rows([(seq_id, row, True, False), ...])  # a round: one request
    res = await client.verify(seq_id, row, start=True)   # one row: a request of its own
    await client.release(seq_id)                    # finish / cancel: frees the KV slot

The correlation id of a sequence is seq_id (> 0); row.slot is ignored (the server maps
correlation ids to KV slots). `verify_rows` sends a packed round (flashmap.target_wire): every row
in one request, verified in one forward. `verify` / `release` are one-row requests in
Triton's sequence batcher (a sequence is either packed or one-row: Triton only knows the
sequences it saw START for). `TritonTarget` is the round loop's Target (flashmap.rounds) on
top of the client; it sends packed rounds.

Errors: InvalidRequest (bad input; Triton INVALID_ARGUMENT, with the model's message),
TargetUnavailable (cannot connect, not ready, no free KV slot, deadline), TargetError
(anything else the server reports). TargetDown, the TargetUnavailable of a request that never
reached a live model (the stream broke, the server or its model is down or loading), is a
flashmap.types.TargetLost: the round loop rewinds its sequences rather than failing them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field, fields

import grpc
import numpy as np
from tritonclient.utils import InferenceServerException

from flashmap import target_wire
from flashmap.auth import TARGET_KEY_GRPC_HEADER
from flashmap.triton_stream import (
    CHANNEL_OPTIONS,
    StreamBroken,
    StreamError,
    TritonStream,
    infer_request,
)
from flashmap.types import InvalidRequest, TargetLost, VerifyResult, VerifyRow

DEFAULT_MODEL = "flashmap_target"
# After a verify timed out: how long a probe may take to tell a dead target from a stalled one.
DOWN_PROBE_S = 2.0
# Info requests use throw-away correlation ids far above any seq_id the orchestrator hands out.
_INFO_CORRID_BASE = 1 << 62


class TargetUnavailable(ConnectionError):
    """The target cannot serve now: unreachable, not ready, or out of KV slots."""


class TargetDown(TargetUnavailable, TargetLost):
    """The request never reached a live model: the server is gone or restarting, or its model
    is not loaded (it lost every sequence it held)."""


class TargetTimeout(TargetUnavailable, TimeoutError):
    """The target did not answer within the call's deadline."""


class TargetError(RuntimeError):
    """The target failed a request for a reason other than bad input (see the message)."""


@dataclass(frozen=True)
class TargetInfo:
    """What the served target reports about itself (model.py's INFO_JSON)."""

    model_name: str  # the checkpoint directory's name (for metric labels)
    vocab_size: int
    hidden_size: int
    num_layers: int
    feature_layers: list[int]
    feature_dim: int
    max_seq_len: int
    n_slots: int
    eos_token_ids: list[int]
    kv_bytes_per_token: int = 0
    feature_bytes_per_token: int = (
        0  # > 0: the target keeps every position's features (VerifyRow.features_from)
    )
    idle_timeout_s: float = 0.0
    features_dtype: str = "float32"
    device: str = ""
    dtype: str = ""
    model_dir: str = ""
    triton_model: str = DEFAULT_MODEL
    # A verify costs its rows' total tokens (target_service.packing); False: padded (CUDA graphs).
    packed_verify: bool = True
    extra: dict = field(default_factory=dict)  # keys this client does not know yet

    @classmethod
    def from_dict(cls, d: dict) -> TargetInfo:
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(
            **{k: v for k, v in d.items() if k in known},
            extra={k: v for k, v in d.items() if k not in known},
        )


class TargetClient:
    """Async gRPC client of the flashmap_target model. Create and use it inside one event loop."""

    def __init__(
        self,
        url: str = "127.0.0.1:8001",
        model: str = DEFAULT_MODEL,
        timeout_s: float | None = None,
        key: str = "",
    ):
        """timeout_s: deadline of every call (None = none); key: Triton's restricted-protocol
        key (flashmap.auth.TARGET_KEY_GRPC_HEADER), "" when the server has none."""
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        self._headers = {TARGET_KEY_GRPC_HEADER: key} if key else None
        self._client = None
        self._stream: TritonStream | None = None
        self._info: TargetInfo | None = None

    def _grpc(self):
        # Created on first use so that the gRPC channel belongs to the running event loop.
        if self._client is None:
            from tritonclient.grpc.aio import InferenceServerClient

            self._client = InferenceServerClient(self.url, channel_args=CHANNEL_OPTIONS)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.close()

    async def __aenter__(self) -> TargetClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ health / info

    async def ready(self, timeout_s: float = 2.0) -> bool:
        """True when the server and the model say they are ready (Triton's own health; it does
        not see a dead Python-backend stub: `probe` does); False when not or unreachable."""
        try:
            c = self._grpc()
            return bool(await c.is_server_ready(client_timeout=timeout_s)) and bool(
                await c.is_model_ready(self.model, client_timeout=timeout_s)
            )
        except InferenceServerException:
            return False

    async def probe(self, timeout_s: float = 5.0) -> bool:
        """A real request through the model (an INFO round trip): False when the model cannot answer."""
        try:
            await self.info(refresh=True, timeout_s=timeout_s)
            return True
        except (TargetUnavailable, TargetError, InvalidRequest):
            return False

    async def wait_ready(self, timeout_s: float = 60.0, interval_s: float = 0.25) -> None:
        """Wait until ready(); raise TargetUnavailable after timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.ready():
            if loop.time() > deadline:
                raise TargetUnavailable(
                    f"target {self.model!r} at {self.url} not ready after {timeout_s:g}s"
                )
            await asyncio.sleep(interval_s)

    async def info(self, refresh: bool = False, timeout_s: float | None = None) -> TargetInfo:
        """Model metadata (cached). Asked as a START+END request with INFO = true.

        It passes through the sequence batcher like any sequence, so while every KV slot
        is busy it waits in Triton's backlog until a sequence ends.
        """
        if self._info is None or refresh:
            corrid = _INFO_CORRID_BASE + random.getrandbits(60)
            result = await self._infer(
                target_wire.info_inputs(),
                ["INFO_JSON"],
                corrid,
                start=True,
                end=True,
                timeout_s=timeout_s,
            )
            raw = result.as_numpy("INFO_JSON").reshape(-1)[0]
            self._info = TargetInfo.from_dict(
                json.loads(raw.decode() if isinstance(raw, bytes) else raw)
            )
        return self._info

    # ------------------------------------------------------------------ verify / release

    async def verify(
        self, seq_id: int, row: VerifyRow, start: bool, end: bool = False
    ) -> VerifyResult:
        """Verify one row of sequence seq_id (one target forward, shared with concurrent calls).

        start: first request of the sequence (allocates its KV slot; restarts it if it had one).
        end: release the slot after this verify (saves a release() call).
        """
        _check_seq_id(seq_id)
        r = await self._infer(
            target_wire.verify_inputs(row), target_wire.VERIFY_OUTPUTS, seq_id, start=start, end=end
        )
        return target_wire.parse_verify_outputs(r.as_numpy)[0]

    async def verify_rows(
        self,
        items: list[tuple[int, VerifyRow | None, bool, bool]],
        timeout_s: float | None = None,
    ) -> list:
        """A whole round in one request (a packed round, flashmap.target_wire): per item (seq_id, row or
        None for a release, start, end) -> (VerifyResult, a tree row's path), None for a release,
        or the exception a one-row request would have raised. A failure of the request itself
        raises. timeout_s: this call's deadline (default: the client's)."""
        for seq_id, *_ in items:
            _check_seq_id(seq_id)
        blob, bad = target_wire.packed_round(
            [(seq_id, start, end, row) for seq_id, row, start, end in items]
        )
        out = []
        if len(bad) < len(items):
            corrid = _INFO_CORRID_BASE + random.getrandbits(60)  # a one-request sequence of its own
            r = await self._infer(
                {"ROWS": np.array([[blob]], np.object_)},
                ["ROWS_OUT"],
                corrid,
                start=True,
                end=True,
                timeout_s=timeout_s,
            )
            out = target_wire.parse_packed_outputs(r.as_numpy("ROWS_OUT").reshape(-1)[0])
            if len(out) != len(items) - len(bad):
                raise TargetError(
                    f"target at {self.url}: {len(out)} answers for {len(items) - len(bad)} rows"
                )
        answers = iter(out)
        return [bad[k] if k in bad else _row_answer(next(answers)) for k in range(len(items))]

    async def release(self, seq_id: int) -> None:
        """End sequence seq_id and free its KV slot (finish or cancel). Idempotent."""
        _check_seq_id(seq_id)
        try:
            await self._infer(
                target_wire.release_inputs(),
                target_wire.VERIFY_OUTPUTS,
                seq_id,
                start=False,
                end=True,
            )
        except InvalidRequest as e:
            # Triton (no START) or the model (unknown sequence) refuse END for a sequence that is
            # gone (ended, or dropped after the idle timeout): then there is nothing left to free.
            if "START" not in str(e) and "unknown sequence" not in str(e):
                raise

    async def _infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        corrid: int,
        *,
        start: bool,
        end: bool,
        timeout_s: float | None = None,
    ):
        """One request on the client's stream (the model is decoupled: flashmap.triton_stream)."""
        if self._stream is None:
            self._stream = TritonStream(self.url, tuple((self._headers or {}).items()))
        timeout_s = timeout_s or self.timeout_s
        try:
            return await self._stream.call(
                infer_request(self.model, inputs, outputs, corrid, start, end), timeout_s
            )
        except TimeoutError:
            raise TargetTimeout(
                f"target at {self.url}: no answer within the deadline ({timeout_s:g}s)"
            ) from None
        except (StreamError, StreamBroken) as e:
            raise _map_error(e, self.url) from None


_ROW_ERRORS = {
    target_wire.ROW_INVALID: InvalidRequest,
    target_wire.ROW_UNAVAILABLE: TargetUnavailable,
    target_wire.ROW_INTERNAL: TargetError,
}


def _row_answer(o):
    """A packed round's answer for one row: (result, path), None (released), or the exception."""
    return _ROW_ERRORS[o[0]](o[1]) if isinstance(o, tuple) and isinstance(o[0], int) else o


def _check_seq_id(seq_id: int) -> None:
    if not isinstance(seq_id, (int, np.integer)) or not 0 < int(seq_id) < _INFO_CORRID_BASE:
        raise InvalidRequest(f"seq_id must be an integer in [1, 2^62), got {seq_id!r}")


# Triton's own answers (no row code) that mean "not now" rather than "bad request".
_UNAVAILABLE_WORDS = (
    "unknown model",
    "not found",
    "not ready",
    "unavailable",
    "not healthy",
    "stub",
)


def _map_error(e: StreamError | StreamBroken, url: str) -> Exception:
    message = str(e)
    if isinstance(e, StreamBroken):
        if e.status == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TargetTimeout(f"target at {url}: no answer within the deadline ({message})")
        if e.status in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return TargetDown(message)
        if e.status == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidRequest(message)
        return TargetError(message)
    if e.code is None:  # Triton's own: a request it refused, or a model it cannot run now
        if any(w in message.lower() for w in _UNAVAILABLE_WORDS):
            return TargetDown(f"target at {url}: {message}")
        return InvalidRequest(message)
    return _ROW_ERRORS.get(e.code, TargetError)(message)


class TritonTarget:
    """The round loop's Target (flashmap.rounds) over a TargetClient: a round is one packed
    request (every row, one forward). row.slot is the sequence's correlation id; its first
    row carries START. Two rounds may be in flight (flashmap.rounds.Ahead); a release waits
    for the verifies in flight that hold a row of its sequence."""

    def __init__(self, client: TargetClient, max_seq_len: int):
        self.client = client
        self.max_seq_len = max_seq_len
        self.started: set[int] = set()  # correlation ids holding a KV slot
        self._releasing: set[asyncio.Task] = set()
        self._verifying: dict[
            int, set[asyncio.Future]
        ] = {}  # correlation id -> its verifies in flight
        self._order = (
            asyncio.Lock()
        )  # verifies go out in the order they are made (an Ahead follows its round)

    async def verify(self, rows: list[VerifyRow], last: list[bool] | None = None) -> list:
        # A new sequence may need the slot a finished one is handing back: wait for the
        # releases under way (the caller lets the ones it just created start first). The wait
        # counts against the verify's deadline: a hung target fails the round within one timeout.
        budget = self.client.timeout_s
        t0 = time.monotonic()
        async with self._order:
            if self._releasing and any(r.slot not in self.started for r in rows):
                await asyncio.wait(set(self._releasing), timeout=budget)
            last = last or [False] * len(rows)
            items = [(r.slot, r, r.slot not in self.started, end) for r, end in zip(rows, last)]
            self.started.update(r.slot for r in rows)
            call = asyncio.ensure_future(
                self.client.verify_rows(
                    items, None if budget is None else max(budget - (time.monotonic() - t0), 1e-3)
                )
            )
            for r in rows:
                self._verifying.setdefault(r.slot, set()).add(call)
            call.add_done_callback(lambda c, ids=[r.slot for r in rows]: self._verified(c, ids))
            await asyncio.sleep(
                0
            )  # the call's first step starts the request before the next verify's
        try:
            out = await call
        except (
            InvalidRequest,
            TargetUnavailable,
            TargetError,
        ) as e:  # the request failed: every row did
            if isinstance(e, (TargetTimeout, TargetError)):
                e = await self._down_or(e)
            if isinstance(e, TargetLost):  # a target back from a restart holds none of them
                self.started.difference_update(r.slot for r in rows)
            return [e] * len(rows)
        # A row sent with END that succeeded freed its slot on the server: the sequence's
        # release() has nothing left to send. A failed one may still hold it: release() frees it.
        self.started.difference_update(
            r.slot for r, end, o in zip(rows, last, out) if end and not isinstance(o, BaseException)
        )
        return out

    async def _down_or(self, failure: TargetTimeout | TargetError) -> Exception:
        """A verify that timed out or failed inside the server: TargetDown when a probe finds
        the target down (a model whose Python stub died never answers the requests it held; a
        tritonserver killed mid-call may answer INTERNAL first), else the failure itself (a
        stalled target is not waited for, a failing one not retried)."""
        try:
            await self.client.info(refresh=True, timeout_s=DOWN_PROBE_S)
        except TargetDown as e:
            return TargetDown(f"{failure}; the target is down: {e}")
        except (TargetUnavailable, TargetError, InvalidRequest):
            pass
        return failure

    def _verified(self, call: asyncio.Future, corrids: list[int]) -> None:
        for corrid in corrids:
            calls = self._verifying.get(corrid)
            if calls is not None:
                calls.discard(call)
                if not calls:
                    del self._verifying[corrid]

    async def release(self, corrid: int) -> None:
        if corrid in self.started:
            self.started.discard(corrid)
            task = asyncio.ensure_future(self._release(corrid))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            await task

    async def _release(self, corrid: int) -> None:
        if self._verifying.get(corrid):
            await asyncio.wait(set(self._verifying[corrid]), timeout=self.client.timeout_s)
        (out,) = await self.client.verify_rows([(corrid, None, False, True)])
        # A sequence already gone (the idle timeout) has nothing left to free.
        if isinstance(out, Exception) and not (
            isinstance(out, InvalidRequest) and "unknown sequence" in str(out)
        ):
            raise out
