"""vLLM's runtime LoRA routes (``--enable-lora-updates``; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING):
POST /v1/load_lora_adapter serves a new adapter under a name, POST /v1/unload_lora_adapter stops
serving one. Answered as vLLM answers: 200 with a line of text, or an error body."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from .protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    await request.app.state.serving.load_lora(body.lora_name, body.lora_path, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    await request.app.state.serving.unload_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
