"""The orchestrator's entry point: its config from the command line and the environment
(orchestrator.config), then the scheduler (orchestrator.scheduler) behind its two fronts, gRPC
Generate (orchestrator.grpc_api) and the OpenAI-compatible HTTP API (orchestrator.openai_api).

  python -m orchestrator.server --target-url 127.0.0.1:8001 --drafter-url 127.0.0.1:50052 \\
      --tokenizer-dir checkpoints/demo-target --port 50051 --metrics-port 9400
"""

from __future__ import annotations

import asyncio
import logging

from flashmap.auth import API_KEY_ENV
from flashmap.config import parse
from flashmap.grpc_serving import run
from flashmap.logs import setup_logging
from orchestrator.config import LOOPBACK, OrchestratorConfig
from orchestrator.grpc_api import serve_grpc_api
from orchestrator.scheduler import Orchestrator

log = logging.getLogger("flashmap.orchestrator")


async def serve(
    cfg: OrchestratorConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    orch = Orchestrator(cfg)
    await orch.start()
    http = None
    if cfg.http_port:
        from orchestrator.openai_api.server import HttpServer

        http = await HttpServer(orch, cfg.host, cfg.http_port).start()
    try:
        await serve_grpc_api(orch, ready, stop)
    finally:
        if http is not None:
            await http.stop()
        await orch.stop()


def main(argv: list[str] | None = None) -> None:
    cfg = parse(
        OrchestratorConfig,
        argv,
        "FlashMap orchestrator (the public APIs)",
        "python -m orchestrator.server",
    )
    setup_logging(cfg.log_level)
    if not cfg.api_key and cfg.host not in LOOPBACK:
        log.warning(
            "no %s: the public API on %s:%d takes requests from anyone who reaches it",
            API_KEY_ENV,
            cfg.host,
            cfg.port,
        )
    run(serve(cfg))


if __name__ == "__main__":
    main()
