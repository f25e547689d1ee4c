"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the status."""
from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

# OpenAI's error types by status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """Raised by a route; answered as the OpenAI error body with this status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)
