"""What every FlashMap gRPC server does the same way: health, reflection, signals, graceful stop.

Both services (orchestrator, drafter) call `serve_grpc` with their servicers; it returns
when SIGINT/SIGTERM (or `stop`) fires, after health has gone NOT_SERVING and in-flight
RPCs had `grace` seconds to finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from flashmap.logs import fields

log = logging.getLogger("flashmap.grpc")


async def serve_grpc(
    name: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    host: str,
    port: int,
    metrics_port: int = 0,
    registry: CollectorRegistry | None = None,
    max_message_bytes: int = 64 << 20,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    grace_s: float = 2.0,
) -> None:
    if metrics_port:
        start_http_server(metrics_port, addr=host, registry=registry)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes),
    ])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for svc in ("", *service_names):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    log.info(f"{name} serving", extra=fields(grpc=f"{host}:{port}", metrics=metrics_port))
    if ready is not None:
        ready.set()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=grace_s)


def run(coro) -> None:
    """Run a service's main coroutine on uvloop when installed (faster event loop), else asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


# ----------------------------------------------------------------------------- clients of a server

def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1 that are free right now (the tiny race until a server
    binds them is fine for tests and `flashmap up`)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def wait_grpc_health(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Block until the gRPC health service at url says SERVING; raise with the log's tail if
    proc exits first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                tail = log.read_text()[-3000:] if log and log.exists() else ""
                raise RuntimeError(f"process for {url} exited with {proc.returncode}:\n{tail}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s:\n{tail}")
