"""The FastAPI application: routes, the API key, and errors in OpenAI's shape."""
from __future__ import annotations

import hmac
import logging
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from ..async_llm import AsyncLLM
from . import chat, completions, embeddings, lora_updates, responses, routes
from .errors import APIError, error_response
from .metrics import ServerMetrics
from .serving import Serving
from .web_ui import PAGE_PATHS, router as page_router

log = logging.getLogger("ferrum.server")
OPEN_PATHS = ("/health", "/metrics")  # what a load balancer or Prometheus reads without the key


def build_app(engine: AsyncLLM, model_name: str, *, api_key: Optional[str] = None,
              max_waiting_requests: int = 256, shutdown_grace_seconds: float = 10.0,
              tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
              max_stored_responses: int = 1000, allowed_origins: Sequence[str] = (),
              web_ui: bool = True, lora_modules: Sequence = (), enable_lora_updates: bool = False) -> FastAPI:
    """The server's app over a running engine. api_key: required (``Authorization: Bearer KEY``)
    on every route but /health and /metrics when given. allowed_origins: the browser origins
    CORS lets in (``"*"`` for any; none by default). max_waiting_requests: more waiting than this and new requests get
    503. shutdown_grace_seconds: once uvicorn is told to stop, streams still open this long
    later are cut. tool_call_parser: the format tool calls are parsed in (``hermes``,
    ``llama3_json``, ``mistral``, ``pythonic``; default: the chat template's).
    reasoning_parser: ``qwen3`` / ``deepseek_r1`` (``<think>`` blocks) or ``none``; default:
    ``<think>`` when the template has it. max_stored_responses: /v1/responses keeps this many
    (the newest) in memory for ``previous_response_id``. web_ui: the chat page at / (open without
    the key, like /health: the page asks for the key itself). lora_modules: ``LoRARequest``s served
    beside the base, a request's ``model`` naming one (the engine's LLM needs enable_lora).
    enable_lora_updates: vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which
    serve adapters from then on or stop serving them (enable_lora too)."""
    if not isinstance(max_waiting_requests, int) or max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be a positive integer, got {max_waiting_requests!r}")
    if (lora_modules or enable_lora_updates) and not engine.llm.enable_lora:
        raise ValueError("LoRA modules and LoRA updates need an LLM made with enable_lora=True")
    app = FastAPI(title="ferrum", summary="OpenAI-compatible completions and chat over ferrum's engine",
                  version="0.1.0")
    metrics = ServerMetrics(model_name, per_adapter=engine.llm.enable_lora)
    app.state.serving = Serving(engine, model_name, max_waiting_requests, metrics, tool_call_parser, reasoning_parser,
                                lora_modules)
    app.state.shutdown_grace_seconds = shutdown_grace_seconds
    app.state.responses = responses.ResponseStore(max_stored_responses)

    for router in (completions.router, chat.router, embeddings.router, responses.router, routes.v1, routes.public):
        app.include_router(router)
    if enable_lora_updates:  # else the routes do not exist (404), as in vLLM
        app.include_router(lora_updates.router)
    if web_ui:
        app.include_router(page_router)
    open_paths = OPEN_PATHS + (PAGE_PATHS if web_ui else ())

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path not in open_paths and not hmac.compare_digest(given, expected):
                return error_response(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.")
            return await call_next(request)
    if allowed_origins:  # added last: outermost, so a preflight is answered before the key is asked
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_, e: RequestValidationError):
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), where or None)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        log.exception("request failed")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    return app
