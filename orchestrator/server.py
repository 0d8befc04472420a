"""The orchestrator: public Generate server with continuous batching of speculative rounds.

One scheduler loop serves every active request. Each iteration is one round for all
of them: one batched call to the drafter (a DraftRequest carrying every sequence
that can draft), then concurrent verify calls to Triton that its sequence batcher
runs as one forward, then rejection sampling and streaming per request. Requests
beyond the target's KV slots wait in a queue; past `max_queue` they are refused with
RESOURCE_EXHAUSTED. A drafter that is down or late costs speed, not correctness: the
round runs without drafts (autoregressive) and is counted.

  python -m orchestrator.server --target-url 127.0.0.1:8001 --drafter-url 127.0.0.1:50052 \
      --tokenizer-dir checkpoints/demo-target --port 50051 --metrics-port 9400
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass

import grpc
import numpy as np

from flashmap.grpc_serving import run, serve_grpc
from flashmap.logs import fields, setup_logging
from flashmap.tokenizer import IncrementalDecoder
from flashmap.types import Draft, InvalidRequest, SamplingParams
from flashmap.v1 import drafter_pb2, serving_pb2, serving_pb2_grpc
from orchestrator.drafter_client import DrafterClient, block_to_draft, features_to_tensor
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.sequence import GenerationRequest, Sequence
from target_service.triton_client import TargetClient

log = logging.getLogger("flashmap.orchestrator")


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


@dataclass
class _Active:
    seq: Sequence
    queue: asyncio.Queue  # token lists, then None when finished
    request_id: str
    t_arrival: float
    started: bool = False  # holds a target sequence (Triton START sent)
    drafter_seen: int = 0  # context positions the drafter holds
    drafter_sent: bool = False  # the drafter was sent context (it may hold some even if every answer was late)
    drafter_lost: bool = False  # drafter lost this sequence's context: autoregressive from now on
    fallback_rounds: int = 0
    draft_steps: int = 0  # step count of this sequence's latest block, as the drafter reports it
    t_first: float | None = None
    t_last: float | None = None
    error: tuple[grpc.StatusCode, str] | None = None


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.target = TargetClient(cfg.target_url, model=cfg.target_model)
        self.drafter = DrafterClient(cfg.drafter_url) if cfg.drafter_url else None
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
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

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
        if self.drafter is not None:
            await self.drafter.ensure_connected()
        block = self.drafter.block_size if self.drafter is not None else 16
        self.metrics = OrchestratorMetrics(block_size=block)
        self.metrics.drafter_steps.labels(drafter=self._drafter_name()).set(self.drafter.steps if self.drafter else 0)
        # Export the counters that alerts divide by at 0 from the start: a series that first
        # appears at its first increment has no rate() for that increment.
        for reason in ("unavailable", "timeout", "context_lost"):
            self.metrics.fallback_rounds.labels(model=self.info.model_name, reason=reason)
        for status in ("length", "stop", "abort", "error"):
            self.metrics.requests.labels(model=self.info.model_name, status=status)
        self.max_concurrent = self.cfg.max_concurrent or self.info.n_slots
        self._loop_task = asyncio.create_task(self._scheduler())
        log.info("orchestrator ready: target %s (%d slots, vocab %d), drafter %s", self.info.model_name,
                 self.info.n_slots, self.info.vocab_size, self.cfg.drafter_url or "none")

    async def stop(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        if self.drafter:
            await self.drafter.close()

    def _drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    def _labels(self, steps: int) -> dict:
        return {"model": self.info.model_name, "drafter": self._drafter_name(), "steps": str(steps)}

    # -- requests ----------------------------------------------------------------
    def _to_generation_request(self, req: serving_pb2.GenerateRequest) -> GenerationRequest:
        kind = req.WhichOneof("prompt")
        if kind == "text":
            if self.tokenizer is None:
                raise InvalidRequest("this server has no tokenizer: send token_ids")
            prompt = self.tokenizer.encode(req.text)
        elif kind == "token_ids":
            prompt = list(req.token_ids.ids)
        else:
            raise InvalidRequest("prompt is empty")
        params = SamplingParams(
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p if req.HasField("top_p") else 1.0,
            seed=req.seed if req.HasField("seed") else None,
        )
        stop_ids = tuple(req.stop_token_ids) + (() if req.ignore_eos else tuple(self.info.eos_token_ids))
        steps = req.draft_steps if req.HasField("draft_steps") else None
        if steps is not None and not (1 <= steps <= 64):
            raise InvalidRequest(f"draft_steps must be in 1..64, got {steps}")
        gen = GenerationRequest(prompt, req.max_new_tokens, params, stop_ids, steps, req.request_id or uuid.uuid4().hex)
        gen.validate(self.info.vocab_size, self.info.max_seq_len)
        return gen

    def submit(self, gen: GenerationRequest) -> _Active:
        if len(self.waiting) >= self.cfg.max_queue and len(self.active) >= self.max_concurrent:
            raise OverflowError(f"queue full ({self.cfg.max_queue} waiting requests)")
        if gen.request_id in self.by_request:
            raise InvalidRequest(f"request_id {gen.request_id!r} is already running")
        block = self.drafter.block_size if self.drafter is not None else 16
        a = _Active(Sequence(next(self._ids), gen, block), asyncio.Queue(), gen.request_id, time.perf_counter())
        self.waiting.append(a)
        self.by_request[gen.request_id] = a
        self.metrics.queued_requests.labels(model=self.info.model_name).set(len(self.waiting))
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
        while True:
            try:
                await self._admit_and_reap()
                if not self.active:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive any single bad round
                log.exception("scheduler round failed")
                await asyncio.sleep(0.05)

    async def _admit_and_reap(self) -> None:
        name = self.info.model_name
        # Aborted or cancelled requests leave before their next round.
        for a in list(self.waiting):
            if a.seq.finished:
                self.waiting.remove(a)
                self._finish(a, "abort")
        for sid, a in list(self.active.items()):
            if a.seq.finished:
                await self._release(sid, a)
        while self.waiting and len(self.active) < self.max_concurrent:
            a = self.waiting.popleft()
            self.active[a.seq.seq_id] = a
        self.metrics.active_requests.labels(model=name).set(len(self.active))
        self.metrics.queued_requests.labels(model=name).set(len(self.waiting))

    async def _release(self, sid: int, a: _Active) -> None:
        del self.active[sid]
        if a.started:
            try:
                await self.target.release(sid)
            except Exception as e:  # noqa: BLE001 - Triton's idle timeout frees it anyway
                log.warning("release of sequence %d on the target failed: %s", sid, e)
        if self.drafter is not None and a.drafter_sent:
            await self.drafter.release([str(sid)])
        self._finish(a, a.seq.finish_reason or "abort")

    def _finish(self, a: _Active, reason: str) -> None:
        self.by_request.pop(a.request_id, None)
        status = "error" if a.error else reason
        self.metrics.requests.labels(model=self.info.model_name, status=status).inc()
        a.queue.put_nowait(None)

    async def _draft(self, seqs: list[_Active]) -> dict[int, Draft]:
        """One batched drafter call; sequences without a block decode autoregressively."""
        if self.drafter is None or not seqs:
            return {}
        msgs = []
        for a in seqs:
            ctx = a.seq.take_pending_context()
            if ctx is not None:  # keep it until the drafter acknowledges it
                a.seq.pending_context.append(ctx)
            ids, feats = ctx if ctx is not None else (np.zeros(0, np.int64), np.zeros((0, 0), np.float32))
            a.drafter_sent = True
            msgs.append(drafter_pb2.SequenceDraft(
                seq_id=str(a.seq.seq_id), context_start=a.drafter_seen, new_token_ids=ids.tolist(),
                new_features=features_to_tensor(feats), anchor=a.seq.anchor, steps=a.seq.request.draft_steps or 0,
                temperature=a.seq.params.temperature, top_m=self.cfg.top_m, seed=a.seq.draft_seed(),
                max_tokens=a.seq.draft_budget(),
            ))
        t0 = time.perf_counter()
        resp, reason = await self.drafter.draft(msgs, self.cfg.draft_timeout_s)
        dt = time.perf_counter() - t0
        if resp is None:
            for a in seqs:
                self.metrics.fallback_rounds.labels(model=self.info.model_name, reason=reason).inc()
                a.fallback_rounds += 1
            return {}
        drafts = {}
        for a, m, block in zip(seqs, msgs, resp.blocks):
            if block.error:
                log.warning("request %s: drafter: %s; continuing autoregressively", a.request_id, block.error)
                a.drafter_lost = True
                a.seq.pending_context.clear()
                continue
            a.drafter_seen += len(m.new_token_ids)
            a.seq.pending_context.clear()
            a.draft_steps = block.steps
            if not m.steps:  # drafted with the drafter's default: follow run-time switches (SetSteps)
                self.drafter.steps = block.steps
            drafts[a.seq.seq_id] = block_to_draft(block).truncate(a.seq.draft_budget())
        self.metrics.drafter_steps.labels(drafter=self._drafter_name()).set(self.drafter.steps)
        # One observation per drafter call (a call drafts the whole batch).
        steps = next((b.steps for b in resp.blocks if not b.error), self.drafter.steps)
        self.metrics.draft_latency.labels(**self._labels(steps)).observe(dt)
        return drafts

    async def _round(self) -> None:
        t_round = time.perf_counter()
        acts = list(self.active.values())
        can_draft = [a for a in acts if a.seq.draft_budget() > 0 and not a.drafter_lost]
        drafts = await self._draft(can_draft)
        for a in acts:
            if a.drafter_lost and a.seq.prefilled:
                a.fallback_rounds += 1
                self.metrics.fallback_rounds.labels(model=self.info.model_name, reason="context_lost").inc()
        rows = [a.seq.verify_row(drafts.get(a.seq.seq_id)) for a in acts]
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[self.target.verify(a.seq.seq_id, row, start=not a.started) for a, row in zip(acts, rows)],
            return_exceptions=True,
        )
        name = self.info.model_name
        self.metrics.verify_latency.labels(model=name).observe(time.perf_counter() - t0)
        self.metrics.verify_batch_size.labels(model=name).observe(len(acts))
        now = time.perf_counter()
        for a, row, res in zip(acts, rows, results):
            a.started = True
            if isinstance(res, BaseException):
                code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(res, InvalidRequest) else grpc.StatusCode.UNAVAILABLE
                a.error = (code, f"target verify failed: {res}")
                a.seq.abort()
                continue
            was_prefill = not a.seq.prefilled
            draft = drafts.get(a.seq.seq_id)
            new = a.seq.commit(row, draft, res)
            if was_prefill:
                self.metrics.prompt_tokens.labels(model=name).inc(a.seq.n_prompt)
            elif draft is not None:
                self.metrics.record_round(self._labels(self._steps_of(a)), *a.seq.last_round)
            self._emit(a, new, now)
        self.metrics.round_latency.labels(**self._labels(self.drafter.steps if self.drafter else 0)).observe(time.perf_counter() - t_round)

    def _steps_of(self, a: _Active) -> int:
        return a.draft_steps or a.seq.request.draft_steps or (self.drafter.steps if self.drafter else 0)

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
        a.queue.put_nowait(new)


class FlashMapServicer(serving_pb2_grpc.FlashMapServicer):
    def __init__(self, orch: Orchestrator):
        self.orch = orch

    async def Generate(self, request, context):
        orch = self.orch
        try:
            gen = orch._to_generation_request(request)
            a = orch.submit(gen)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except OverflowError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        rid = gen.request_id
        decoder = IncrementalDecoder(orch.tokenizer) if orch.tokenizer is not None else None
        stops = [s for s in request.stop if s]
        finish_override = None
        try:
            while True:
                new = await a.queue.get()
                if new is None:
                    break
                text = decoder.push(new) if decoder is not None else ""
                if stops and decoder is not None:
                    cut = _find_stop(decoder.text, stops)
                    if cut is not None:
                        # Cut the text before the stop string and end the request here.
                        already = len(decoder.text) - len(text)
                        text = decoder.text[already:cut] if cut > already else ""
                        finish_override = "stop"
                        orch.abort(rid)
                        yield serving_pb2.GenerateResponse(request_id=rid, chunk=serving_pb2.TokenChunk(token_ids=new, text=text))
                        while await a.queue.get() is not None:
                            pass
                        break
                yield serving_pb2.GenerateResponse(request_id=rid, chunk=serving_pb2.TokenChunk(token_ids=new, text=text))
        except asyncio.CancelledError:
            orch.abort(rid)  # client went away: free the slot on target and drafter
            raise
        if a.error is not None:
            await context.abort(*a.error)
        s = a.seq.stats
        final = serving_pb2.FinalResult(
            finish_reason=finish_override or a.seq.finish_reason or "abort",
            usage=serving_pb2.Usage(prompt_tokens=a.seq.n_prompt, completion_tokens=len(a.seq.generated)),
            stats=serving_pb2.SpecStats(
                rounds=s.rounds, drafts=s.drafts, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted,
                mean_acceptance_length=s.mean_acceptance_length, accepted_per_slot=s.accepted_per_slot.tolist(),
                fallback_rounds=a.fallback_rounds, draft_steps=orch._steps_of(a),
            ),
            time_to_first_token_s=(a.t_first - a.t_arrival) if a.t_first else 0.0,
            total_s=time.perf_counter() - a.t_arrival,
        )
        log.info("request finished", extra=fields(
            request_id=rid, finish_reason=final.finish_reason, prompt_tokens=a.seq.n_prompt,
            completion_tokens=len(a.seq.generated), mean_acceptance_length=round(s.mean_acceptance_length, 3),
            fallback_rounds=a.fallback_rounds, total_s=round(final.total_s, 4)))
        yield serving_pb2.GenerateResponse(request_id=rid, final=final)

    async def Abort(self, request, context):
        return serving_pb2.AbortResponse(found=self.orch.abort(request.request_id))

    async def ModelInfo(self, request, context):
        o = self.orch
        return serving_pb2.ModelInfoResponse(
            model=o.info.model_name, drafter=o._drafter_name(), vocab_size=o.info.vocab_size,
            max_seq_len=o.info.max_seq_len, block_size=o.drafter.block_size if o.drafter else 0,
            draft_steps=o.drafter.steps if o.drafter else 0, eos_token_ids=list(o.info.eos_token_ids),
            max_concurrent=o.max_concurrent, max_queue=o.cfg.max_queue,
        )

    async def Health(self, request, context):
        o = self.orch
        try:
            target_ready = bool(await o.target.ready())
        except Exception:  # noqa: BLE001
            target_ready = False
        return serving_pb2.HealthResponse(
            ready=target_ready, target_ready=target_ready, drafter_ready=bool(o.drafter and o.drafter.connected),
            active_requests=len(o.active), queued_requests=len(o.waiting),
        )


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


async def serve(cfg: OrchestratorConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    orch = Orchestrator(cfg)
    await orch.start()
    try:
        await serve_grpc(
            "orchestrator", lambda server: serving_pb2_grpc.add_FlashMapServicer_to_server(FlashMapServicer(orch), server),
            [serving_pb2.DESCRIPTOR.services_by_name["FlashMap"].full_name], cfg.host, cfg.port, cfg.metrics_port,
            registry=orch.metrics.registry, ready=ready, stop=stop,
        )
    finally:
        await orch.stop()


def main(argv: list[str] | None = None) -> None:
    import os

    ap = argparse.ArgumentParser(description="FlashMap orchestrator (public Generate API)")
    env = os.environ.get
    ap.add_argument("--host", default=env("FLASHMAP_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("FLASHMAP_PORT", "50051")))
    ap.add_argument("--metrics-port", type=int, default=int(env("FLASHMAP_METRICS_PORT", "9400")))
    ap.add_argument("--target-url", default=env("FLASHMAP_TARGET_URL", "127.0.0.1:8001"))
    ap.add_argument("--drafter-url", default=env("FLASHMAP_DRAFTER_URL", "127.0.0.1:50052"), help="'' for none")
    ap.add_argument("--tokenizer-dir", default=env("FLASHMAP_TARGET_DIR"))
    ap.add_argument("--max-concurrent", type=int, default=0)
    ap.add_argument("--max-queue", type=int, default=int(env("FLASHMAP_MAX_QUEUE", "256")))
    ap.add_argument("--draft-timeout-s", type=float, default=float(env("FLASHMAP_DRAFT_TIMEOUT_S", "2.0")))
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    setup_logging(a.log_level)
    cfg = OrchestratorConfig(
        host=a.host, port=a.port, metrics_port=a.metrics_port, target_url=a.target_url, drafter_url=a.drafter_url,
        tokenizer_dir=a.tokenizer_dir, max_concurrent=a.max_concurrent, max_queue=a.max_queue,
        draft_timeout_s=a.draft_timeout_s,
    )
    run(serve(cfg))


if __name__ == "__main__":
    main()
