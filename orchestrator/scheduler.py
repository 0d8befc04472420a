"""The orchestrator's scheduler: continuous batching of speculative rounds over every request.

One loop serves every active request. Each iteration is one round for all of them
(flashmap.rounds.speculative_round): one batched call to the drafter (a DraftRequest carrying
every sequence that can draft), then one packed verify request to Triton carrying every row
(one forward), then rejection sampling and the tokens to each request's stream. Requests
beyond the target's KV slots wait in a queue; past `max_queue` they are refused with
RESOURCE_EXHAUSTED; requests sent together start in one round (orchestrator.admission). A
drafter that is down or late costs speed, not correctness: the round runs without drafts
(autoregressive) and is counted; health says what the target's calls say (orchestrator.health).
Requests whose target died wait, parked, for the restarted one and continue on it
(orchestrator.resume).

The front ends (orchestrator.grpc_api, orchestrator.openai_api) build a request with
`make_request` (orchestrator.requests) and run it with `stream`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from flashmap.drafts import SeqId
from flashmap.pipeline import Ahead, pipelined_round
from flashmap.rounds import speculative_round
from flashmap.sequence import Sequence
from flashmap.speculation import ControllerConfig, SpeculationController
from flashmap.types import BLOCK_SIZE, GenerationRequest, InvalidRequest, TargetLost
from flashmap.v1 import serving_pb2
from orchestrator.admission import BurstConfig, BurstGate
from orchestrator.config import OrchestratorConfig
from orchestrator.drafter_client import DrafterClient, ServiceDrafter
from orchestrator.health import TargetHealth
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.request_stream import request_stream
from orchestrator.requests import Outcome, Piece, build_request
from orchestrator.resume import Parking
from orchestrator.target_client import TargetClient, TritonTarget

log = logging.getLogger("flashmap.orchestrator")
SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["FlashMap"].full_name


@dataclass
class _Active:
    seq: Sequence
    queue: asyncio.Queue  # (tokens, their log-probabilities or None), then None when finished
    request_id: str
    t_arrival: float
    t_first: float | None = None
    t_last: float | None = None
    deadline: float | None = None  # time.monotonic() past which it ends (DEADLINE_EXCEEDED)


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.target = TargetClient(
            cfg.target_url, cfg.target_model, timeout_s=cfg.target_timeout_s, key=cfg.target_key
        )
        self.drafter = (
            DrafterClient(cfg.drafter_url, token=cfg.drafter_token) if cfg.drafter_url else None
        )
        self.drafter_port = (
            ServiceDrafter(self.drafter, cfg.draft_timeout_s, cfg.top_m) if self.drafter else None
        )
        # After start(): they need the target's context length and the drafter's block size.
        self.target_port: TritonTarget | None = None
        self.parked: Parking | None = None  # requests waiting for a restarted target
        self.controller: SpeculationController | None = None
        self.tokenizer = None
        if cfg.tokenizer_dir:
            from flashmap.tokenizer import TextTokenizer

            try:
                self.tokenizer = TextTokenizer(cfg.tokenizer_dir)
            except FileNotFoundError as e:  # serve token ids; text prompts get INVALID_ARGUMENT
                log.warning("no tokenizer: %s", e)
        self.info = None
        self.metrics: OrchestratorMetrics | None = None
        self.waiting: deque[_Active] = deque()
        self.active: dict[SeqId, _Active] = {}
        self.by_request: dict[str, _Active] = {}
        self._wake = asyncio.Event()
        self.burst = BurstGate(BurstConfig(cfg.burst_window_s, cfg.burst_gap_s))
        self._loop_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()  # slots being freed on the target and the drafter
        self._outbox: list[tuple[_Active, tuple | None]] = []  # not yet on their streams
        self.health = TargetHealth(SERVICE_NAME, cfg.health_interval_s)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="orchestrator-tokenize")

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        for _ in range(600):  # Triton may still be loading the model
            try:
                if await self.target.ready():
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            await asyncio.sleep(0.5)
        self.info = await self.target.info()
        self.target_port = TritonTarget(self.target, self.info.max_seq_len)
        self.parked = Parking(self.target_port, self.cfg.resume_timeout_s)
        if self.drafter is not None:
            await self.drafter.ensure_connected()
        self.metrics = OrchestratorMetrics(block_size=self._block_size())
        if self.cfg.speculation == "auto" and self.drafter is not None:
            self.controller = SpeculationController(
                self._block_size(),
                ControllerConfig(
                    packed=self.info.packed_verify,
                    plain_tokens=self.cfg.plain_tokens,
                    lazy_features=self.info.feature_bytes_per_token > 0,
                    shadow_probes=self.cfg.pipeline,
                ),
            )
        self.metrics.drafter_steps.labels(drafter=self.drafter_name()).set(
            self.drafter.steps if self.drafter else 0
        )
        # The drafter's step count and the paper's 1 and 2 jumps: the counts users switch between
        # (once connected: the drafter's name is a label).
        connected = self.drafter is not None and self.drafter.connected
        steps = sorted({1, 2, self.drafter.steps}) if connected else []
        self.metrics.start_at_zero(self.info.model_name, [self._labels(n) for n in steps])
        self.max_concurrent = self.cfg.max_concurrent or self.info.n_slots
        self._loop_task = asyncio.create_task(self._scheduler())
        self._health_task = asyncio.create_task(
            self.health.watch(self.target, lambda: bool(self.active))
        )
        log.info(
            "orchestrator ready: target %s (%d slots, vocab %d), drafter %s",
            self.info.model_name,
            self.info.n_slots,
            self.info.vocab_size,
            self.cfg.drafter_url or "none",
        )

    async def stop(self) -> None:
        for task in (self._loop_task, self._health_task):
            if task:
                task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.drafter:
            await self.drafter.close()
        await self.target.close()

    def _block_size(self) -> int:
        return self.drafter.block_size if self.drafter is not None else BLOCK_SIZE

    def drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    def _labels(self, steps: int) -> dict:
        return {"model": self.info.model_name, "drafter": self.drafter_name(), "steps": str(steps)}

    # -- requests ----------------------------------------------------------------
    def make_request(self, prompt, options, request_id: str = "") -> GenerationRequest:
        """A validated GenerationRequest of a front end's Prompt and RequestOptions
        (orchestrator.requests.build_request); InvalidRequest for anything the server refuses."""
        return build_request(self.cfg, self.tokenizer, self.info, prompt, options, request_id)

    async def request_async(self, build, *args):
        """build(*args) (make_request, grpc_api.request_of) on a worker thread:
        tokenising a long prompt must not stall every other stream."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, build, *args)

    def submit(self, gen: GenerationRequest, deadline: float | None = None) -> _Active:
        if len(self.waiting) >= self.cfg.max_queue and len(self.active) >= self.max_concurrent:
            raise OverflowError(f"queue full ({self.cfg.max_queue} waiting requests)")
        if gen.request_id in self.by_request:
            raise InvalidRequest(f"request_id {gen.request_id!r} is already running")
        # Random ids: a client that reaches Triton or the drafter cannot guess another request's.
        sid = secrets.randbelow(2**62 - 1) + 1  # Triton's correlation id; the seq id its string
        while str(sid) in self.active:
            sid = secrets.randbelow(2**62 - 1) + 1
        a = _Active(
            Sequence(str(sid), gen, self._block_size(), handle=sid),
            asyncio.Queue(),
            gen.request_id,
            time.perf_counter(),
            deadline=deadline,
        )
        self.waiting.append(a)
        self.by_request[gen.request_id] = a
        self.metrics.queued_requests.labels(model=self.info.model_name).set(len(self.waiting))
        self.burst.arrived(a.t_arrival)
        self._wake.set()
        return a

    def wake(self) -> None:
        """A request changed outside a round (it ended): the loop looks again."""
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        a = self.by_request.get(request_id)
        if a is None:
            return False
        a.seq.abort()
        self._wake.set()
        return True

    # -- scheduling ----------------------------------------------------------------
    async def _scheduler(self) -> None:
        ahead: Ahead | None = None  # the next round, already sent
        while True:
            try:
                if await self._admit_and_reap():
                    # The releases just created start (TritonTarget.verify waits for them).
                    await asyncio.sleep(0)
                if ahead is not None and all(s.finished for s in ahead.seqs):
                    ahead = None  # nothing left to commit (releases wait for its call)
                if not self.active:
                    self._flush()
                    self._wake.clear()
                    await self._wake.wait()
                    if self.waiting:
                        if self.burst.open(time.perf_counter(), len(self.waiting)):
                            await self._gather_burst()
                        self.burst.started(min(len(self.waiting), self.max_concurrent))
                    continue
                if self.parked.since:
                    ahead = self.parked.drop_ahead(ahead)
                    await self._resume()
                    if all(sid in self.parked for sid in self.active):
                        self._flush()
                        await self.parked.idle(self._wake)
                        continue
                # The last round's tokens reach their streams once this round's first call
                # (draft or verify) is on the wire: the task's first step runs before the
                # flush, and the flush queues the stream handlers behind the call's send, so
                # the clients' chunks are written while the target computes.
                this_round = asyncio.ensure_future(self._round(ahead))
                asyncio.get_running_loop().call_soon(self._flush)
                ahead = await this_round
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive any single bad round
                log.exception("scheduler round failed")
                ahead = None
                self._flush()
                await asyncio.sleep(0.05)

    async def _gather_burst(self) -> None:
        """Wait for the rest of the burst the scheduler woke into (orchestrator.admission),
        while slots are free for it."""
        t0 = now = time.perf_counter()
        while (
            len(self.waiting) < self.max_concurrent - len(self.active)
            and (t := self.burst.until(now)) is not None
        ):
            await asyncio.sleep(t - now)
            now = time.perf_counter()
        self.metrics.burst_wait.labels(model=self.info.model_name).observe(now - t0)

    def _flush(self) -> None:
        """Hand the held pieces and ends to their streams, in the order they were made."""
        out, self._outbox = self._outbox, []
        for a, item in out:
            a.queue.put_nowait(item)

    async def _admit_and_reap(self) -> bool:
        """Fail requests past their deadline, free finished ones, admit waiting ones. True when
        a release was started."""
        name = self.info.model_name
        released = False
        now = time.monotonic()
        for a in [*self.waiting, *self.active.values()]:
            why = self.parked.overdue(a.seq.seq_id, now, a.deadline)
            if why is None and a.deadline is not None and now > a.deadline:
                why = TimeoutError("the request's deadline passed")
            if why is not None:
                a.seq.fail(why)
        # Aborted or cancelled requests leave before their next round.
        for a in list(self.waiting):
            if a.seq.finished:
                self.waiting.remove(a)
                self._finish(a, "abort")
        for sid, a in list(self.active.items()):
            if a.seq.finished:
                await self._release(sid, a)
                released = True
        while self.waiting and len(self.active) < self.max_concurrent:
            a = self.waiting.popleft()
            self.active[a.seq.seq_id] = a
        self.metrics.active_requests.labels(model=name).set(len(self.active))
        self.metrics.queued_requests.labels(model=name).set(len(self.waiting))
        return released

    async def _release(self, sid: SeqId, a: _Active) -> None:
        """Free the request's slots on both sides, in the background: a stalled part must not
        hold up the other requests' rounds (its slot is freed by its idle timeout at worst)."""
        del self.active[sid]
        self.parked.forget(sid)
        task = asyncio.create_task(self._release_parts(sid, a))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        self._finish(a, a.seq.finish_reason or "abort")

    async def _release_parts(self, sid: SeqId, a: _Active) -> None:
        try:
            await self.target_port.release(a.seq.handle)
        except Exception as e:  # noqa: BLE001 - Triton's idle timeout frees it anyway
            log.warning("release of sequence %s on the target failed: %s", sid, e)
        if self.drafter_port is not None:
            await self.drafter_port.release([a.seq])

    def _finish(self, a: _Active, reason: str) -> None:
        """The request holds nothing any more: its stream ends (Orchestrator.stream counts it)."""
        self.by_request.pop(a.request_id, None)
        self._outbox.append((a, None))

    async def _resume(self) -> None:
        """Continue the parked requests when the target is back (orchestrator.resume)."""
        parked = [self.active[sid].seq for sid in self.parked.since if sid in self.active]
        back = await self.parked.resume([s for s in parked if not s.finished])
        if back:
            self.metrics.resumed_requests.labels(model=self.info.model_name).inc(len(back))
            await self.health.set(True)
            log.info("%d request(s) continue on the restarted target", len(back))

    async def _round(self, ahead: Ahead | None) -> Ahead | None:
        """One round: of every active request, or the round sent ahead (its requests; one that
        ended since commits nothing) and, beside it, the prompts of the requests admitted since
        it was sent, so they wait for no more than the round in flight. Returns the next round
        if this one sent it ahead: only when no request waits or is new."""
        t_round = time.perf_counter()
        ready = [a.seq for sid, a in self.active.items() if sid not in self.parked]
        seqs = ahead.seqs if ahead is not None else ready
        ids = {s.seq_id for s in seqs}
        fresh = [s for s in ready if s.seq_id not in ids]
        # A new prompt with slots free: requests arrive in bursts. A round sent ahead now would
        # run this prompt's sequence alone while the ones arriving meanwhile prefill in a call
        # of their own (a forward more), and it would end a round before them. A lone request
        # that came in no burst (one client at a time) sends its first decode behind its prompt,
        # which would otherwise idle the target while the prompt's answer travels back.
        burst = (
            len(self.active) < self.max_concurrent
            and not all(s.prefilled for s in seqs)
            and (len(self.active) > 1 or self.burst.in_burst)
        )
        send = self.cfg.pipeline and not self.waiting and not fresh and not burst
        how = (self.controller, self.cfg.tree_blocks, self.cfg.plain_tokens)
        rounds = [
            pipelined_round(
                seqs,
                self.target_port,
                self.drafter_port,
                *how,
                ahead,
                send,
                self.cfg.tree_sampling,
                self.cfg.sibling_depth,
            )
        ]
        if fresh:  # prompts only: nothing to draft or plan; their call queues behind the other
            rounds.append(speculative_round(fresh, self.target_port))
        results = await asyncio.gather(*rounds)
        for res in results:
            await self._account(res, t_round)
        return results[0].ahead

    async def _account(self, res, t_round: float) -> None:
        """A finished round's metrics, the target's health, and its tokens to their streams."""
        name = self.info.model_name
        self.metrics.record_result(res, name)
        if self.drafter is not None:
            self.metrics.drafter_steps.labels(drafter=self.drafter_name()).set(self.drafter.steps)
            if res.draft_s:  # one observation per drafter call (a call drafts the whole batch)
                self.metrics.draft_latency.labels(
                    **self._labels(res.draft_steps or self.drafter.steps)
                ).observe(res.draft_s)
        target_failure = next(
            (
                r.error
                for r in res.sequences
                if r.error is not None and not isinstance(r.error, (InvalidRequest, ValueError))
            ),
            None,
        )
        if target_failure is not None:
            await self.health.set(False, str(target_failure))
        elif any(not r.error for r in res.sequences):
            await self.health.set(True)
        now = time.perf_counter()
        for r in res.sequences:
            a = self.active.get(r.seq.seq_id)
            if isinstance(r.error, TargetLost) and a is not None and not r.seq.finished:
                self.parked.park(r.seq)  # committed nothing: it resumes on the restarted target
            if r.fallback:
                self.metrics.fallback_rounds.labels(model=name, reason=r.fallback).inc()
            if r.error is not None or a is None:
                continue
            if r.prefill:
                self.metrics.prompt_tokens.labels(model=name).inc(a.seq.n_prompt)
            elif r.drafted:
                self.metrics.record_round(self._labels(self.steps_of(a)), r.drafted, r.accepted)
            self._emit(a, r.new_tokens, now, r.logprobs)
        self.metrics.round_latency.labels(
            **self._labels(self.drafter.steps if self.drafter else 0)
        ).observe(time.perf_counter() - t_round)

    def stream(
        self, gen: GenerationRequest, stops: list[str] = (), deadline: float | None = None
    ) -> AsyncIterator[Piece | Outcome]:
        """Run one request: its pieces as they commit, then one Outcome (every front end, gRPC
        and HTTP, serves this; orchestrator.request_stream)."""
        return request_stream(self, gen, stops, deadline)

    def steps_of(self, a: _Active) -> int:
        """The flow-map jumps of the request's latest draft (else its own, else the drafter's)."""
        return (
            a.seq.stats.draft_steps
            or a.seq.request.draft_steps
            or (self.drafter.steps if self.drafter else 0)
        )

    def _emit(self, a: _Active, new: list[int], now: float, logprobs: list | None = None) -> None:
        if not new:
            return
        name = self.info.model_name
        if a.t_first is None:
            a.t_first = now
            self.metrics.ttft.labels(model=name).observe(now - a.t_arrival)
        elif a.t_last is not None:
            per_token = (now - a.t_last) / len(new)
            for _ in new:
                self.metrics.itl.labels(model=name).observe(per_token)
        a.t_last = now
        self.metrics.generated_tokens.labels(model=name).inc(len(new))
        self._outbox.append((a, (new, logprobs)))
