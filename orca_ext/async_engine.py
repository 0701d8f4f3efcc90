"""Serving API: the engine loop runs in a background thread and streams outputs to asyncio.

The loop thread is the only one that calls ``Engine.step``; the model runs there with the GIL
mostly released, so the event loop stays responsive. Requests are added and aborted from the
event loop through the engine's lock, which is never held while a batch runs.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .engine import Engine, EngineStats, PreparedPrompt, Prompt
from .lora.request import LoRARequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .config import EngineConfig


class EngineDeadError(RuntimeError):
    """The engine loop has stopped: it raised, or the engine was shut down."""


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, or an EngineDeadError to raise


class AsyncEngine:
    """``async for output in engine.generate(prompt, params, request_id)``: one cumulative
    RequestOutput per generated token, the last with ``finished`` set. Cancelling the consuming
    task (or leaving the loop early) aborts the request.

    ``is_healthy`` is False once the loop has died, or while one step has been running for more
    than ``stuck_timeout`` seconds.
    """

    def __init__(self, engine: Engine, *, stuck_timeout: float = 300.0) -> None:
        self.engine = engine
        self.stuck_timeout = stuck_timeout
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._error: EngineDeadError | None = None
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._run, name="orca-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, *, stuck_timeout: float = 300.0) -> AsyncEngine:
        """Build the engine ``config`` describes and serve it."""
        from .build import build_engine

        return cls(build_engine(config), stuck_timeout=stuck_timeout)

    async def generate(self, prompt: Prompt | PreparedPrompt,
                       params: SamplingParams | None = None, request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (``Engine.add_request`` takes the prompt and params, or
        a prompt ``Engine.prepare`` gave; with ``lora_request``'s adapter, if given). Bad input
        raises ValueError naming the field, before the first output; a dead engine raises
        EngineDeadError."""
        request_id = uuid.uuid4().hex if request_id is None else request_id
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        added = finished = False
        try:
            self._check_alive()  # after registering: a dying loop fails every registered stream
            self.engine.add_request(request_id, prompt, params, lora_request=lora_request)
            added = True
            self._wake.set()
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, EngineDeadError):
                    raise item
                finished = item.finished
                yield item
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if added and not finished:
                self.engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with a final output whose finish_reason is "abort"."""
        output = self.engine.abort(request_id)
        if output is not None:
            self._deliver(request_id, output)

    def is_healthy(self) -> bool:
        if self._error is not None or not self._thread.is_alive():
            return False
        started = self._step_started
        return started is None or time.monotonic() - started < self.stuck_timeout

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the loop after its current step (open streams get EngineDeadError), then the
        engine's executor (a distributed one stops its workers)."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self.engine.shutdown()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                self._loop()
            error = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # noqa: BLE001  (report any failure to every stream)
            error = EngineDeadError(f"the engine loop failed: {exc!r}")
            error.__cause__ = exc
        self._error = error
        for request_id in list(self._streams):
            self._deliver(request_id, error)

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            if not self.engine.has_unfinished():
                self._wake.wait()
                continue
            self._step_started = time.monotonic()
            outputs = self.engine.step()
            self._step_started = None
            for output in outputs:
                self._deliver(output.request_id, output)

    def _deliver(self, request_id: str, item: RequestOutput | EngineDeadError) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # its event loop has closed: nobody will read this request
            self.engine.abort(request_id)
