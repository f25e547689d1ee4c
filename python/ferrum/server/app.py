"""The FastAPI application: routes, the API key, and errors in OpenAI's shape."""
from __future__ import annotations

import hmac
import logging
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from ..async_llm import AsyncLLM
from . import chat, completions, routes
from .errors import APIError, error_response
from .metrics import ServerMetrics
from .serving import Serving
from .web_ui import router as page_router

log = logging.getLogger("ferrum.server")


def build_app(engine: AsyncLLM, model_name: str, *, api_key: Optional[str] = None,
              max_waiting_requests: int = 256, shutdown_grace_seconds: float = 10.0,
              web_ui: bool = True) -> FastAPI:
    """The server's app over a running engine. api_key: required (``Authorization: Bearer KEY``)
    on /v1 routes when given. max_waiting_requests: more waiting than this and new requests get
    503. shutdown_grace_seconds: once uvicorn is told to stop, streams still open this long
    later are cut. web_ui: the chat page at / (open, like /health: it asks for the key itself)."""
    if not isinstance(max_waiting_requests, int) or max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be a positive integer, got {max_waiting_requests!r}")
    app = FastAPI(title="ferrum", summary="OpenAI-compatible completions and chat over ferrum's engine",
                  version="0.1.0")
    app.state.serving = Serving(engine, model_name, max_waiting_requests, ServerMetrics(model_name))
    app.state.shutdown_grace_seconds = shutdown_grace_seconds

    def check_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.")

    guarded = [Depends(check_api_key)] if api_key else []
    for router in (completions.router, chat.router, routes.v1):
        app.include_router(router, dependencies=guarded)
    app.include_router(routes.public)
    if web_ui:
        app.include_router(page_router)

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
