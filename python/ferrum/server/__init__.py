"""``ferrum serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLM``.

``ferrum.server.app.build_app(engine, model_name)`` makes the application; ``ferrum.server.main``
runs it. The server modules need the ``serve`` extra (``pip install ferrum[serve]``); importing
this package (the CLI reads ``main``'s arguments) does not.
"""
