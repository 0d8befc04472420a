"""The drafter service: grpc.aio + uvloop server around a Proposer.

Draft is a bidirectional stream; every DraftRequest (a batch of sequences from one
orchestrator round) is queued, and a single worker drains the queue so that
concurrent requests from several streams become ONE batched forward. The worker runs
the torch work in one thread, so step-count switches (SetSteps) land between batches:
an in-flight batch finishes with the count it started with. Sequences are dropped on
Release and after an idle timeout.

  python -m drafter_service.server --target-dir DIR --drafter DIR|init --port 50052 --metrics-port 9401

Its options: drafter_service.service_config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2

from drafter_service.factory import load_proposer
from drafter_service.metrics import DrafterMetrics
from drafter_service.proposer import Proposer
from drafter_service.service_config import DrafterServiceConfig
from flashmap.auth import DRAFTER_TOKEN_ENV, DRAFTER_TOKEN_HEADER
from flashmap.config import parse
from flashmap.cpus import parse_cpu_list, pin_worker
from flashmap.draft_call import DraftAnswer, answer
from flashmap.drafts import ProposeRequest
from flashmap.grpc_serving import TokenAuth, add_service, run, serve_grpc
from flashmap.logs import fields, setup_logging
from flashmap.types import InvalidRequest, check_draft_steps
from flashmap.v1 import drafter_pb2, drafter_pb2_grpc
from flashmap.wire import answer_to_proto, ask_from_proto, ask_to_proto

log = logging.getLogger("flashmap.drafter")

PROBE_ID = "__flashmap_health_probe__"


def _pin_forward(cpus: set[int] | None) -> None:
    if why := pin_worker(cpus, "forward thread"):
        log.warning(why)


@dataclass
class _Job:
    request: drafter_pb2.DraftRequest
    future: asyncio.Future
    t_queued: float


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self,
        proposer: Proposer,
        name: str = "flashmap",
        metrics: DrafterMetrics | None = None,
        idle_timeout_s: float = 300.0,
        available_steps: tuple[int, ...] | None = None,
        cpus: set[int] | None = None,
    ):
        """cpus: where the forward thread runs (flashmap.cpus; None: where the process runs)."""
        self.proposer = proposer
        self.name = name
        self.metrics = metrics or DrafterMetrics()
        self.idle_timeout_s = idle_timeout_s
        self.available_steps = available_steps or proposer.available_steps  # None: any
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="drafter-forward",
            initializer=_pin_forward,
            initargs=(cpus,),
        )
        self._last_use: dict[str, float] = {}
        self._tasks: list[asyncio.Task] = []
        self.metrics.step_count.labels(drafter=name).set(proposer.steps)

    async def start(
        self, health_servicer=None, service_name: str = "", probe_interval_s: float = 5.0
    ) -> None:
        self._tasks = [asyncio.create_task(self._worker()), asyncio.create_task(self._reaper())]
        if health_servicer is not None and probe_interval_s > 0:
            self._tasks.append(
                asyncio.create_task(
                    self._health_loop(health_servicer, service_name, probe_interval_s)
                )
            )

    async def probe(self, timeout_s: float = 30.0) -> bool:
        """A tiny draft through the batching worker (the readiness the health service reports)."""
        seq = ask_to_proto(
            ProposeRequest(
                PROBE_ID,
                anchor=0,
                new_tokens=np.zeros(1, np.int64),
                new_features=np.zeros((1, self.proposer.feature_dim), np.float32),
            )
        )
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(
            _Job(drafter_pb2.DraftRequest(call_id=0, sequences=[seq]), fut, time.perf_counter())
        )
        try:
            resp = await asyncio.wait_for(fut, timeout_s)
            return not resp.blocks[0].error
        except TimeoutError:
            return False
        finally:
            await asyncio.get_running_loop().run_in_executor(
                self._pool, self._release, [PROBE_ID], "probe"
            )

    async def _health_loop(self, health_servicer, service_name: str, interval_s: float) -> None:
        serving = True
        while True:
            await asyncio.sleep(interval_s)
            ok = await self.probe()
            if ok != serving:
                serving = ok
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if ok
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for svc in ("", service_name):
                    await health_servicer.set(svc, status)
                log.warning(
                    "drafter health: %s", "SERVING" if ok else "NOT_SERVING (a probe draft failed)"
                )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _steps_error(self, draft_steps: int) -> str:
        """The drafter's edge (a Draft stream's sequence, SetSteps): the limit every entry point
        checks (flashmap.types.check_draft_steps), then what this drafter can run; "" = fine."""
        try:
            check_draft_steps(draft_steps)
        except InvalidRequest as e:
            return str(e)
        if self.available_steps is not None and draft_steps not in self.available_steps:
            return (
                f"draft_steps {draft_steps} not available (captured: {list(self.available_steps)})"
            )
        return ""

    # -- batching worker -------------------------------------------------------------
    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self._queue.get()]
            while not self._queue.empty():  # everything that arrived meanwhile joins this batch
                jobs.append(self._queue.get_nowait())
            t0 = time.perf_counter()
            try:
                responses = await loop.run_in_executor(
                    self._pool, self._run_batch, [j.request for j in jobs]
                )
            except Exception as e:  # noqa: BLE001 - answer every job, keep serving
                log.exception("draft batch failed")
                responses = [self._error_response(j.request, f"drafter failed: {e}") for j in jobs]
            dt = time.perf_counter() - t0
            n = sum(len(j.request.sequences) for j in jobs)
            for job, resp in zip(jobs, responses):
                resp.timing.queue_s = t0 - job.t_queued
                resp.timing.forward_s = dt
                resp.timing.batch_size = n
                if not job.future.done():
                    job.future.set_result(resp)

    @staticmethod
    def _error_response(req: drafter_pb2.DraftRequest, msg: str) -> drafter_pb2.DraftResponse:
        return drafter_pb2.DraftResponse(
            call_id=req.call_id,
            blocks=[drafter_pb2.Block(seq_id=s.seq_id, error=msg) for s in req.sequences],
        )

    def _run_batch(
        self, requests: list[drafter_pb2.DraftRequest]
    ) -> list[drafter_pb2.DraftResponse]:
        """Worker thread: every request's asks answered together (flashmap.draft_call.answer:
        one context extension, one batched draft per step count and number of blocks)."""
        now = time.monotonic()
        asks, answers, index = [], {}, []
        for ri, req in enumerate(requests):
            for si, m in enumerate(req.sequences):
                index.append((ri, si))
                try:
                    asks.append(ask_from_proto(m))
                except ValueError as e:  # a tensor that does not decode: this sequence falls back
                    answers[(ri, si)] = DraftAnswer(error=str(e))
                    asks.append(None)
        keys = [k for k, a in zip(index, asks) if a is not None]
        valid = [a for a in asks if a is not None]

        def drafted(steps: int, group: list, seconds: float) -> None:
            for a in group:
                self._last_use[a.seq_id] = now
            served = sum(a.seq_id != PROBE_ID for a in group)  # the probe is not traffic
            if served:
                labels = {"drafter": self.name, "steps": str(steps)}
                self.metrics.forward_latency.labels(**labels).observe(seconds)
                self.metrics.batch_size.labels(drafter=self.name).observe(served)
                self.metrics.blocks.labels(**labels).inc(served)

        check = lambda a: "" if a.draft_steps is None else self._steps_error(a.draft_steps)
        answers.update(zip(keys, answer(self.proposer, valid, check, drafted)))
        self._update_gauges()
        return [
            drafter_pb2.DraftResponse(
                call_id=req.call_id,
                blocks=[
                    answer_to_proto(m.seq_id, answers[(ri, si)])
                    for si, m in enumerate(req.sequences)
                ],
            )
            for ri, req in enumerate(requests)
        ]

    def _update_gauges(self) -> None:
        ids = [i for i in self._last_use if i != PROBE_ID]
        self.metrics.active_sequences.labels(drafter=self.name).set(len(ids))
        self.metrics.context_tokens.labels(drafter=self.name).set(
            sum(self.proposer.context_length(i) for i in ids)
        )

    async def _reaper(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(5.0, self.idle_timeout_s / 2))
            cutoff = time.monotonic() - self.idle_timeout_s
            stale = [sid for sid, t in self._last_use.items() if t < cutoff]
            if stale:
                await loop.run_in_executor(self._pool, self._release, stale, "idle")

    def _release(self, seq_ids, reason: str) -> int:
        n = 0
        for sid in seq_ids:
            if self._last_use.pop(sid, None) is not None and sid != PROBE_ID:
                n += 1
            self.proposer.release(sid)
        if n:
            self.metrics.released.labels(drafter=self.name, reason=reason).inc(n)
        self._update_gauges()
        return n

    # -- RPCs ----------------------------------------------------------------------------
    async def Draft(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        async for req in request_iterator:
            fut = loop.create_future()
            await self._queue.put(_Job(req, fut, time.perf_counter()))
            yield await fut

    async def GetSteps(self, request, context):
        return self._steps_response()

    async def SetSteps(self, request, context):
        if err := self._steps_error(request.steps):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        # Through the worker thread, so the switch lands between batches.
        await asyncio.get_running_loop().run_in_executor(
            self._pool, self.proposer.set_steps, request.steps
        )
        self.metrics.step_count.labels(drafter=self.name).set(request.steps)
        log.info("step count switched", extra=fields(steps=request.steps))
        return self._steps_response()

    def _steps_response(self) -> drafter_pb2.StepsResponse:
        avail = self.available_steps or (1, 2)
        return drafter_pb2.StepsResponse(steps=self.proposer.steps, available=list(avail))

    async def Release(self, request, context):
        n = await asyncio.get_running_loop().run_in_executor(
            self._pool, self._release, list(request.seq_ids), "release"
        )
        return drafter_pb2.ReleaseResponse(released=n)

    async def Stats(self, request, context):
        p = self.proposer
        ids = [i for i in self._last_use if i != PROBE_ID]
        ctx = sum(p.context_length(i) for i in ids)
        return drafter_pb2.StatsResponse(
            active_sequences=len(ids),
            context_tokens=ctx,
            state_bytes=ctx * p.bytes_per_context_token,
            steps=p.steps,
            drafter=self.name,
            block_size=p.block_size,
            feature_dim=p.feature_dim,
        )


async def serve(
    service: DrafterService,
    host: str,
    port: int,
    metrics_port: int,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    token: str = "",
    reflection_on: bool = False,
    probe_interval_s: float = 5.0,
) -> None:
    """token: every call but health must carry it (DRAFTER_TOKEN_HEADER); "" = no check
    (local use). Health says NOT_SERVING while a tiny draft through the worker fails."""
    health_servicer = health.aio.HealthServicer()
    name = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"]
    await service.start(health_servicer, name.full_name, probe_interval_s)
    try:
        await serve_grpc(
            "drafter",
            lambda server: add_service(server, service, name),
            [name.full_name],
            host,
            port,
            metrics_port,
            registry=service.metrics.registry,
            max_message_bytes=256 << 20,
            ready=ready,
            stop=stop,
            interceptors=(TokenAuth(DRAFTER_TOKEN_HEADER, token),) if token else (),
            reflection_on=reflection_on,
            health_servicer=health_servicer,
        )
    finally:
        await service.stop()


def main(argv: list[str] | None = None) -> None:
    c = parse(
        DrafterServiceConfig, argv, "FlashMap drafter service", "python -m drafter_service.server"
    )
    setup_logging(c.log_level)
    if not c.token and c.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "no %s: any client that reaches %s:%d can drive this drafter",
            DRAFTER_TOKEN_ENV,
            c.host,
            c.port,
        )
    device = c.device or ("cuda" if _cuda() else "cpu")
    proposer = load_proposer(
        c.drafter,
        c.target_dir,
        device=device,
        n_slots=c.n_slots,
        max_context=c.max_context,
        steps=c.steps,
        min_confidence=c.min_confidence,
        shared_noise=not c.per_slot_noise,
        greedy_estimate=c.greedy_estimate,
        greedy_noise_scale=c.greedy_noise_scale,
        second_jump_net=c.second_jump_net,
        sampled_tree=not c.eagle3_chains,
    )
    steps = tuple(sorted({1, 2, c.steps}))
    if device.startswith("cuda") and c.cuda_graphs:
        report = proposer.enable_graphs(steps=steps)  # logs capture time and memory
        log.info("CUDA graphs captured", extra=fields(**report))
    elif c.compile:
        report = proposer.enable_compile(steps=steps)
        log.info("drafter compiled", extra=fields(**report))
    name = "init" if c.drafter == "init" else os.path.basename(os.path.normpath(c.drafter))
    cpus = parse_cpu_list(c.cpus) if c.cpus else None
    service = DrafterService(proposer, name=name, idle_timeout_s=c.idle_timeout_s, cpus=cpus)
    run(
        serve(
            service,
            c.host,
            c.port,
            c.metrics_port,
            token=c.token,
            reflection_on=c.reflection,
            probe_interval_s=c.probe_interval_s,
        )
    )


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    main()
