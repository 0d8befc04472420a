"""What every FlashMap gRPC server does the same way: health, optional reflection, TLS and
token checks, a message size limit, malformed requests refused cleanly, signals, graceful stop.

Both services (orchestrator, drafter) call `serve_grpc` with their servicers; it returns
when SIGINT/SIGTERM (or `stop`) fires, after health has gone NOT_SERVING and in-flight
RPCs had `grace` seconds to finish. Also the clients' helpers (free ports, waiting for health).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from flashmap.logs import fields

log = logging.getLogger("flashmap.grpc")


class Malformed:
    """Stands in for a request whose bytes are not the message they claim to be (the handler
    answers INVALID_ARGUMENT; gRPC itself would log a traceback and answer UNKNOWN) or that
    are over the service's size limit (RESOURCE_EXHAUSTED, before any parsing)."""

    def __init__(self, error: Exception, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        self.error = error
        self.code = code

    @property
    def message(self) -> str:
        return (
            str(self.error)
            if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            else f"malformed request: {self.error}"
        )

    def __repr__(self) -> str:
        return f"Malformed({self.error})"


def _tolerant(
    parse: Callable[[bytes], object], max_bytes: int | None = None
) -> Callable[[bytes], object]:
    def deserialize(data: bytes):
        if max_bytes is not None and len(data) > max_bytes:
            return Malformed(
                ValueError(f"the request is {len(data)} bytes, more than the limit of {max_bytes}"),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 - DecodeError and friends
            return Malformed(e)

    return deserialize


def _refuse_malformed(fn, client_streaming: bool):
    """Wrap a servicer method so a Malformed request ends the call with INVALID_ARGUMENT."""
    if client_streaming:

        async def checked_stream(request_iterator, context):
            async def requests():
                async for r in request_iterator:
                    if isinstance(r, Malformed):
                        await context.abort(r.code, r.message)
                    yield r

            result = fn(requests(), context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:
                yield await result

        return checked_stream

    async def check(request, context):
        if isinstance(request, Malformed):
            await context.abort(request.code, request.message)

    import inspect

    if inspect.isasyncgenfunction(fn):

        async def checked_gen(request, context):
            await check(request, context)
            async for item in fn(request, context):
                yield item

        return checked_gen

    async def checked(request, context):
        await check(request, context)
        return await fn(request, context)

    return checked


def add_service(
    server: grpc.aio.Server, servicer, service, max_message_bytes: int | None = None
) -> None:
    """Register `servicer` for the proto `service` descriptor, like the generated add_*_to_server,
    but a request that does not parse gets INVALID_ARGUMENT instead of UNKNOWN and a traceback,
    and one over max_message_bytes RESOURCE_EXHAUSTED without being parsed (serve_grpc's
    transport_bytes says how large a message gRPC hands over at all)."""
    from google.protobuf import message_factory

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for m in service.methods:
        req = message_factory.GetMessageClass(m.input_type)
        resp = message_factory.GetMessageClass(m.output_type)
        fn = getattr(servicer, m.name)
        if m.client_streaming and not m.server_streaming:
            raise NotImplementedError("stream-unary methods are not used here")
        handlers[m.name] = kinds[(m.client_streaming, m.server_streaming)](
            _refuse_malformed(fn, m.client_streaming),
            request_deserializer=_tolerant(req.FromString, max_message_bytes),
            response_serializer=resp.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


class TokenAuth(grpc.aio.ServerInterceptor):
    """Every call must carry `header: value` in its metadata (a shared token or an API key),
    except the standard health service (probes) and any method in `open_methods`.
    Compared in constant time."""

    def __init__(self, header: str, value: str, open_methods: tuple[str, ...] = ()):
        import hmac

        self._eq = hmac.compare_digest
        self.header, self.value = header.lower(), value.encode()
        self.open = ("/grpc.health.v1.Health/", *open_methods)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {self.header}")

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(_deny_stream(deny)),
        }

    async def intercept_service(self, continuation, details):
        if details.method.startswith(self.open):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get(self.header, "")
        if self._eq(given.encode() if isinstance(given, str) else given, self.value):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        return self._deny[(handler.request_streaming, handler.response_streaming)]


def _deny_stream(deny):
    async def handler(request_iterator, context):
        await deny(None, context)
        yield  # pragma: no cover - deny aborts

    return handler


async def serve_grpc(
    name: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    host: str,
    port: int,
    metrics_port: int = 0,
    registry: CollectorRegistry | None = None,
    max_message_bytes: int = 4 << 20,
    transport_bytes: int | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    grace_s: float = 2.0,
    interceptors: tuple = (),
    tls: tuple[str, str] | None = None,
    reflection_on: bool = False,
    health_servicer: health.aio.HealthServicer | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM or `stop`. tls: (certificate chain file, private key file);
    reflection_on: register the reflection service; health_servicer: the caller's, to flip
    NOT_SERVING when a part behind the server fails (else one that always says SERVING).
    transport_bytes: the largest message gRPC receives (default max_message_bytes). gRPC's own
    refusal of a larger one takes longer than receiving it (docs/experiments/
    2026-12-01-security.md); a transport limit above max_message_bytes lets add_service refuse
    the messages in between as soon as they have arrived."""
    if metrics_port:
        start_http_server(metrics_port, addr=host, registry=registry)
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", transport_bytes or max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
    register(server)
    health_servicer = health_servicer or health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection_on:
        reflection.enable_server_reflection(
            (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    if tls is not None:
        cert, key = (Path(x).read_bytes() for x in tls)
        server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(key, cert)]))
    else:
        server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for svc in ("", *service_names):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        f"{name} serving",
        extra=fields(
            grpc=f"{host}:{port}",
            metrics=metrics_port,
            tls=tls is not None,
            reflection=reflection_on,
        ),
    )
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


def ports_in_use(host: str, ports: list[int]) -> list[int]:
    """Those of `ports` that a process on this machine already listens on at `host` (binding
    fails; SO_REUSEADDR, so a stopped server's closing connections do not count)."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def free_port() -> int:
    return free_ports(1)[0]


def wait_grpc_health(
    url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
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
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s:\n{tail}")
