"""POST /v1/embeddings: ``LLM.embed``'s pooling (the last prompt token's final hidden state, unit
L2 norm) for each input, as float lists or base64 float32, the inputs sharing forwards with
whatever else the engine runs."""
from __future__ import annotations

import asyncio
import base64

from fastapi import APIRouter, Request

from ..async_llm import EngineShutDown
from ..embedding import PooledHiddenStates
from .errors import APIError
from .protocol import EmbeddingRequest
from .serving import Serving

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, request: Request):
    serving: Serving = request.app.state.serving
    serving.check_model(body.model, body.lora_scale)
    hidden = serving.engine.llm.runner.config["hidden_size"]
    if body.dimensions is not None and body.dimensions != hidden:
        raise APIError(400, f"dimensions: this model's embeddings have {hidden} dimensions and cannot be "
                            f"shortened to {body.dimensions}", "dimensions")
    try:
        prompts = [serving.prompt_ids(p) for p in body.inputs()]
    except ValueError as e:
        raise APIError(400, str(e), "input") from None
    for ids in prompts:
        serving.check_length(ids, 0)
    serving.check_room()
    pooled = [PooledHiddenStates(len(ids), "last") for ids in prompts]
    try:
        await asyncio.gather(*(serving.engine.score(ids, p, p.rows_from, embed=True,
                                                    lora_request=serving.lora_for(body.model, body.lora_scale))
                               for ids, p in zip(prompts, pooled)))
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except EngineShutDown:
        raise APIError(503, "The server is shutting down.") from None
    data = []
    for i, p in enumerate(pooled):
        vector = p.embedding(normalize=True)
        value = (base64.b64encode(vector.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                 else vector.tolist())
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(len(ids) for ids in prompts)
    return {"object": "list", "data": data, "model": serving.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
