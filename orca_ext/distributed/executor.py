"""The driver side: ``DistributedExecutor`` (submit/collect with ``pp`` batches in flight).

The driver is world rank 0. It holds no weights: it keeps the scheduler (and its ``SlotAllocator``)
and sends each batch's ``SchedulerOutput`` (new requests once, then deltas) to stage 0 as the
control message (an asynchronous send, so ``submit`` returns at once); every worker builds the
iteration's tensors from it as the in-process runner does. A receiver thread takes the last stage's
replies in order; ``collect`` waits for the next one. A worker that dies (seen by the process
monitor, or as a closed connection) fails the executor at once: the other workers are killed, and
``submit``/``collect`` raise ``WorkerError``.
"""
from __future__ import annotations

import atexit
import queue
import re
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..batch import RunnerOutput, SchedulerOutput
from ..model.config import ModelConfig
from .comm import Channel, build_groups
from .config import Layout, ParallelConfig
from .launcher import WorkerProcesses
from .messages import STOP, AddLoRA, RemoveLoRA, WorkerSpec


class WorkerError(RuntimeError):
    """A worker failed or died; the distributed engine cannot go on."""


# Executors not shut down yet: stopped in order at exit (a process group torn down with a
# receive still pending aborts the interpreter).
_LIVE: weakref.WeakSet[DistributedExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_LIVE):
        executor.shutdown()


class DistributedExecutor:
    """Runs batches on ``tp x pp`` worker processes; ``num_batches_in_flight`` is ``pp``."""

    def __init__(self, parallel: ParallelConfig, spec: WorkerSpec,
                 config: ModelConfig | None = None) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already runs a distributed engine (or another "
                               "torch.distributed job); shut it down first")
        self.parallel, self.spec, self.config = parallel, spec, config
        self.layout = Layout(spec.tp, spec.pp)
        self.num_batches_in_flight = spec.pp
        self.max_batches_in_flight = 0  # the most seen at once (the pipelining test reads it)
        self._in_flight = 0
        self._replies: queue.Queue[Any] = queue.Queue()
        self._failure: WorkerError | None = None
        self._closed = False
        self._lock = threading.Lock()
        # Control messages go out from the engine loop (batches) and the servers' threads (LoRA
        # adapters added or removed): one at a time, each message's two sends together.
        self._send_lock = threading.Lock()
        self._receiver: threading.Thread | None = None
        # The LoRA adapters (``lora.DriverLoRA``), set by ``build_distributed_executor`` with
        # enable_lora; the engine takes it as the in-process runner's ``lora_manager``.
        self.lora_manager = None
        timeout = timedelta(seconds=parallel.startup_timeout)
        self._store = dist.TCPStore(parallel.master_addr, parallel.master_port,
                                    parallel.world_size, is_master=True, wait_for_workers=False,
                                    timeout=timeout)
        self.workers = WorkerProcesses(parallel, parallel.master_addr, self._store.port,
                                       self._worker_exited)
        self._finalizer = weakref.finalize(self, self.workers.kill)
        _LIVE.add(self)
        try:
            self._start(timeout)
        except BaseException as exc:
            if isinstance(exc, RuntimeError) and not isinstance(exc, WorkerError):
                self._lost(_short(exc))  # e.g. a closed connection: name the worker that died
            self.workers.kill()
            self.shutdown()
            if self._failure is None or exc is self._failure:
                raise
            raise self._failure from exc

    # --- start and stop ----------------------------------------------------------------------

    def _start(self, timeout: timedelta) -> None:
        layout, spec = self.layout, self.spec
        self.workers.start()
        keys = [f"orca/joined/{rank}" for rank in range(1, layout.world_size)]
        deadline = time.monotonic() + timeout.total_seconds()
        while not self._store.check(keys):
            if self._failure is not None:
                raise self._failure
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not join within {timeout.total_seconds():.0f} s "
                                  f"(world size {layout.world_size}; other nodes started?)")
            time.sleep(0.05)
        dist.init_process_group("gloo", store=self._store, rank=0, world_size=layout.world_size,
                                timeout=timeout)
        dist.broadcast_object_list([spec], src=0)
        groups = build_groups(layout, 0, "gloo" if spec.device == "cpu" else "nccl")
        statuses: list[str | None] = [None] * layout.world_size
        dist.gather_object(None, statuses, dst=0)
        errors = [s for s in statuses[1:] if s]
        if errors:
            self.workers.expect_exit = True  # they exit now: the reasons are in hand
        dist.broadcast_object_list(["stop" if errors else "go"], src=0)
        if errors:
            raise WorkerError("workers failed to start: " + "; ".join(errors))
        self._to_first = Channel(groups.ctrl_out, layout.leader(0))
        self._from_last = Channel(groups.ctrl_in, layout.leader(layout.pp - 1))
        self._receiver = threading.Thread(target=self._receive, name="orca-replies",
                                          daemon=True)
        self._receiver.start()

    def shutdown(self) -> None:
        """Stop the workers (after the batches in flight), or kill them if they fail to stop;
        leaves no process behind. Idempotent."""
        if self._closed:
            return
        self._closed = True
        receiver = self._receiver
        if self._failure is None and receiver is not None:
            try:
                with self._send_lock:  # runs after the batches in flight, down the pipeline
                    self._to_first.send(STOP)
                receiver.join(30.0)  # the last stage acknowledges STOP
            except Exception:  # noqa: BLE001  (a dead pipeline: the workers are killed below)
                pass
        self.workers.stop(10.0)
        if receiver is not None:
            receiver.join(10.0)
        if dist.is_initialized() and (receiver is None or not receiver.is_alive()):
            dist.destroy_process_group()
            self._store = None  # closes the rendezvous port
        self._finalizer.detach()
        _LIVE.discard(self)

    def describe(self) -> list[str]:
        """Lines for a startup banner."""
        spec, p, config = self.spec, self.parallel, self.config
        lines = []
        if config is not None:
            lines.append(f"model: {config.architecture}, {config.num_layers} layers, hidden "
                         f"{config.hidden_size}, {config.num_heads} heads ({config.num_kv_heads} "
                         f"KV), vocab {config.vocab_size}, {spec.dtype}")
        stages = " | ".join(f"{a}-{b - 1}" for a, b in spec.stage_layers)
        threads = f", {p.threads_per_worker()} threads each" if spec.device == "cpu" else ""
        lines.append(f"distributed: TP {spec.tp} x PP {spec.pp} = {p.num_workers} workers on "
                     f"{spec.device}, {p.nnodes} node(s){threads}; stage layers {stages}")
        lines.append(f"KV cache: {spec.num_blocks} blocks x {spec.block_size} tokens = "
                     f"{spec.num_blocks * spec.block_size} tokens (each worker holds its layers' "
                     f"share of the KV heads)")
        return lines

    def _worker_exited(self, rank: int, code: int) -> None:
        if not self._closed:
            self._fail(f"{self.layout.describe(rank)} exited with code {code}")

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._failure is not None:
                return
            details = self._worker_errors()
            self._failure = WorkerError(reason + (f" ({details})" if details else ""))
        self.workers.kill()
        self._replies.put(self._failure)

    def _worker_errors(self) -> str:
        """What failed workers wrote to the store before exiting."""
        found = []
        try:
            for rank in range(1, self.layout.world_size):
                key = f"orca/error/{rank}"
                if self._store.check([key]):
                    found.append(self._store.get(key).decode())
        except Exception:  # noqa: BLE001  (best effort)
            pass
        return "; ".join(found)

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise WorkerError("the distributed executor is shut down")

    # --- batches -----------------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while True:
                reply = self._from_last.recv()
                if isinstance(reply, str):  # STOP, acknowledged by the last stage
                    return
                self._replies.put(reply)
        except Exception as exc:  # noqa: BLE001
            if not self._closed:
                self._lost(f"lost the connection to the last pipeline stage ({_short(exc)})")

    def _lost(self, reason: str) -> None:
        """A connection broke: give the process monitor a moment to name the worker that died
        (its report wins), else fail with ``reason`` (e.g. a worker on another node)."""
        deadline = time.monotonic() + 1.0
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        self._fail(reason)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.send_control(scheduler_output)
        self._in_flight += 1
        self.max_batches_in_flight = max(self.max_batches_in_flight, self._in_flight)

    def send_control(self, message: SchedulerOutput | AddLoRA | RemoveLoRA) -> None:
        """Send ``message`` down the pipeline, after every message sent before it."""
        with self._send_lock:
            self._check()
            try:
                self._to_first.send(message)
            except Exception as exc:  # noqa: BLE001
                self._lost(f"could not reach pipeline stage 0 ({_short(exc)})")
                raise self._failure from exc

    def collect(self) -> RunnerOutput:
        while True:
            self._check()
            try:
                reply = self._replies.get(timeout=1.0)
            except queue.Empty:
                continue
            if isinstance(reply, WorkerError):
                raise reply
            self._in_flight -= 1
            return reply

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.submit(scheduler_output)
        return self.collect()


def _short(exc: BaseException) -> str:
    """gloo's message without its source location and advice."""
    text = re.sub(r"^\[[^\]]*\] ", "", str(exc))
    return text.split(". ")[0]
