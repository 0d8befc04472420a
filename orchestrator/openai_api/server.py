"""The OpenAI-compatible HTTP API's app and server: /v1/completions, /v1/chat/completions,
/v1/models, /health on the orchestrator's event loop (uvicorn, started by orchestrator.server
beside the gRPC server): the routes, the API key and body-size check, and every error in
OpenAI's shape. The endpoints' work is orchestrator.openai_api.serving's, the bodies and
answers orchestrator.openai_api.protocol's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from flashmap.auth import bearer
from flashmap.types import InvalidRequest
from orchestrator.openai_api.protocol import ApiError, ChatRequest, CompletionRequest
from orchestrator.openai_api.serving import OpenAIServing, error_response, json_response
from orchestrator.requests import chat_support

log = logging.getLogger("flashmap.openai")


# ----------------------------------------------------------------------------- the app


def create_app(orch) -> FastAPI:
    """The FastAPI app over a started Orchestrator."""
    app = FastAPI(
        title="FlashMap Serve (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None
    )
    started = int(time.time())
    serving = OpenAIServing(orch)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, e: InvalidRequest):
        return error_response(ApiError(400, str(e)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        if "json" not in request.headers.get("content-type", ""):
            return error_response(
                ApiError(400, "send the request body as JSON (Content-Type: application/json)")
            )
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "extra_forbidden":
            msg = f"unsupported field {loc[-1]!r}" if loc else "unsupported field"
        elif err.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", []
        else:
            msg = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}"
        return error_response(ApiError(400, msg, param=".".join(loc) or None))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(
            ApiError(e.status_code, f"{e.detail}: {request.method} {request.url.path}", kind)
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("HTTP request failed")
        return error_response(
            ApiError(500, f"internal error: {type(e).__name__}", "server_error", code="internal")
        )

    def model_card() -> dict:
        return {
            "id": orch.info.model_name,
            "object": "model",
            "created": started,
            "owned_by": "flashmap",
            "max_model_len": orch.info.max_seq_len,
            # What the chat endpoint can do with this target's chat template.
            "chat_template": chat_support(getattr(orch, "tokenizer", None)),
        }

    @app.middleware("http")
    async def api_key(request: Request, call_next):
        """With an API key configured, every /v1 call carries `Authorization: Bearer <key>`; no body
        is larger than the public API's message limit (the gRPC port's)."""
        size = request.headers.get("content-length", "0")
        if not size.isdigit() or int(size) > orch.cfg.max_message_bytes:
            return error_response(
                ApiError(413, f"the request body is larger than {orch.cfg.max_message_bytes} bytes")
            )
        key = orch.cfg.api_key
        if (
            key
            and request.url.path.startswith("/v1")
            and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), bearer(key).encode()
            )
        ):
            return error_response(
                ApiError(
                    401,
                    "missing or wrong API key (Authorization: Bearer <key>)",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
            )
        return await call_next(request)

    @app.get("/health")
    async def health():
        ready = orch.health.ok  # what the health loop last learned: never a call that could hang
        body = {
            "status": "ok" if ready else "unavailable",
            "target_ready": ready,
            "drafter_ready": bool(orch.drafter and orch.drafter.connected),
            "active_requests": len(orch.active),
            "queued_requests": len(orch.waiting),
        }
        return json_response(body, 200 if ready else 503)

    @app.get("/v1/models")
    async def models():
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        serving.check_model(name)
        return json_response(model_card())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await serving.chat(body, request)

    return app


# ----------------------------------------------------------------------------- the server


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The gRPC server's serve loop owns SIGINT / SIGTERM and stops this server in turn.
        yield


class HttpServer:
    """The API served by uvicorn on the running event loop."""

    def __init__(self, orch, host: str, port: int, grace_s: float = 2.0):
        tls = orch.cfg.tls or (None, None)  # the gRPC port's certificate, when it has one
        config = uvicorn.Config(
            create_app(orch),
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=grace_s,
            ssl_certfile=tls[0],
            ssl_keyfile=tls[1],
        )
        self.server = _Server(config)
        self.host, self.port = host, port
        self._task: asyncio.Task | None = None

    async def start(self) -> HttpServer:
        self._task = asyncio.create_task(self.server.serve())
        while (
            not self.server.started
        ):  # listening (a port in use ends the process, as uvicorn does)
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"the HTTP API did not start on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1", self.host, self.port)
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self.server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
