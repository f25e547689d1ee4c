"""The small endpoints: /v1/models, /health, /metrics, /tokenize, /detokenize, /tokenizer_info
(vLLM's, which lm-evaluation-harness reads to tokenize through the server)."""
from __future__ import annotations

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .errors import APIError
from .protocol import DetokenizeRequest, TokenizeRequest
from .serving import Serving

v1 = APIRouter()
public = APIRouter()  # open even with an API key: /health, /metrics


def _serving(request: Request) -> Serving:
    return request.app.state.serving


@v1.get("/v1/models")
async def list_models(request: Request):
    s = _serving(request)
    base = {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "ferrum",
            "root": str(s.engine.llm.model_path), "parent": None, "max_model_len": s.max_model_len}
    adapters = [{**base, "id": name, "root": lora.path, "parent": s.model_name}
                for name, lora in s.lora_modules.items()]
    return {"object": "list", "data": [base, *adapters]}


@public.get("/health")
async def health(request: Request):
    """200 while the engine takes requests; 503 once it does not (shutting down, or its thread ended)."""
    if not _serving(request).engine.ready:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return {"status": "ok"}


@public.get("/metrics")
async def metrics(request: Request):
    s = _serving(request)
    return Response(s.metrics.scrape(s.engine.stats()), media_type=CONTENT_TYPE_LATEST)


@v1.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    s = _serving(request)
    s.check_model(body.model)
    text = body.prompt
    add_special_tokens = body.add_special_tokens
    if body.messages is not None:
        try:
            kwargs = {**(body.chat_template_kwargs or {}), **({"tools": body.tools} if body.tools else {})}
            text = s.tokenizer.apply_chat_template([m.for_template() for m in body.messages],
                                                   add_generation_prompt=body.add_generation_prompt, **kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, str(e)) from None
        add_special_tokens = False  # the template writes any BOS itself
    tokens = s.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return {"count": len(tokens), "max_model_len": s.max_model_len, "tokens": tokens}


@v1.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    s = _serving(request)
    s.check_model(body.model)
    try:
        return {"prompt": s.tokenizer.decode(body.tokens)}
    except ValueError as e:
        raise APIError(400, str(e)) from None


@v1.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    s = _serving(request)
    tok = s.tokenizer
    return {"tokenizer_class": "ferrum.Tokenizer", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "pad_token": None, "chat_template": tok.chat_template, "model_max_length": s.max_model_len,
            "add_bos_token": tok.add_bos}
