"""Starting, watching and stopping one node's worker processes (like torchrun's local agent).

Workers are ``python -m orca_ext.distributed.worker`` processes, each in its own session (a
terminal's Ctrl-C goes to the engine, which stops them in order) and killed by the kernel if the
thread that started them goes away (PR_SET_PDEATHSIG). That thread is the monitor, which lives as
long as the workers: it polls them and reports the first one that exits unexpectedly.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from .config import ParallelConfig


class WorkerProcesses:
    def __init__(self, parallel: ParallelConfig, master_addr: str, master_port: int,
                 on_exit: Callable[[int, int], None] | None = None) -> None:
        self.parallel = parallel
        self.ranks = parallel.local_ranks()
        self.master_addr, self.master_port = master_addr, master_port
        self.on_exit = on_exit  # (rank, returncode), from the monitor thread, once per worker
        self.procs: dict[int, subprocess.Popen] = {}
        self.returncodes: dict[int, int] = {}
        self.expect_exit = False  # set while stopping: exits are not failures then
        self._started = threading.Event()
        self._stopping = threading.Event()
        self._spawn_error: BaseException | None = None
        self._thread = threading.Thread(target=self._monitor, name="orca-workers", daemon=True)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.procs.items()}

    def start(self) -> WorkerProcesses:
        self._thread.start()
        self._started.wait()
        if self._spawn_error is not None:
            raise self._spawn_error
        return self

    def _command(self, rank: int, local_index: int) -> list[str]:
        p = self.parallel
        return [sys.executable, "-m", "orca_ext.distributed.worker", "--rank", str(rank),
                "--world-size", str(p.world_size), "--master-addr", self.master_addr,
                "--master-port", str(self.master_port), "--local-index", str(local_index),
                "--threads", str(p.threads_per_worker()), "--parent-pid", str(os.getpid()),
                "--startup-timeout", str(p.startup_timeout)]

    def _monitor(self) -> None:
        threads = str(self.parallel.threads_per_worker())
        env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
        try:
            for index, rank in enumerate(self.ranks):
                self.procs[rank] = subprocess.Popen(self._command(rank, index), env=env,
                                                    stdin=subprocess.DEVNULL,
                                                    start_new_session=True)
        except BaseException as exc:  # noqa: BLE001  (re-raised by start)
            self._spawn_error = exc
            self.kill()
        finally:
            self._started.set()
        while len(self.returncodes) < len(self.procs):
            exited = {rank: code for rank, proc in self.procs.items()
                      if rank not in self.returncodes and (code := proc.poll()) is not None}
            # A worker killed by a signal first: its peers' errors on the broken connections
            # follow from it, and may be seen in the same round.
            for rank, code in sorted(exited.items(), key=lambda item: (item[1] >= 0, item[0])):
                self.returncodes[rank] = code
                if self.on_exit is not None and not self.expect_exit:
                    self.on_exit(rank, code)
            # Keep polling while stopping, so that the workers are reaped; a stop that gives up
            # kills them, and they exit at once.
            self._stopping.wait(0.05)

    def alive(self) -> list[int]:
        return [rank for rank, proc in self.procs.items() if proc.poll() is None]

    def kill(self) -> None:
        """SIGKILL every worker (and anything it started)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float) -> bool:
        """Whether every worker exited within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the workers to exit, then kill the rest; return
        once all are gone."""
        self.expect_exit = True
        if not self.wait(timeout):
            self.kill()
            self.wait(30.0)
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)


def run_node(parallel: ParallelConfig) -> int:
    """Node ``node_rank >= 1`` of a multi-node engine: run this node's workers until they exit
    (the driver on node 0 stops them). Returns 0 when all exited cleanly."""
    failed = threading.Event()

    def on_exit(rank: int, code: int) -> None:
        if code != 0:
            print(f"orca-serve: worker rank {rank} exited with code {code}; stopping this node",
                  file=sys.stderr, flush=True)
            failed.set()
            workers.kill()

    workers = WorkerProcesses(parallel, parallel.master_addr, parallel.master_port, on_exit)

    def on_signal(signum: int, frame: object) -> None:
        failed.set()
        workers.kill()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        workers.start()
        print(f"orca-serve: node {parallel.node_rank}/{parallel.nnodes}: workers "
              f"{workers.ranks} joining {parallel.master_addr}:{parallel.master_port}",
              flush=True)
        while workers.alive():
            time.sleep(0.2)
        workers.stop(5.0)
    finally:
        workers.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = list(workers.returncodes.values())
    return 1 if failed.is_set() or any(codes) else 0
