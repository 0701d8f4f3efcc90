"""What HTTP and gRPC share: auth, the model name, prompt checks, the waiting-queue bound, and
running a request (one or several prompts) on the AsyncEngine with metrics and a log line per
finished engine request.

A request's prompts are added to the engine together and the server waits for every prompt's
first output before answering, so bad input, a full queue or a dead engine is always an error
status, never a broken stream. Closing a ``Generation`` (the client went away, the call was
cancelled) aborts whatever is still running, which frees its KV at once.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from ..async_engine import AsyncEngine, EngineDeadError
from ..chat import ChatTemplate
from ..engine import PreparedPrompt, Prompt, PromptError
from ..lora.request import LoRARequest
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics
from .protocol import APIError

DEFAULT_MAX_BODY_BYTES = 4 << 20
_INLINE_TOKENIZE_CHARS = 16384

request_log = logging.getLogger("orca_ext.server.requests")
T = TypeVar("T")


class ServingCore:
    def __init__(self, engine: AsyncEngine, model_name: str = "orca-tiny", *,
                 chat_template: str | None = None, api_key: str | None = None,
                 max_queue: int | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_requests: bool = True,
                 allow_runtime_lora_updating: bool = False) -> None:
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.info.tokenizer
        self.max_model_len = engine.engine.info.max_model_len  # GET /v1/models reports it
        # ``chat_template`` (a template's text) replaces the model's own.
        self.chat_template = ChatTemplate.for_model(engine.engine.info, chat_template)
        self.api_key = api_key or None
        self.max_queue = max_queue
        self.max_body_bytes = max_body_bytes
        self.log_requests = log_requests
        self.metrics = ServerMetrics(engine)
        # POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist only when allowed.
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self._lora_ids = itertools.count(1)

    # --- checks ------------------------------------------------------------------------------

    def check_api_key(self, authorization: str | None) -> None:
        """``authorization`` is the header ("Bearer <key>"); no-op without a server key."""
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 self.api_key.encode()):
            message = ("missing API key: send 'Authorization: Bearer <key>'" if not authorization
                       else "incorrect API key")
            raise APIError(401, message, code="invalid_api_key")

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a name the server
        does not serve, as vLLM answers."""
        if model is None or model == self.model_name:
            return None
        lora = self.engine.engine.lora
        adapter = None if lora is None else lora.by_name(model)
        if adapter is None:
            served = [self.model_name, *(r.lora_name for r in self.engine.engine.list_loras())]
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{', '.join(map(repr, served))}", param="model",
                           code="model_not_found")
        return adapter

    # --- LoRA adapters -----------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Read and add an adapter under a new id; 400 naming what is wrong (nothing changes)."""
        if not name or name == self.model_name:
            raise APIError.bad_request(f"lora_name {name!r} must be a name other than the base "
                                       "model's", "lora_name")
        if self.engine.engine.lora is None:
            raise APIError.bad_request("this server was started without --enable-lora",
                                       "lora_name")
        if self.engine.engine.lora.by_name(name) is not None:
            raise APIError.bad_request(f"the LoRA adapter {name!r} has already been loaded",
                                       "lora_name")
        try:
            request = LoRARequest(name, next(self._lora_ids), path)
            self.engine.engine.add_lora(request)
        except ValueError as exc:
            raise APIError.bad_request(str(exc), "lora_path") from None
        return request

    def unload_lora(self, name: str) -> LoRARequest:
        """Forget an adapter; 404 if unknown, 400 while unfinished requests use it."""
        request = self.check_model(name) if name != self.model_name else None
        if request is None:
            raise APIError(404, f"the LoRA adapter {name!r} cannot be found", param="lora_name",
                           code="model_not_found")
        try:
            return self.engine.engine.remove_lora(request.lora_int_id)
        except ValueError as exc:
            raise APIError.bad_request(str(exc), "lora_name") from None

    def check_healthy(self) -> None:
        if not self.engine.is_healthy():
            raise APIError(503, "the engine is not running (dead or stuck)",
                           code="engine_unavailable")

    # --- prompts -----------------------------------------------------------------------------

    async def prepare(self, prompt: Prompt, params: SamplingParams, **options: Any
                      ) -> PreparedPrompt:
        """``Engine.prepare`` (the one entrance of a request) with its errors as 400s; a long
        text tokenized in a worker thread, so that the event loop keeps serving."""
        return await self._in_engine(self.engine.engine.prepare, prompt, params, **options)

    async def tokenize(self, prompt: Prompt, **options: Any) -> list[int]:
        """``Engine.tokenize``'s token ids (POST /tokenize), with its errors as 400s."""
        return (await self._in_engine(self.engine.engine.tokenize, prompt, **options))[1]

    @staticmethod
    async def _in_engine(call: Callable[..., T], prompt: Prompt, *args: Any, **options: Any
                         ) -> T:
        try:
            if isinstance(prompt, str) and len(prompt) > _INLINE_TOKENIZE_CHARS:
                return await asyncio.to_thread(call, prompt, *args, **options)
            return call(prompt, *args, **options)
        except PromptError as exc:
            raise APIError.bad_request(str(exc), exc.param, exc.code) from None

    async def compile_structured(self, params: SamplingParams, param: str) -> None:
        """Compile the request's grammar in a worker thread (the engine caches it, so adding
        the request does not compile again); one that does not compile is a 400 naming
        ``param``."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.structured.compile, spec)
        except ValueError as exc:
            raise APIError.bad_request(str(exc), param) from None

    # --- running -----------------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def start(self, prompts: list[PreparedPrompt], request_id: str,
                    lora_request: LoRARequest | None = None) -> Generation:
        """Add every prompt (``prepare``d; with ``lora_request``'s adapter, if any) and wait
        for each one's first output; APIError on bad input, a full queue or a dead engine
        (nothing is left running then)."""
        self.check_healthy()
        ids = [request_id] if len(prompts) == 1 else \
            [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = [self.engine.generate(p, None, rid, lora_request)
                   for p, rid in zip(prompts, ids)]
        tasks = [asyncio.ensure_future(self._first(s)) for s in streams]
        try:
            firsts = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()
            raise
        return Generation(self, streams, firsts)

    def request_ended(self, output: RequestOutput, aborted: bool = False) -> None:
        """Record an engine request's last output in the metrics and (at info level, unless
        ``log_requests`` is off) as one line of ``key=value`` fields, also passed to log
        handlers as the record's ``request`` attribute."""
        self.metrics.request_ended(output, aborted)
        if not self.log_requests or not request_log.isEnabledFor(logging.INFO):
            return
        m = output.metrics
        fields = {
            "request_id": output.request_id,
            "prompt_tokens": len(output.prompt_token_ids),
            "output_tokens": sum(len(c.token_ids) for c in output.outputs),
            "ttft_s": None if m.first_token_time is None
            else round(m.first_token_time - m.arrival_time, 4),
            "total_s": round((m.finish_time or time.time()) - m.arrival_time, 4),
            "finish_reason": "abort" if aborted else ",".join(
                c.finish_reason or "abort" for c in output.outputs),
        }
        request_log.info(" ".join(f"{key}={value}" for key, value in fields.items()),
                         extra={"request": fields})

    async def _first(self, stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        # No await between the queue check and the engine's add_request (inside the first
        # __anext__), so concurrent requests cannot overshoot the bound.
        if self.max_queue is not None:
            waiting = self.engine.stats().num_waiting
            if waiting >= self.max_queue:
                raise APIError(429, f"the server is busy: {waiting} requests are waiting "
                               f"(max_queue={self.max_queue}); retry later", code="queue_full")
        try:
            return await stream.__anext__()
        except ValueError as exc:
            raise APIError.from_value_error(exc) from None
        except EngineDeadError as exc:
            raise APIError(503, f"the engine is not running: {exc}",
                           code="engine_unavailable") from None
        except StopAsyncIteration:
            raise APIError(500, "the engine ended the request without output") from None


class Generation:
    """The running prompts of one API request. Iterate ``stream()`` (or await ``final()``) once;
    leaving early aborts what is still running."""

    def __init__(self, core: ServingCore, streams: list[AsyncIterator[RequestOutput]],
                 firsts: list[RequestOutput]) -> None:
        self.core = core
        self.latest = list(firsts)  # the newest output of each prompt
        self._streams = streams
        self._tasks: list[asyncio.Future] = []

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) pairs: the first outputs, then as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:  # noqa: BLE001  (re-raised by the consumer)
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, done))

        try:
            for index, output in enumerate(self.latest):
                self._record_if_finished(output)
                yield index, output
            self._tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self._streams)
                           if not self.latest[i].finished]
            remaining = len(self._tasks)
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                    continue
                if isinstance(item, EngineDeadError):
                    raise APIError(503, f"the engine stopped: {item}",
                                   code="engine_unavailable")
                if isinstance(item, Exception):
                    raise item
                self.latest[index] = item
                self._record_if_finished(item)
                yield index, item
        finally:
            await self.aclose()

    async def final(self) -> list[RequestOutput]:
        async for _ in self.stream():
            pass
        return self.latest

    async def aclose(self) -> None:
        """Abort what is still running (idempotent)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        streams, self._streams = self._streams, []
        for stream in streams:
            await stream.aclose()  # AsyncEngine.generate's finally aborts an unfinished request
        if streams:
            for output in self.latest:
                if not output.finished:
                    self.core.request_ended(output, aborted=True)

    def _record_if_finished(self, output: RequestOutput) -> None:
        if output.finished:
            self.core.request_ended(output)
