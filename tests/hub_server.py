"""A Hugging Face hub look-alike on loopback: enough of the HTTP API for huggingface_hub's
hf_hub_download and snapshot_download (repo info, file tree, resolve with ETag / commit
headers) to fetch the files of local directories. Tests point HF_ENDPOINT at it."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0" * 39 + "1"


class HubServer:
    """repos: {"org/name": directory}. Use as a context manager; `.url` is the endpoint."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = {k: Path(v) for k, v in repos.items()}
        self.requests: list[str] = []
        handler = type("Handler", (_Handler,), {"hub": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def _etag(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer

    def log_message(self, *args):  # keep test output clean
        pass

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _serve(self, body: bool):
        path = unquote(urlparse(self.path).path)
        self.hub.requests.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(f"{parts[2]}/{parts[3]}", parts[4:], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(f"{parts[0]}/{parts[1]}", "/".join(parts[4:]), body)
        self._send(404, b"not found", {"X-Error-Code": "RepoNotFound"}, body)

    def _api(self, repo: str, rest: list[str], body: bool):
        if repo not in self.hub.repos:
            return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        files = self.hub.files(repo)
        if rest[:1] == ["tree"]:
            doc = [{"type": "file", "path": n, "size": p.stat().st_size, "oid": _etag(p)} for n, p in files.items()]
        else:  # repo info (optionally at a revision)
            doc = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]}
        self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"}, body)

    def _resolve(self, repo: str, filename: str, body: bool):
        f = self.hub.files(repo).get(filename) if repo in self.hub.repos else None
        if f is None:
            return self._send(404, b"entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}, body)
        data = f.read_bytes()
        self._send(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{_etag(f)}"',
                               "Content-Type": "application/octet-stream"}, body)

    def _send(self, code: int, data: bytes, headers: dict, body: bool):
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)
