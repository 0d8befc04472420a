"""The orchestrator's side of the drafter's bidirectional Draft stream.

One stream stays open; each call writes a DraftRequest (a batch of sequences) and
awaits the DraftResponse with the same call_id. A background reader resolves
responses, so a late answer to a call that already timed out is dropped, not
mistaken for the next one. Failures never raise into the scheduler: `draft` returns
None and the caller decodes that round autoregressively (still exact).

A late drafter gets no new call until it has answered the one it is working on (it
serves the stream in order), so work does not pile up behind it. For the same reason
a release waits for that answer: sent earlier, it would reach the drafter before the
late call that still carries the sequence, which would then hold it until the idle
timeout.

`ServiceDrafter` is the round loop's Drafter (flashmap.rounds) on top of the client: it
sends each sequence's ask (flashmap.draft_call: its unacknowledged context, then what to draft)
and marks the context acknowledged only when a block comes back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from flashmap.auth import DRAFTER_TOKEN_HEADER
from flashmap.draft_call import ask, take
from flashmap.drafts import TOP_M, SeqId
from flashmap.round_metadata import DraftBatch, SeqPlan
from flashmap.sequence import Sequence
from flashmap.types import BLOCK_SIZE, DRAFT_STEPS
from flashmap.v1 import drafter_pb2, drafter_pb2_grpc
from flashmap.wire import answer_from_proto, ask_to_proto

log = logging.getLogger("flashmap.orchestrator.drafter")


class DrafterClient:
    def __init__(self, url: str, reconnect_interval_s: float = 1.0, token: str = ""):
        self.url = url
        self.reconnect_interval_s = reconnect_interval_s
        self._md = ((DRAFTER_TOKEN_HEADER, token),) if token else None  # the drafter's shared token
        self._channel: grpc.aio.Channel | None = None
        self._stub: drafter_pb2_grpc.DrafterStub | None = None
        self._call = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._inflight: asyncio.Future | None = None  # the last call written (answered or not)
        self._tasks: set[asyncio.Task] = set()  # deferred releases
        self._ids = itertools.count(1)
        self._last_attempt = 0.0
        self.connected = False
        self.block_size = BLOCK_SIZE  # until Stats says
        self.steps = DRAFT_STEPS  # until Stats says
        self.name = "flashmap"

    async def _connect(self) -> bool:
        now = time.monotonic()
        if now - self._last_attempt < self.reconnect_interval_s:
            return False
        self._last_attempt = now
        await self._teardown()
        try:
            self._channel = grpc.aio.insecure_channel(
                self.url,
                options=[
                    ("grpc.max_send_message_length", 256 << 20),
                    ("grpc.max_receive_message_length", 256 << 20),
                ],
            )
            self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
            stats = await self._stub.Stats(
                drafter_pb2.StatsRequest(), timeout=2.0, metadata=self._md
            )
            self.block_size, self.steps, self.name = (
                stats.block_size,
                stats.steps,
                stats.drafter or "flashmap",
            )
            self._call = self._stub.Draft(metadata=self._md)
            self._reader = asyncio.create_task(self._read_loop(self._call))
            self.connected = True
            log.info(
                "drafter connected at %s (%s, block %d, steps %d)",
                self.url,
                self.name,
                self.block_size,
                self.steps,
            )
            return True
        except (grpc.aio.AioRpcError, OSError) as e:
            why = e.details() if isinstance(e, grpc.aio.AioRpcError) else e
            log.warning("drafter at %s unavailable: %s", self.url, why)
            await self._teardown()
            return False

    async def _read_loop(self, call) -> None:
        try:
            async for resp in call:
                fut = self._pending.pop(resp.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(resp)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            if self._call is call:
                self.connected = False
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("drafter stream closed"))
            self._pending.clear()

    async def _teardown(self) -> None:
        self.connected = False
        self._inflight = None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def ensure_connected(self) -> bool:
        return self.connected or await self._connect()

    async def draft(
        self, sequences: list[drafter_pb2.SequenceDraft], timeout_s: float
    ) -> tuple[drafter_pb2.DraftResponse | None, str]:
        """Returns (response, "") or (None, reason) with reason "unavailable" or "timeout"."""
        if not await self.ensure_connected():
            return None, "unavailable"
        if self._inflight is not None and not self._inflight.done():
            return None, "timeout"  # still busy with a call that timed out
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(
            lambda f: f.cancelled() or f.exception()
        )  # nobody may await a late one
        self._pending[call_id] = fut
        self._inflight = fut
        try:
            await self._call.write(drafter_pb2.DraftRequest(call_id=call_id, sequences=sequences))
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s), ""
        except TimeoutError:
            return None, "timeout"  # the reader resolves fut when the answer comes
        except (
            grpc.aio.AioRpcError,
            ConnectionError,
            asyncio.InvalidStateError,
            grpc.aio.UsageError,
        ) as e:
            self._pending.pop(call_id, None)
            fut.cancel()
            log.warning("drafter call failed: %s", e)
            self.connected = False
            return None, "unavailable"

    async def release(self, seq_ids: list[str]) -> None:
        if not seq_ids or not self.connected:
            return
        late = self._inflight
        if late is not None and not late.done():
            task = asyncio.create_task(self._release_after(late, seq_ids))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        await self._release_now(seq_ids)

    async def _release_after(self, late: asyncio.Future, seq_ids: list[str]) -> None:
        await asyncio.wait([late], timeout=60.0)
        await self._release_now(seq_ids)

    async def _release_now(self, seq_ids: list[str]) -> None:
        if not self.connected:
            return
        try:
            await self._stub.Release(
                drafter_pb2.ReleaseRequest(seq_ids=seq_ids), timeout=2.0, metadata=self._md
            )
        except grpc.aio.AioRpcError:
            pass  # the drafter also drops idle sequences by itself

    async def close(self) -> None:
        await self._teardown()


class ServiceDrafter:
    """The round loop's Drafter over a DrafterClient (one batched call per round)."""

    def __init__(self, client: DrafterClient, timeout_s: float, top_m: int = TOP_M):
        self.client = client
        self.timeout_s = timeout_s
        self.top_m = top_m
        self.asked: set[SeqId] = set()  # sequences the drafter may hold context of
        # One call at a time: a round's call waits for a shadow probe's (flashmap.shadow_probes), where
        # the client would take the drafter for late and decode without a draft.
        self._one = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._one.locked()

    @property
    def block_size(self) -> int:
        return self.client.block_size

    async def draft(self, seqs: list[Sequence], plans: list[SeqPlan]) -> DraftBatch:
        async with self._one:  # taken at once when free: the asks below are made before any wait
            asks = [ask(s, p, self.top_m) for s, p in zip(seqs, plans)]
            self.asked.update(s.seq_id for s in seqs)
            resp, reason = await self.client.draft([ask_to_proto(a) for a in asks], self.timeout_s)
        out = DraftBatch(failure=reason)
        if resp is not None:
            answers = [answer_from_proto(b) for b in resp.blocks]
            take(seqs, asks, answers, out)
            for a in asks:  # the drafter's own step count: follow SetSteps switches
                if a.draft_steps is None and a.seq_id in out.blocks:
                    self.client.steps = out.blocks[a.seq_id][0].draft_steps
        return out

    async def release(self, seqs: list[Sequence]) -> None:
        held = [s for s in seqs if s.seq_id in self.asked]
        self.asked.difference_update(s.seq_id for s in held)
        await self.client.release([s.seq_id for s in held])
