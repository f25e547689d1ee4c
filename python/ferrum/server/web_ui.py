"""The chat page at ``/``: plain HTML, CSS and JavaScript files shipped in ``page/`` (no build
step), served with a Content-Security-Policy that lets the page load only its own files and talk
only to this server."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from .errors import APIError

PAGE_DIR = Path(__file__).with_name("page")
# The page's files and their types: nothing else under /ui/ is served.
FILES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
         "markdown.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}
# Scripts and styles from this origin only (no inline code, no eval), requests to this origin only,
# images only as data: URLs (the empty favicon): the page can reach nothing but this server.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

PAGE_PATHS = ("/", *(f"/ui/{name}" for name in FILES if name != "index.html"))  # open without the key

router = APIRouter(include_in_schema=False)


def _file(name: str) -> Response:
    if name not in FILES:
        raise APIError(404, f"no such file: {name}")
    return Response((PAGE_DIR / name).read_bytes(), media_type=FILES[name], headers=HEADERS)


@router.get("/")
async def index():
    return _file("index.html")


@router.get("/ui/{name}")
async def page_file(name: str):
    return _file(name)
