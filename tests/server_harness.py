"""A real ferrum server for tests: uvicorn on 127.0.0.1 at a free port, in a thread of the test
process (so a test can look at its engine), started and stopped inside the test."""
from __future__ import annotations

import contextlib
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
