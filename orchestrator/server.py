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
import logging
import secrets
import time
import uuid
from collections import deque
from dataclasses import dataclass

import grpc

from flashmap.grpc_serving import run, serve_grpc
from flashmap.logs import fields, setup_logging
from flashmap.rounds import speculative_round
from flashmap.sequence import Sequence
from flashmap.speculation import SpeculationController
from flashmap.tokenizer import IncrementalDecoder
from flashmap.types import BLOCK_SIZE, GenerationRequest, InvalidRequest, SamplingParams
from flashmap.v1 import serving_pb2, serving_pb2_grpc
from flashmap.wire import stats_to_proto
from orchestrator.drafter_client import DrafterClient, ServiceDrafter
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.target_client import TargetClient, TritonTarget

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
    tree_blocks: int = 1  # > 1: greedy requests draft that many blocks from independent noise, verified as a tree
    speculation: str = "auto"  # auto: draft lengths from measured costs (flashmap.speculation); full: always K


@dataclass
class _Active:
    seq: Sequence
    queue: asyncio.Queue  # token lists, then None when finished
    request_id: str
    t_arrival: float
    t_first: float | None = None
    t_last: float | None = None


def _status_of(error: BaseException) -> grpc.StatusCode:
    return grpc.StatusCode.INVALID_ARGUMENT if isinstance(error, InvalidRequest) else grpc.StatusCode.UNAVAILABLE


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.target = TargetClient(cfg.target_url, model=cfg.target_model)
        self.drafter = DrafterClient(cfg.drafter_url) if cfg.drafter_url else None
        self.drafter_port = ServiceDrafter(self.drafter, cfg.draft_timeout_s, cfg.top_m) if self.drafter else None
        self.target_port: TritonTarget | None = None  # after start(): needs the target's context length
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
        self.target_port = TritonTarget(self.target, self.info.max_seq_len)
        if self.drafter is not None:
            await self.drafter.ensure_connected()
        self.metrics = OrchestratorMetrics(block_size=self._block_size())
        if self.cfg.speculation == "auto" and self.drafter is not None:
            self.controller = SpeculationController(self._block_size())
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

    def _block_size(self) -> int:
        return self.drafter.block_size if self.drafter is not None else BLOCK_SIZE

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
        max_draft = req.max_draft_tokens if req.HasField("max_draft_tokens") else None
        gen = GenerationRequest(prompt, req.max_new_tokens, params, stop_ids, steps, req.request_id or uuid.uuid4().hex,
                                max_draft)
        gen.validate(self.info.vocab_size, self.info.max_seq_len)
        return gen

    def submit(self, gen: GenerationRequest) -> _Active:
        if len(self.waiting) >= self.cfg.max_queue and len(self.active) >= self.max_concurrent:
            raise OverflowError(f"queue full ({self.cfg.max_queue} waiting requests)")
        if gen.request_id in self.by_request:
            raise InvalidRequest(f"request_id {gen.request_id!r} is already running")
        # Random ids: a client that reaches Triton or the drafter cannot guess another request's.
        sid = secrets.randbelow(2**62 - 1) + 1
        while sid in self.active:
            sid = secrets.randbelow(2**62 - 1) + 1
        a = _Active(Sequence(sid, gen, self._block_size(), handle=sid), asyncio.Queue(), gen.request_id,
                    time.perf_counter())
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
        try:
            await self.target_port.release(a.seq.handle)
        except Exception as e:  # noqa: BLE001 - Triton's idle timeout frees it anyway
            log.warning("release of sequence %d on the target failed: %s", sid, e)
        if self.drafter_port is not None:
            await self.drafter_port.release([a.seq])
        self._finish(a, a.seq.finish_reason or "abort")

    def _finish(self, a: _Active, reason: str) -> None:
        self.by_request.pop(a.request_id, None)
        self.metrics.requests.labels(model=self.info.model_name, status=reason).inc()
        a.queue.put_nowait(None)

    async def _round(self) -> None:
        t_round = time.perf_counter()
        acts = list(self.active.values())
        res = await speculative_round([a.seq for a in acts], self.target_port, self.drafter_port, self.cfg.tree_blocks,
                                      self.controller)
        name = self.info.model_name
        if res.plan is not None:
            for length in res.plan.values():
                self.metrics.draft_length.labels(model=name).observe(length)
            if not any(res.plan.values()) and any(a.seq.prefilled for a in acts):
                self.metrics.speculation_off_rounds.labels(model=name).inc()
        if self.drafter is not None:
            self.metrics.drafter_steps.labels(drafter=self._drafter_name()).set(self.drafter.steps)
            if res.draft_s:  # one observation per drafter call (a call drafts the whole batch)
                self.metrics.draft_latency.labels(**self._labels(res.steps or self.drafter.steps)).observe(res.draft_s)
        self.metrics.verify_latency.labels(model=name).observe(res.verify_s)
        self.metrics.verify_batch_size.labels(model=name).observe(len(acts))
        now = time.perf_counter()
        for a, r in zip(acts, res.sequences):
            if r.fallback:
                self.metrics.fallback_rounds.labels(model=name, reason=r.fallback).inc()
            if r.error is not None:
                continue
            if r.prefill:
                self.metrics.prompt_tokens.labels(model=name).inc(a.seq.n_prompt)
            elif r.drafted:
                self.metrics.record_round(self._labels(self._steps_of(a)), r.drafted, r.accepted)
            self._emit(a, r.new_tokens, now)
        self.metrics.round_latency.labels(**self._labels(self.drafter.steps if self.drafter else 0)).observe(time.perf_counter() - t_round)

    def _steps_of(self, a: _Active) -> int:
        return a.seq.stats.draft_steps or a.seq.request.draft_steps or (self.drafter.steps if self.drafter else 0)

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
        if a.seq.error is not None:
            await context.abort(_status_of(a.seq.error), f"target verify failed: {a.seq.error}")
        s = a.seq.stats
        s.draft_steps = orch._steps_of(a)
        final = serving_pb2.FinalResult(
            finish_reason=finish_override or a.seq.finish_reason or "abort",
            usage=serving_pb2.Usage(prompt_tokens=a.seq.n_prompt, completion_tokens=len(a.seq.generated)),
            stats=stats_to_proto(s),
            time_to_first_token_s=(a.t_first - a.t_arrival) if a.t_first else 0.0,
            total_s=time.perf_counter() - a.t_arrival,
        )
        log.info("request finished", extra=fields(
            request_id=rid, finish_reason=final.finish_reason, prompt_tokens=a.seq.n_prompt,
            completion_tokens=len(a.seq.generated), mean_acceptance_length=round(s.mean_acceptance_length, 3),
            fallback_rounds=s.fallback_rounds, total_s=round(final.total_s, 4)))
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
    ap.add_argument("--tree-blocks", type=int, default=int(env("FLASHMAP_TREE_BLOCKS", "1")),
                    help="greedy requests: verify this many drafted blocks as a tree (1 = one block)")
    ap.add_argument("--speculation", choices=("auto", "full"), default=env("FLASHMAP_SPECULATION", "auto"),
                    help="auto: each round's draft lengths from measured acceptance and costs; full: always the whole block")
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    if a.tree_blocks < 1:
        ap.error(f"--tree-blocks must be >= 1, got {a.tree_blocks}")
    setup_logging(a.log_level)
    cfg = OrchestratorConfig(
        host=a.host, port=a.port, metrics_port=a.metrics_port, target_url=a.target_url, drafter_url=a.drafter_url,
        tokenizer_dir=a.tokenizer_dir, max_concurrent=a.max_concurrent, max_queue=a.max_queue,
        draft_timeout_s=a.draft_timeout_s, tree_blocks=a.tree_blocks, speculation=a.speculation,
    )
    run(serve(cfg))


if __name__ == "__main__":
    main()
