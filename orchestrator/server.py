"""The orchestrator: public Generate server with continuous batching of speculative rounds.

One scheduler loop serves every active request. Each iteration is one round for all
of them: one batched call to the drafter (a DraftRequest carrying every sequence
that can draft), then one packed verify request to Triton carrying every row (one
forward), then rejection sampling and streaming per request. Requests
beyond the target's KV slots wait in a queue; past `max_queue` they are refused with
RESOURCE_EXHAUSTED; requests sent together start in one round (orchestrator.admission). A
drafter that is down or late costs speed, not correctness: the
round runs without drafts (autoregressive) and is counted. The OpenAI-compatible HTTP API
(orchestrator/openai_api.py, --http-port) serves the same requests through make_request / stream.

  python -m orchestrator.server --target-url 127.0.0.1:8001 --drafter-url 127.0.0.1:50052 \
      --tokenizer-dir checkpoints/demo-target --port 50051 --metrics-port 9400
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2

from flashmap.auth import (
    API_KEY_ENV,
    API_KEY_HEADER,
    DRAFTER_TOKEN_ENV,
    TARGET_KEY_ENV,
    bearer,
    read_secret,
)
from flashmap.grpc_serving import TokenAuth, add_service, run, serve_grpc
from flashmap.logs import fields, setup_logging
from flashmap.rounds import Ahead, speculative_round
from flashmap.sequence import Sequence
from flashmap.speculation import ControllerConfig, SpeculationController
from flashmap.tokenizer import IncrementalDecoder
from flashmap.types import (
    BLOCK_SIZE,
    DECODE_STEPS,
    MAX_DECODE_STEPS,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    SpecStats,
)
from flashmap.v1 import serving_pb2, serving_pb2_grpc
from flashmap.wire import stats_to_proto
from orchestrator.admission import BurstConfig, BurstGate
from orchestrator.drafter_client import DrafterClient, ServiceDrafter
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.target_client import TargetClient, TargetUnavailable, TritonTarget

log = logging.getLogger("flashmap.orchestrator")
SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["FlashMap"].full_name


@dataclass
class OrchestratorConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400  # 0 = no /metrics HTTP server
    target_url: str = "127.0.0.1:8001"
    target_model: str = "flashmap_target"
    drafter_url: str = "127.0.0.1:50052"  # "" = no drafter (autoregressive only)
    tokenizer_dir: str | None = None
    max_concurrent: int = 0  # 0 = the target's KV slots
    max_queue: int = 256
    draft_timeout_s: float = 2.0
    top_m: int = 4  # drafter support size at temperature > 0
    tree_blocks: int = (
        1  # > 1: greedy requests draft that many blocks from independent noise, verified as a tree
    )
    speculation: str = (
        "auto"  # auto: draft lengths from measured costs (flashmap.speculation); full: always K
    )
    # A round where nobody drafts decodes this many tokens per request in its one verify call
    # (flashmap.rounds): the call's fixed cost (gRPC, Triton, this loop) is paid once for them.
    decode_steps: int = DECODE_STEPS
    # While a round without drafts runs, the next one (if it drafts nothing either, no request is
    # waiting or new, and it is not a new prompt's round with slots free) is already queued at
    # Triton (flashmap.rounds.Ahead): the target goes from one to the next without waiting for
    # this loop, the network and Triton's request path between them.
    pipeline: bool = True
    # Requests sent together start in one round (orchestrator.admission): waking from idle into a
    # burst, the scheduler waits until none has arrived for burst_gap_s, at most burst_window_s.
    burst_window_s: float = BurstConfig.window_s  # 0 = start at once
    burst_gap_s: float = BurstConfig.gap_s
    # Trust boundaries (DESIGN.md): secrets come from the environment (flashmap.auth), "" = none.
    api_key: str = ""  # clients must send authorization: Bearer <api_key> (gRPC Health and grpc.health stay open)
    target_key: str = ""  # Triton's restricted-protocol key
    drafter_token: str = ""  # the drafter's shared token
    tls: tuple[str, str] | None = None  # (certificate chain, private key) files for the public port
    reflection: bool = False
    max_message_bytes: int = 4 << 20  # public API messages
    max_prompt_bytes: int = 1 << 20  # text prompts, refused before tokenising
    max_request_id_len: int = 128
    target_timeout_s: float = 30.0  # deadline of every call to Triton
    health_interval_s: float = (
        2.0  # idle: probe the target this often (busy: the verify calls tell)
    )
    http_port: int = 8080  # the OpenAI-compatible HTTP API (orchestrator/openai_api.py); 0 = off


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


@dataclass
class _Active:
    seq: Sequence
    queue: asyncio.Queue  # token lists, then None when finished
    request_id: str
    t_arrival: float
    t_first: float | None = None
    t_last: float | None = None
    deadline: float | None = (
        None  # time.monotonic() after which the request ends (DEADLINE_EXCEEDED)
    )


def _status_of(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.UNAVAILABLE


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.target = TargetClient(
            cfg.target_url,
            model=cfg.target_model,
            timeout_s=cfg.target_timeout_s,
            key=cfg.target_key,
        )
        self.drafter = (
            DrafterClient(cfg.drafter_url, token=cfg.drafter_token) if cfg.drafter_url else None
        )
        self.drafter_port = (
            ServiceDrafter(self.drafter, cfg.draft_timeout_s, cfg.top_m) if self.drafter else None
        )
        self.target_port: TritonTarget | None = (
            None  # after start(): needs the target's context length
        )
        self.controller: SpeculationController | None = None  # after start(): needs the block size
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
        self.active: dict[int, _Active] = {}
        self.by_request: dict[str, _Active] = {}
        self._wake = asyncio.Event()
        self.burst = BurstGate(BurstConfig(cfg.burst_window_s, cfg.burst_gap_s))
        self._loop_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()  # slots being freed on the target and the drafter
        self._outbox: list[
            tuple[_Active, list[int] | None]
        ] = []  # pieces and ends not yet on their streams
        self.health = (
            health.aio.HealthServicer()
        )  # the gRPC health the server exports (flipped by _set_target_ok)
        self.target_ok = True
        self._last_target_ok = time.monotonic()
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
        if self.drafter is not None:
            await self.drafter.ensure_connected()
        self.metrics = OrchestratorMetrics(block_size=self._block_size())
        if self.cfg.speculation == "auto" and self.drafter is not None:
            self.controller = SpeculationController(
                self._block_size(),
                ControllerConfig(
                    packed=self.info.packed_verify,
                    decode_steps=self.cfg.decode_steps,
                    lazy_features=self.info.feature_bytes_per_token > 0,
                    shadow_probes=self.cfg.pipeline,
                ),
            )
        self.metrics.drafter_steps.labels(drafter=self._drafter_name()).set(
            self.drafter.steps if self.drafter else 0
        )
        # Export the counters that alerts divide by at 0 from the start: a series that first
        # appears at its first increment has no rate() for that increment.
        for reason in ("unavailable", "timeout", "context_lost"):
            self.metrics.fallback_rounds.labels(model=self.info.model_name, reason=reason)
        for status in ("length", "stop", "abort", "error"):
            self.metrics.requests.labels(model=self.info.model_name, status=status)
        self.metrics.draft_length.labels(model=self.info.model_name)
        self.metrics.speculation_off_rounds.labels(model=self.info.model_name)
        self.metrics.rounds_ahead.labels(model=self.info.model_name)
        self.metrics.shadow_probes.labels(model=self.info.model_name)
        for kind in ("expected", "accepted"):
            self.metrics.controller_accepted.labels(model=self.info.model_name, kind=kind)
        self.metrics.burst_wait.labels(model=self.info.model_name)
        self.metrics.decode_steps.labels(model=self.info.model_name)
        self.max_concurrent = self.cfg.max_concurrent or self.info.n_slots
        self._loop_task = asyncio.create_task(self._scheduler())
        self._health_task = asyncio.create_task(self._health_loop())
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

    # -- health ------------------------------------------------------------------
    async def _set_target_ok(self, ok: bool, why: str = "") -> None:
        """Health tells the truth: NOT_SERVING while the target cannot verify, SERVING once it can."""
        if ok:
            self._last_target_ok = time.monotonic()
        if ok == self.target_ok:
            return
        self.target_ok = ok
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for svc in ("", SERVICE_NAME):
            await self.health.set(svc, status)
        log.warning(
            "target %s%s",
            "usable again: SERVING" if ok else "unusable: NOT_SERVING",
            f" ({why})" if why else "",
        )

    async def _health_loop(self) -> None:
        """While requests run, their verify calls say whether the target works; when idle (or
        when no verify has succeeded for a while) a probe request through the model does."""
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            stale = time.monotonic() - self._last_target_ok > max(
                3 * self.cfg.health_interval_s, 5.0
            )
            if self.active and not stale:
                continue
            ok = await self.target.probe(timeout_s=max(self.cfg.health_interval_s, 2.0))
            await self._set_target_ok(ok, "probe request failed" if not ok else "")

    def _block_size(self) -> int:
        return self.drafter.block_size if self.drafter is not None else BLOCK_SIZE

    def _drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    def _labels(self, steps: int) -> dict:
        return {"model": self.info.model_name, "drafter": self._drafter_name(), "steps": str(steps)}

    # -- requests ----------------------------------------------------------------
    def make_request(
        self,
        *,
        text: str | None = None,
        token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
        max_new_tokens: int | None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float | None = None,
        seed: int | None = None,
        stop_token_ids=(),
        ignore_eos: bool = False,
        draft_steps: int | None = None,
        max_draft_tokens: int | None = None,
        request_id: str = "",
    ) -> GenerationRequest:
        """A validated GenerationRequest from a front end's fields (gRPC Generate, the OpenAI API);
        InvalidRequest with a one-line message for anything the server refuses. `messages` is a
        conversation for the checkpoint's chat template; max_new_tokens None: the rest of the context.
        Tokenises a text prompt: call it off the event loop (`request_async`)."""
        if len(request_id) > self.cfg.max_request_id_len or not request_id.isprintable():
            raise InvalidRequest(
                f"request_id must be printable and at most {self.cfg.max_request_id_len} characters"
            )
        if (text is not None or messages is not None) and self.tokenizer is None:
            raise InvalidRequest("this server has no tokenizer: send token ids")
        if messages is not None:
            text = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        if text is not None:
            if (
                len(text) > self.cfg.max_prompt_bytes
                or len(text.encode("utf-8", "replace")) > self.cfg.max_prompt_bytes
            ):
                raise InvalidRequest(
                    f"prompt text is longer than {self.cfg.max_prompt_bytes} bytes"
                )
            prompt = self.tokenizer.encode(text)
        elif token_ids is not None:
            prompt = [int(t) for t in token_ids]
        else:
            raise InvalidRequest("prompt is empty")
        params = SamplingParams(
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=1.0 if top_p is None else float(top_p),
            seed=seed,
        )
        if max_new_tokens is None:  # at least 1, so a full context gets validate()'s message
            max_new_tokens = max(1, self.info.max_seq_len - len(prompt))
        stop_ids = tuple(stop_token_ids) + (() if ignore_eos else tuple(self.info.eos_token_ids))
        if draft_steps is not None and not (1 <= draft_steps <= 64):
            raise InvalidRequest(f"draft_steps must be in 1..64, got {draft_steps}")
        gen = GenerationRequest(
            prompt,
            int(max_new_tokens),
            params,
            stop_ids,
            draft_steps,
            request_id or uuid.uuid4().hex,
            max_draft_tokens,
        )
        gen.validate(self.info.vocab_size, self.info.max_seq_len)
        return gen

    async def request_async(self, build, *args) -> GenerationRequest:
        """build(*args) (make_request, request_from_proto) on a worker thread: tokenising a long
        prompt must not stall every other stream."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, build, *args)

    def request_from_proto(self, req: serving_pb2.GenerateRequest) -> GenerationRequest:
        kind = req.WhichOneof("prompt")
        opt = lambda name: getattr(req, name) if req.HasField(name) else None  # noqa: E731
        return self.make_request(
            text=req.text if kind == "text" else None,
            token_ids=list(req.token_ids.ids) if kind == "token_ids" else None,
            messages=[{"role": m.role, "content": m.content} for m in req.messages.messages]
            if kind == "messages"
            else None,
            max_new_tokens=req.max_new_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=opt("top_p"),
            seed=opt("seed"),
            stop_token_ids=list(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            draft_steps=opt("draft_steps"),
            max_draft_tokens=opt("max_draft_tokens"),
            request_id=req.request_id,
        )

    def submit(self, gen: GenerationRequest, deadline: float | None = None) -> _Active:
        if len(self.waiting) >= self.cfg.max_queue and len(self.active) >= self.max_concurrent:
            raise OverflowError(f"queue full ({self.cfg.max_queue} waiting requests)")
        if gen.request_id in self.by_request:
            raise InvalidRequest(f"request_id {gen.request_id!r} is already running")
        # Random ids: a client that reaches Triton or the drafter cannot guess another request's.
        sid = secrets.randbelow(2**62 - 1) + 1
        while sid in self.active:
            sid = secrets.randbelow(2**62 - 1) + 1
        a = _Active(
            Sequence(sid, gen, self._block_size(), handle=sid),
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
                    await asyncio.sleep(
                        0
                    )  # the releases just created start (TritonTarget.verify waits for them)
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
            if a.deadline is not None and now > a.deadline:
                a.seq.fail(TimeoutError("the request's deadline passed"))
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

    async def _release(self, sid: int, a: _Active) -> None:
        """Free the request's slots on both sides, in the background: a stalled part must not
        hold up the other requests' rounds (its slot is freed by its idle timeout at worst)."""
        del self.active[sid]
        task = asyncio.create_task(self._release_parts(sid, a))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        self._finish(a, a.seq.finish_reason or "abort")

    async def _release_parts(self, sid: int, a: _Active) -> None:
        try:
            await self.target_port.release(a.seq.handle)
        except Exception as e:  # noqa: BLE001 - Triton's idle timeout frees it anyway
            log.warning("release of sequence %d on the target failed: %s", sid, e)
        if self.drafter_port is not None:
            await self.drafter_port.release([a.seq])

    def _finish(self, a: _Active, reason: str) -> None:
        """The request holds nothing any more: its stream ends (Orchestrator.stream counts it)."""
        self.by_request.pop(a.request_id, None)
        self._outbox.append((a, None))

    async def _round(self, ahead: Ahead | None) -> Ahead | None:
        """One round: of every active request, or the round sent ahead (its requests; one that
        ended since commits nothing) and, beside it, the prompts of the requests admitted since
        it was sent, so they wait for no more than the round in flight. Returns the next round
        if this one sent it ahead: only when no request waits or is new."""
        t_round = time.perf_counter()
        seqs = ahead.seqs if ahead is not None else [a.seq for a in self.active.values()]
        ids = {s.seq_id for s in seqs}
        fresh = [a.seq for sid, a in self.active.items() if sid not in ids]
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
        rounds = [
            speculative_round(
                seqs,
                self.target_port,
                self.drafter_port,
                self.cfg.tree_blocks,
                self.controller,
                self.cfg.decode_steps,
                ahead=ahead,
                send_ahead=send,
            )
        ]
        if (
            fresh
        ):  # prompts only: nothing to draft or plan yet, their call queues behind the one in flight
            rounds.append(speculative_round(fresh, self.target_port))
        results = await asyncio.gather(*rounds)
        for res in results:
            await self._account(res, t_round)
        return results[0].ahead

    async def _account(self, res, t_round: float) -> None:
        """A finished round's metrics, the target's health, and its tokens to their streams."""
        name = self.info.model_name
        decoding = [r for r in res.sequences if not r.prefill and r.error is None]
        for r in decoding:
            self.metrics.draft_length.labels(model=name).observe(r.drafted)
        if res.plan is not None and decoding and not any(res.plan.values()):
            self.metrics.speculation_off_rounds.labels(model=name).inc()
        if decoding and not any(r.drafted for r in decoding):
            self.metrics.decode_steps.labels(model=name).observe(res.decode_steps)
        if res.ahead is not None:
            self.metrics.rounds_ahead.labels(model=name).inc()
        if res.shadows:
            self.metrics.shadow_probes.labels(model=name).inc(res.shadows)
        if res.expected_accepted:
            self.metrics.controller_accepted.labels(model=name, kind="expected").inc(
                res.expected_accepted
            )
            self.metrics.controller_accepted.labels(model=name, kind="accepted").inc(res.accepted)
        if self.drafter is not None:
            self.metrics.drafter_steps.labels(drafter=self._drafter_name()).set(self.drafter.steps)
            if res.draft_s:  # one observation per drafter call (a call drafts the whole batch)
                self.metrics.draft_latency.labels(
                    **self._labels(res.steps or self.drafter.steps)
                ).observe(res.draft_s)
        self.metrics.verify_latency.labels(model=name).observe(res.verify_s)
        self.metrics.verify_batch_size.labels(model=name).observe(len(res.sequences))
        target_failure = next(
            (
                r.error
                for r in res.sequences
                if r.error is not None and not isinstance(r.error, (InvalidRequest, ValueError))
            ),
            None,
        )
        if target_failure is not None:
            await self._set_target_ok(False, str(target_failure))
        elif any(not r.error for r in res.sequences):
            await self._set_target_ok(True)
        now = time.perf_counter()
        for r in res.sequences:
            a = self.active.get(r.seq.seq_id)
            if r.fallback:
                self.metrics.fallback_rounds.labels(model=name, reason=r.fallback).inc()
            if r.error is not None or a is None:
                continue
            if r.prefill:
                self.metrics.prompt_tokens.labels(model=name).inc(a.seq.n_prompt)
            elif r.drafted:
                self.metrics.record_round(self._labels(self._steps_of(a)), r.drafted, r.accepted)
            self._emit(a, r.new_tokens, now)
        self.metrics.round_latency.labels(
            **self._labels(self.drafter.steps if self.drafter else 0)
        ).observe(time.perf_counter() - t_round)

    async def stream(
        self, gen: GenerationRequest, stops: list[str] = (), deadline: float | None = None
    ) -> AsyncIterator[Piece | Outcome]:
        """Run one request: its pieces as they commit, then one Outcome (every front end, gRPC
        and HTTP, serves this). Stop strings end the request at the first token whose text
        reaches one; the ids, the text and the usage all stop at the same token. deadline
        (time.monotonic()): past it the request ends with DEADLINE_EXCEEDED."""
        if not self.target_ok:
            yield Outcome.failed(
                grpc.StatusCode.UNAVAILABLE, "the target is unavailable (see Health)"
            )
            return
        try:
            a = self.submit(gen, deadline)
        except InvalidRequest as e:
            yield Outcome.failed(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        except OverflowError as e:
            yield Outcome.failed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return
        decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        stops = [x for x in stops if x]
        if stops and decoder is None:
            self.abort(gen.request_id)
            yield Outcome.failed(
                grpc.StatusCode.INVALID_ARGUMENT, "stop strings need the target's tokenizer"
            )
            return
        longest = max((len(x) for x in stops), default=0)
        sent_ids = sent_chars = 0
        stopped = False
        status = "abort"  # what the requests metric records if the client goes away first
        try:
            while (new := await a.queue.get()) is not None:
                if decoder is None:
                    sent_ids += len(new)
                    yield Piece(new, "")
                    continue
                decoder.push(new)
                # Hold back text that could be the start of a stop string; the ids go with the text.
                keep = bisect.bisect_right(
                    decoder.ends, len(decoder.text) - max(longest - 1, 0), lo=sent_ids
                )
                cut = (
                    _find_stop(decoder.text, stops, max(0, sent_chars - longest)) if stops else None
                )
                if cut is not None:  # keep the tokens whose text ends before the stop string
                    keep = bisect.bisect_right(decoder.ends, cut, lo=sent_ids)
                    stopped = True
                    a.seq.finish("stop")
                    self._wake.set()
                end = decoder.ends[keep - 1] if keep else 0
                if keep > sent_ids:
                    yield Piece(decoder.ids[sent_ids:keep], decoder.text[sent_chars:end])
                    sent_ids, sent_chars = keep, end
                if stopped:
                    while await a.queue.get() is not None:
                        pass
                    break
            if (
                decoder is not None and not stopped and len(decoder.ids) > sent_ids
            ):  # the held-back tail
                yield Piece(decoder.ids[sent_ids:], decoder.text[sent_chars:])
                sent_ids, sent_chars = len(decoder.ids), len(decoder.text)
            if a.seq.error is not None:
                status = "error"
                e = a.seq.error
                yield Outcome.failed(
                    _status_of(e),
                    str(e)
                    if isinstance(e, TimeoutError) and not isinstance(e, TargetUnavailable)
                    else f"target verify failed: {e}",
                )
                return
            s = a.seq.stats
            s.draft_steps = self._steps_of(a)
            total = time.perf_counter() - a.t_arrival
            status = "stop" if stopped else (a.seq.finish_reason or "abort")
            outcome = Outcome(
                status,
                a.seq.n_prompt,
                sent_ids,
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
                    completion_tokens=sent_ids,
                    mean_acceptance_length=round(s.mean_acceptance_length, 3),
                    fallback_rounds=s.fallback_rounds,
                    total_s=round(total, 4),
                ),
            )
            yield outcome
        except (asyncio.CancelledError, GeneratorExit):
            self.abort(gen.request_id)  # client went away: free the slot on target and drafter
            raise
        finally:
            self.metrics.requests.labels(model=self.info.model_name, status=status).inc()

    def _steps_of(self, a: _Active) -> int:
        return (
            a.seq.stats.draft_steps
            or a.seq.request.draft_steps
            or (self.drafter.steps if self.drafter else 0)
        )

    def _emit(self, a: _Active, new: list[int], now: float) -> None:
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
        self._outbox.append((a, new))


class FlashMapServicer(serving_pb2_grpc.FlashMapServicer):
    def __init__(self, orch: Orchestrator):
        self.orch = orch

    async def Generate(self, request, context):
        orch = self.orch
        try:
            # Ids that fit the context: nothing to tokenise, and the hop to the pool costs more
            # (0.6-0.8 ms of the time to first token on the 2-core VM).
            if (
                request.WhichOneof("prompt") == "token_ids"
                and len(request.token_ids.ids) <= orch.info.max_seq_len
            ):
                gen = orch.request_from_proto(request)
            else:
                gen = await orch.request_async(orch.request_from_proto, request)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = gen.request_id
        left = context.time_remaining()
        stream = orch.stream(
            gen,
            [s for s in request.stop if s],
            deadline=None if left is None else time.monotonic() + left,
        )
        try:
            async for item in stream:
                if isinstance(item, Piece):
                    yield serving_pb2.GenerateResponse(
                        request_id=rid,
                        chunk=serving_pb2.TokenChunk(token_ids=item.token_ids, text=item.text),
                    )
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
        return serving_pb2.ModelInfoResponse(
            model=o.info.model_name,
            drafter=o._drafter_name(),
            vocab_size=o.info.vocab_size,
            max_seq_len=o.info.max_seq_len,
            block_size=o.drafter.block_size if o.drafter else 0,
            draft_steps=o.drafter.steps if o.drafter else 0,
            eos_token_ids=list(o.info.eos_token_ids),
            max_concurrent=o.max_concurrent,
            max_queue=o.cfg.max_queue,
        )

    async def Health(self, request, context):
        """What the health loop last learned (never a call that could hang on a stalled part)."""
        o = self.orch
        return serving_pb2.HealthResponse(
            ready=o.target_ok,
            target_ready=o.target_ok,
            drafter_ready=bool(o.drafter and o.drafter.connected),
            active_requests=len(o.active),
            queued_requests=len(o.waiting),
        )


def _find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Where the first stop string starts in text[start:] (as an index of text), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


async def serve(
    cfg: OrchestratorConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    orch = Orchestrator(cfg)
    await orch.start()
    service = serving_pb2.DESCRIPTOR.services_by_name["FlashMap"]
    # With API keys, every call needs one but the health checks (ours and grpc.health.v1: probes).
    auth = (
        (TokenAuth(API_KEY_HEADER, bearer(cfg.api_key), open_methods=(f"/{SERVICE_NAME}/Health",)),)
        if cfg.api_key
        else ()
    )
    http = None
    if cfg.http_port:
        from orchestrator.openai_api import HttpServer

        http = await HttpServer(orch, cfg.host, cfg.http_port).start()
    try:
        await serve_grpc(
            "orchestrator",
            lambda server: add_service(
                server, FlashMapServicer(orch), service, cfg.max_message_bytes
            ),
            [SERVICE_NAME],
            cfg.host,
            cfg.port,
            cfg.metrics_port,
            registry=orch.metrics.registry,
            ready=ready,
            stop=stop,
            max_message_bytes=cfg.max_message_bytes,
            interceptors=auth,
            transport_bytes=min(
                4 * cfg.max_message_bytes, 2**31 - 1
            ),  # up to 4x refused fast (serve_grpc)
            tls=cfg.tls,
            reflection_on=cfg.reflection,
            health_servicer=orch.health,
        )
    finally:
        if http is not None:
            await http.stop()
        await orch.stop()


def main(argv: list[str] | None = None) -> None:
    import os

    ap = argparse.ArgumentParser(description="FlashMap orchestrator (public Generate API)")
    env = os.environ.get
    ap.add_argument("--host", default=env("FLASHMAP_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("FLASHMAP_PORT", "50051")))
    ap.add_argument("--metrics-port", type=int, default=int(env("FLASHMAP_METRICS_PORT", "9400")))
    ap.add_argument(
        "--http-port",
        type=int,
        default=int(env("FLASHMAP_HTTP_PORT", "8080")),
        help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions); 0 = off",
    )
    ap.add_argument("--target-url", default=env("FLASHMAP_TARGET_URL", "127.0.0.1:8001"))
    ap.add_argument(
        "--drafter-url", default=env("FLASHMAP_DRAFTER_URL", "127.0.0.1:50052"), help="'' for none"
    )
    ap.add_argument("--tokenizer-dir", default=env("FLASHMAP_TARGET_DIR"))
    ap.add_argument("--max-concurrent", type=int, default=0)
    ap.add_argument("--max-queue", type=int, default=int(env("FLASHMAP_MAX_QUEUE", "256")))
    ap.add_argument(
        "--draft-timeout-s", type=float, default=float(env("FLASHMAP_DRAFT_TIMEOUT_S", "2.0"))
    )
    ap.add_argument(
        "--tree-blocks",
        type=int,
        default=int(env("FLASHMAP_TREE_BLOCKS", "1")),
        help="greedy requests: verify this many drafted blocks as a tree (1 = one block)",
    )
    ap.add_argument(
        "--speculation",
        choices=("auto", "full"),
        default=env("FLASHMAP_SPECULATION", "auto"),
        help="auto: each round's draft lengths from measured acceptance and costs; full: always the whole block",
    )
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=int(env("FLASHMAP_DECODE_STEPS", str(DECODE_STEPS))),
        help="tokens per request of a round without drafts, decoded in one call to the target",
    )
    ap.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=env("FLASHMAP_PIPELINE", "1") not in ("0", "false", "no"),
        help="queue the next round without drafts at Triton while one runs, and probe greedy "
        "requests beside it (default on)",
    )
    ap.add_argument(
        "--burst-window-ms",
        type=float,
        default=float(env("FLASHMAP_BURST_WINDOW_MS", BurstConfig.window_s * 1e3)),
        help="waking from idle into requests sent together, wait up to this long for the rest of "
        "them so they prefill in one round (0 = start at once)",
    )
    ap.add_argument(
        "--burst-gap-ms",
        type=float,
        default=float(env("FLASHMAP_BURST_GAP_MS", BurstConfig.gap_s * 1e3)),
        help="requests closer than this are one burst; the wait ends after this long without one",
    )
    ap.add_argument(
        "--tls-cert", default=env("FLASHMAP_TLS_CERT"), help="PEM certificate chain: serve TLS"
    )
    ap.add_argument(
        "--tls-key", default=env("FLASHMAP_TLS_KEY"), help="PEM private key of --tls-cert"
    )
    ap.add_argument(
        "--reflection", action="store_true", help="serve gRPC reflection (off: less to probe)"
    )
    ap.add_argument(
        "--max-message-bytes",
        type=int,
        default=int(env("FLASHMAP_MAX_MESSAGE_BYTES", str(4 << 20))),
    )
    ap.add_argument(
        "--max-prompt-bytes", type=int, default=int(env("FLASHMAP_MAX_PROMPT_BYTES", str(1 << 20)))
    )
    ap.add_argument(
        "--target-timeout-s",
        type=float,
        default=float(env("FLASHMAP_TARGET_TIMEOUT_S", "30")),
        help="deadline of every call to Triton",
    )
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    if a.tree_blocks < 1:
        ap.error(f"--tree-blocks must be >= 1, got {a.tree_blocks}")
    if not 1 <= a.decode_steps <= MAX_DECODE_STEPS:
        ap.error(f"--decode-steps must be in 1..{MAX_DECODE_STEPS}, got {a.decode_steps}")
    if a.burst_window_ms < 0 or a.burst_gap_ms < 0:
        ap.error("--burst-window-ms and --burst-gap-ms must be >= 0")
    if bool(a.tls_cert) != bool(a.tls_key):
        ap.error("--tls-cert and --tls-key go together")
    setup_logging(a.log_level)
    cfg = OrchestratorConfig(
        host=a.host,
        port=a.port,
        metrics_port=a.metrics_port,
        http_port=a.http_port,
        target_url=a.target_url,
        drafter_url=a.drafter_url,
        tokenizer_dir=a.tokenizer_dir,
        max_concurrent=a.max_concurrent,
        max_queue=a.max_queue,
        draft_timeout_s=a.draft_timeout_s,
        tree_blocks=a.tree_blocks,
        speculation=a.speculation,
        decode_steps=a.decode_steps,
        pipeline=a.pipeline,
        burst_window_s=a.burst_window_ms / 1e3,
        burst_gap_s=a.burst_gap_ms / 1e3,
        api_key=read_secret(API_KEY_ENV),
        target_key=read_secret(TARGET_KEY_ENV),
        drafter_token=read_secret(DRAFTER_TOKEN_ENV),
        tls=(a.tls_cert, a.tls_key) if a.tls_cert else None,
        reflection=a.reflection,
        max_message_bytes=a.max_message_bytes,
        max_prompt_bytes=a.max_prompt_bytes,
        target_timeout_s=a.target_timeout_s,
    )
    if not cfg.api_key and a.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "no %s: the public API on %s:%d takes requests from anyone who reaches it",
            API_KEY_ENV,
            a.host,
            a.port,
        )
    run(serve(cfg))


if __name__ == "__main__":
    main()
