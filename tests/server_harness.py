"""A real ferrum server for tests: uvicorn on 127.0.0.1 at a free port, in a thread of the test
process (so a test can look at its engine), started and stopped inside the test."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import uvicorn

from ferrum.async_llm import AsyncLLM
from ferrum.server.app import build_app

START_TIMEOUT_S = 30


@contextlib.contextmanager
def running_server(llm, model_name: str = "ferrum-test", **app_kwargs):
    """Serves `llm` (a ferrum.LLM) while the block runs; yields (base URL, its AsyncLLM). The
    engine is shut down afterwards, whatever was in flight."""
    engine = AsyncLLM(llm)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name, **app_kwargs), host="127.0.0.1",
                                           port=0, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(15)
        engine.shutdown()


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def pool_is_empty(engine: AsyncLLM) -> bool:
    st = engine.stats()
    return (st["kv_blocks_used"] == 0 and st["sequences"] == 0 and st["running"] == 0
            and st["waiting_requests"] == 0)


def serve(model_path, *args):
    """`ferrum serve` in a subprocess (2 threads, a 512-token context, the model named "smollm2"),
    with `args` added; returns (process, base URL) once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrum", "serve", model_path, "--port", "0", "--threads", "2",
         "--max-model-len", "512", "--served-model-name", "smollm2", "--shutdown-timeout", "1", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "".join(log)
        log.append(line)
        found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
        if found:
            # Keep reading its log (request lines): a full pipe would stall the server.
            threading.Thread(target=proc.stdout.read, name="serve-log", daemon=True).start()
            return proc, found.group(1)
    proc.kill()
    raise AssertionError("".join(log))


def stop(proc):
    """SIGTERM, then a kill if it has not exited within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
