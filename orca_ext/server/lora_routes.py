"""vLLM's runtime LoRA routes, present only with ``--allow-runtime-lora-updating``:
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) reads and adds an adapter under
a fresh id; ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) forgets one that no unfinished
request uses. Both answer a plain-text line on success, as vLLM does."""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from .core import ServingCore
from .protocol import ErrorResponse, _Request


class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's optional field; the name decides


def add_lora_routes(app: FastAPI, core: ServingCore, body_route: Any) -> None:
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        # Reading the adapter's files must not hold up the event loop.
        adapter = await asyncio.to_thread(core.load_lora, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.lora_name}' added "
                                 "successfully.")

    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        adapter = core.unload_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.lora_name}' removed "
                                 "successfully.")

    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413)}
    ok = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                "description": "a line saying what was done"}}
    for path, endpoint in (("/v1/load_lora_adapter", load_lora_adapter),
                           ("/v1/unload_lora_adapter", unload_lora_adapter)):
        app.router.add_api_route(path, endpoint, methods=["POST"], response_model=None,
                                 responses={**ok, **errors}, route_class_override=body_route)
