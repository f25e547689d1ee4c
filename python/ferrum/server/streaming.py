"""Server-sent events as OpenAI streams them: ``data: {chunk}`` events, then ``data: [DONE]``."""
from __future__ import annotations

import json
from typing import AsyncIterator, List, Optional

from fastapi import Request
from sse_starlette import EventSourceResponse

from .errors import APIError, error_body


def sse_response(request: Request, events: AsyncIterator[str]) -> EventSourceResponse:
    """Streams `events` (each the data of one event), then [DONE]; an APIError raised on the way
    becomes an error event. A client that disconnects cancels the stream, which aborts its
    requests; at shutdown a stream has the server's grace period to finish before it is
    cancelled the same way."""
    return EventSourceResponse(_openai_events(events), sep="\n", ping=15,
                               shutdown_grace_period=request.app.state.shutdown_grace_seconds)


async def _openai_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield json.dumps(error_body(e.status, e.message, e.param))
    finally:
        await events.aclose()
    yield "[DONE]"


class Chunks:
    """Stream chunks of one response: its id, created time and model on each, ``usage`` null on
    each but the last when the request asked for usage (``stream_options.include_usage``)."""

    def __init__(self, header: dict, kind: str, include_usage: bool):
        self.base = {**header, "object": kind}
        self.include_usage = include_usage

    def __call__(self, choices: List[dict], usage: Optional[dict] = None) -> str:
        payload = {**self.base, "choices": choices}
        if self.include_usage:
            payload["usage"] = usage
        return json.dumps(payload)


def sse_typed_response(request: Request, events: AsyncIterator[dict]) -> EventSourceResponse:
    """Streams named events (``{"event": type, "data": json}``, the Responses API's shape, with
    no [DONE]); an APIError raised on the way becomes an ``error`` event. Disconnects and
    shutdown end it as ``sse_response``'s."""
    async def guarded():
        try:
            async for event in events:
                yield event
        except APIError as e:
            yield {"event": "error", "data": json.dumps({"type": "error", "code": str(e.status), "message": e.message,
                                                         "param": e.param})}
        finally:
            await events.aclose()
    return EventSourceResponse(guarded(), sep="\n", ping=15,
                               shutdown_grace_period=request.app.state.shutdown_grace_seconds)
