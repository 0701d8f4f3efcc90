"""The OpenAI-compatible HTTP API (FastAPI): ``create_app(engine, ...)``.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /tokenize and POST /detokenize
(vLLM's), GET /v1/models, GET /health,
GET /metrics, and their OpenAPI document at GET /openapi.json; and pages for people (``web``):
the chat at GET /, the live engine dashboard at GET /dashboard. The POST bodies are declared as
the request models of ``protocol``, from which FastAPI documents them, but read and parsed here
(``_BodyRoute``, not by FastAPI) so that every failure, malformed JSON included, gets an
OpenAI-style error body with the right status. A client that disconnects -- while its request
waits, runs, or streams -- aborts the request in the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_engine import AsyncEngine
from ..detokenizer import TokenText
from .core import Generation, ServingCore
from .metrics import CONTENT_TYPE
from .protocol import (
    APIError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
    CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse, Health, ModelList,
    TokenizeRequest, TokenizeResponse, chat_logprobs, chat_response, completion_logprobs,
    completion_response, finish_fields, now, parse_body, usage_of,
)
from .tools import ToolSetup, conversation, tool_setup
from .web import add_web_routes

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


def create_app(engine: AsyncEngine | ServingCore, **options: Any) -> FastAPI:
    """The FastAPI app serving ``engine``. ``options`` are ServingCore's (``model_name``,
    ``chat_template``, ``api_key``, ``max_queue``, ``max_body_bytes``, ``log_requests``); or
    pass a ServingCore to share it with the gRPC server."""
    core = engine if isinstance(engine, ServingCore) else ServingCore(engine, **options)
    app = FastAPI(title="orca_ext", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.core = core
    token_text = TokenText(core.tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(error.body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        error = APIError(500, f"internal error: {exc!r}")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health", response_model=None, responses=_documented(Health, 503))
    async def health() -> Response:
        if not core.engine.is_healthy():
            error = APIError(503, "the engine loop is dead or stuck", code="engine_unavailable")
            return JSONResponse(error.body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, responses={
        200: {"content": {CONTENT_TYPE.partition(";")[0]: {"schema": {"type": "string"}}},
              "description": "Prometheus' text format"}})
    async def metrics() -> Response:
        return Response(core.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=None, responses=_documented(ModelList, 401))
    async def models(request: Request) -> JSONResponse:
        core.check_api_key(request.headers.get("authorization"))
        base = {"id": core.model_name, "object": "model", "created": _STARTED,
                "owned_by": "orca_ext", "max_model_len": core.max_model_len,
                "root": core.model_name, "parent": None}
        adapters = [{**base, "id": r.lora_name, "root": r.lora_path, "parent": core.model_name}
                    for r in core.engine.engine.list_loras()]
        return JSONResponse({"object": "list", "data": [base, *adapters]})

    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.check()
        lora_request = core.check_model(body.model)
        model_name = core.model_name if lora_request is None else lora_request.lora_name
        texts = body.prompts()
        params = body.sampling_params(body.max_tokens, body.logprobs)
        prompts = [await core.prepare(p, params) for p in texts]
        await core.compile_structured(params, body.structured_param)
        echoes = [(p if isinstance(p, str) else _decode(core, p)) if body.echo else ""
                  for p in texts]
        request_id = core.new_request_id("cmpl")
        generation = await _race(request, core.start(prompts, request_id, lora_request))
        if body.stream:
            return _SSEResponse(_completion_chunks(generation, body, params.n, request_id,
                                                   model_name, echoes, token_text),
                                generation)
        outputs = await _race(request, generation.final())
        choices = []
        for i, output in enumerate(outputs):
            for c in output.outputs:
                choices.append({
                    "index": i * params.n + c.index, "text": echoes[i] + c.text,
                    "logprobs": None if c.logprobs is None else completion_logprobs(
                        c.token_ids, c.logprobs, token_text, len(echoes[i])),
                    **finish_fields(c)})
        return JSONResponse(completion_response(request_id, model_name, now(), choices,
                                                usage_of(outputs)))

    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.check()
        lora_request = core.check_model(body.model)
        model_name = core.model_name if lora_request is None else lora_request.lora_name
        tools = tool_setup(body.tools, body.tool_choice, body.parallel_tool_calls)
        messages, template_tools = conversation([m.for_template() for m in body.messages],
                                                tools, core.chat_template.uses_tools)
        params = body.sampling_params(body.requested_max_tokens, body.num_logprobs)
        structured_param = body.structured_param
        if tools is not None and tools.forced:
            if params.structured_outputs is not None:
                raise APIError.bad_request(f"tool_choice {tools.choice!r} cannot be combined "
                                           f"with {structured_param}", "tool_choice")
            params = dataclasses.replace(params, structured_outputs=tools.structured_outputs())
            structured_param = "tools"
        prompt = await core.prepare(
            messages, params, chat_template=core.chat_template,
            add_generation_prompt=body.add_generation_prompt, tools=template_tools,
            max_tokens_param="max_completion_tokens" if body.max_completion_tokens is not None
            else "max_tokens")
        await core.compile_structured(params, structured_param)
        request_id = core.new_request_id("chatcmpl")
        generation = await _race(request, core.start([prompt], request_id, lora_request))
        if body.stream:
            return _SSEResponse(_chat_chunks(generation, body, params.n, request_id,
                                             model_name, token_text, tools), generation)
        (output,) = await _race(request, generation.final())
        choices = []
        for c in output.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = finish_fields(c)
            if tools is not None:
                content, calls = tools.parse(c.text)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [call.openai() for call in calls]}
                    finish["finish_reason"] = _tool_calls_finish(c.finish_reason)
            choices.append({
                "index": c.index, "message": message,
                "logprobs": None if c.logprobs is None else chat_logprobs(
                    c.token_ids, c.logprobs, token_text, body.top_logprobs or 0),
                **finish})
        return JSONResponse(chat_response(request_id, model_name, now(), choices,
                                          usage_of([output])))

    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        body.check()
        core.check_model(body.model)
        if body.messages is not None:
            messages, _ = conversation([m.for_template() for m in body.messages], None,
                                       core.chat_template.uses_tools)
            ids = await core.tokenize(messages, chat_template=core.chat_template,
                                      add_generation_prompt=body.add_generation_prompt,
                                      add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = await core.tokenize(body.prompt,
                                      add_special_tokens=body.add_special_tokens is not False)
        reply: dict[str, Any] = {"count": len(ids), "max_model_len": core.max_model_len,
                                 "tokens": ids}
        if body.return_token_strs:
            reply["token_strs"] = [token_text(t) for t in ids]
        return JSONResponse(reply)

    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        core.check_model(body.model)
        if core.tokenizer is None:
            raise APIError.bad_request("this model has no tokenizer", "tokens")
        vocab = core.engine.engine.info.vocab_size
        bad = [t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise APIError.bad_request(f"tokens: token id {bad[0]} is outside the vocabulary "
                                       f"(size {vocab})", "tokens")
        return JSONResponse({"prompt": core.tokenizer.decode(body.tokens)})

    for path, endpoint, response in (("/v1/completions", completions, CompletionResponse),
                                     ("/v1/chat/completions", chat_completions,
                                      ChatCompletionResponse)):
        app.router.add_api_route(path, endpoint, methods=["POST"], response_model=None,
                                 responses=_documented(response, *_GENERATION_ERRORS,
                                                       streams=True),
                                 route_class_override=_BodyRoute)
    for path, endpoint, response in (("/tokenize", tokenize, TokenizeResponse),
                                     ("/detokenize", detokenize, DetokenizeResponse)):
        app.router.add_api_route(path, endpoint, methods=["POST"], response_model=None,
                                 responses=_documented(response, 400, 401, 404, 413),
                                 route_class_override=_BodyRoute)
    if core.allow_runtime_lora_updating:
        from .lora_routes import add_lora_routes

        add_lora_routes(app, core, _BodyRoute)
    add_web_routes(app, core)
    app.add_middleware(_CountRequests, core=core)
    app.openapi = lambda: _openapi_document(app)  # type: ignore[method-assign]
    return app


def _openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, less the 422 response it adds to every route with a body: this
    server answers a bad body with 400, as documented."""
    if app.openapi_schema is None:
        document = FastAPI.openapi(app)
        for operations in document["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            document["components"]["schemas"].pop(name, None)
    return app.openapi_schema


# What a generation request can be refused with: bad input, no or a wrong API key, a body over
# the limit, a full queue, a dead engine.
_GENERATION_ERRORS = (400, 401, 404, 413, 429, 503)
_SSE_DESCRIPTION = ("With stream=true: server-sent events, `data: <chunk>` lines (the JSON "
                    "response's description says what a chunk holds), then `data: [DONE]`")


def _documented(model: type, *error_statuses: int,
                streams: bool = False) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route: 200 with ``model`` (and with ``streams``, the event stream),
    each error status with OpenAI's error body."""
    ok: dict[str, Any] = {"model": model}
    if streams:
        # Before OpenAPI 3.2 (this document is 3.1), a streamed media type's schema describes
        # one event of the stream.
        ok["content"] = {"text/event-stream": {"schema": {
            "type": "object", "description": _SSE_DESCRIPTION, "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}
    return {200: ok, **{status: {"model": ErrorResponse} for status in error_statuses}}


class _BodyRoute(APIRoute):
    """A POST route whose endpoint is ``endpoint(body, request)``: FastAPI documents the body
    from the endpoint's type hint, and this route reads it (API key first, size bounded) and
    parses it into that model with ``parse_body``, whose errors are the OpenAI error body."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        endpoint = self.endpoint
        model = self.body_field.field_info.annotation

        async def handler(request: Request) -> Response:
            core: ServingCore = request.app.state.core
            core.check_api_key(request.headers.get("authorization"))
            body = parse_body(await _read_body(request, core.max_body_bytes), model)
            return await endpoint(body, request)

        return handler


_STARTED = now()


class _CountRequests:
    """Counts requests per API and every 4xx/5xx answer (routing and parsing errors included)."""

    def __init__(self, app: Any, core: ServingCore) -> None:
        self.app = app
        self.core = core

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        api = _API_OF_PATH.get(scope.get("path", ""), "other")
        metrics = self.core.metrics
        if api != "other":
            metrics.requests.labels(api).inc()

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if status >= 400 and status != 499:
                    metrics.errors.labels(api, str(status)).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


_API_OF_PATH = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                "/v1/models": "models"}


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to be longer than ``limit`` bytes."""
    too_large = APIError(413, f"the request body is larger than {limit} bytes",
                         code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _race(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first (then cancel it, which aborts
    the engine requests, and raise ClientDisconnected)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if task.done() and not task.cancelled() and task.exception() is None:
            result = task.result()
            if isinstance(result, Generation):
                await result.aclose()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _decode(core: ServingCore, ids: list[int]) -> str:
    return "" if core.tokenizer is None else core.tokenizer.decode(ids)


class _SSEResponse(StreamingResponse):
    """Server-sent events; however the response ends (done, disconnect, cancelled), the
    generation is closed, which aborts what is still running."""

    def __init__(self, chunks: AsyncIterator[dict[str, Any]], generation: Generation) -> None:
        super().__init__(_sse_lines(chunks), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._chunks = chunks
        self._generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._chunks.aclose()  # type: ignore[attr-defined]
            await self._generation.aclose()


async def _sse_lines(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except APIError as exc:  # the engine died mid-stream
        yield f"data: {json.dumps(exc.body())}\n\n"
    yield "data: [DONE]\n\n"


class _Cursor:
    """What a streamed choice has sent so far."""

    __slots__ = ("text", "tokens", "done")

    def __init__(self) -> None:
        self.text = self.tokens = 0
        self.done = False


async def _completion_chunks(generation: Generation, body: CompletionRequest, n: int,
                             request_id: str, model: str, echoes: list[str],
                             token_text: TokenText) -> AsyncIterator[dict[str, Any]]:
    created = now()
    cursors: dict[int, _Cursor] = {}
    extra = {"usage": None} if body.include_usage else {}
    try:
        async for i, output in generation.stream():
            for c in output.outputs:
                index = i * n + c.index
                cursor = cursors.setdefault(index, _Cursor())
                if cursor.done:
                    continue
                first = cursor.tokens == 0 and cursor.text == 0
                text, ids = c.text[cursor.text:], c.token_ids[cursor.tokens:]
                if not (text or c.finish_reason or (ids and c.logprobs is not None)):
                    continue
                offset = cursor.text + (len(echoes[i]) if echoes[i] else 0)
                choice = {
                    "index": index, "text": (echoes[i] if first else "") + text,
                    "logprobs": None if c.logprobs is None else completion_logprobs(
                        ids, c.logprobs[cursor.tokens:], token_text, offset),
                    **finish_fields(c)}
                cursor.text, cursor.tokens = len(c.text), len(c.token_ids)
                cursor.done = c.finish_reason is not None
                yield {"id": request_id, "object": "text_completion", "created": created,
                       "model": model, "choices": [choice], **extra}
        if body.include_usage:
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": model, "choices": [], "usage": usage_of(generation.latest)}
    finally:
        await generation.aclose()


async def _chat_chunks(generation: Generation, body: ChatCompletionRequest, n: int,
                       request_id: str, model: str, token_text: TokenText,
                       tools: ToolSetup | None) -> AsyncIterator[dict[str, Any]]:
    """Chat chunks: the role, then content deltas; with tools, text that may still turn out to
    be a tool call is held back, and a finished reply's calls go out as tool-call deltas (each
    call whole) before the chunk with ``finish_reason`` "tool_calls"."""
    created = now()
    cursors: dict[int, _Cursor] = {}
    extra = {"usage": None} if body.include_usage else {}

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [choice], **extra}

    try:
        for index in range(n):  # the role first, as OpenAI does
            yield chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
        async for _, output in generation.stream():
            for c in output.outputs:
                cursor = cursors.setdefault(c.index, _Cursor())
                if cursor.done:
                    continue
                calls = []
                if tools is not None and c.finish_reason is not None:
                    _, calls = tools.parse(c.text)
                shown = c.text
                if tools is not None and (c.finish_reason is None or calls):
                    shown = c.text[:len(c.text) - tools.held_back(c.text)]
                text, ids = shown[cursor.text:], c.token_ids[cursor.tokens:]
                if not (text or c.finish_reason or (ids and c.logprobs is not None)):
                    continue
                finish = finish_fields(c)
                if calls:
                    if text:
                        yield chunk({"index": c.index, "delta": {"content": text},
                                     "logprobs": None, "finish_reason": None})
                    text = ""
                    yield chunk({"index": c.index, "delta": {"tool_calls": [
                        call.openai(i) for i, call in enumerate(calls)]},
                        "logprobs": None, "finish_reason": None})
                    finish["finish_reason"] = _tool_calls_finish(c.finish_reason)
                delta = {"content": text} if text or not c.finish_reason else {}
                choice = {
                    "index": c.index, "delta": delta,
                    "logprobs": None if c.logprobs is None else chat_logprobs(
                        ids, c.logprobs[cursor.tokens:], token_text, body.top_logprobs or 0),
                    **finish}
                cursor.text, cursor.tokens = len(shown), len(c.token_ids)
                cursor.done = c.finish_reason is not None
                yield chunk(choice)
        if body.include_usage:
            output = generation.latest[0]
            yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
                   "model": model, "choices": [],
                   "usage": usage_of([output])}
    finally:
        await generation.aclose()


def _tool_calls_finish(finish_reason: str | None) -> str | None:
    """A reply that called tools ends with "tool_calls" unless it was cut short."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
