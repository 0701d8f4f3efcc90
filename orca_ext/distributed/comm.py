"""torch.distributed plumbing shared by the driver and the workers: the process groups (every
rank creates every group, in the same order) and pickled control messages sent point to point.

Planes:
- control (gloo, CPU): driver -> stage 0 leader -> stage 1 leader -> ... -> last leader -> driver,
  one 2-rank group per hop, and a per-stage group on which the leader passes each message to its
  TP peers;
- data (gloo on CPU, NCCL on GPU): per-stage TP groups (all-reduce, all-gather) and 2-rank groups
  between the same TP rank of neighbouring stages (hidden states).
Control channels wait for as long as the engine is idle, hence their long timeout.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .config import Layout

LONG_TIMEOUT = timedelta(days=365)


@dataclass
class Groups:
    """The groups one rank takes part in (None where it has none)."""

    tp: Any = None  # this stage's TP group, data plane
    tp_ctrl: Any = None  # the same ranks on gloo, for control messages
    prev: Any = None  # data pair with the previous stage's worker of the same TP rank
    next: Any = None  # data pair with the next stage's worker of the same TP rank
    ctrl_in: Any = None  # control pair this rank receives on (leaders; driver: from last stage)
    ctrl_out: Any = None  # control pair this rank sends on (leaders; driver: to stage 0)


def _group(ranks: list[int], backend: str) -> Any:
    return dist.new_group(sorted(set(ranks)), backend=backend, timeout=LONG_TIMEOUT)


def build_groups(layout: Layout, rank: int, data_backend: str) -> Groups:
    """Create every group (collectively, on all ranks) and return this rank's."""
    mine = Groups()
    for stage in range(layout.pp):
        ranks = layout.stage_ranks(stage)
        if layout.tp == 1:
            continue
        data = _group(ranks, data_backend)
        ctrl = _group(ranks, "gloo")
        if rank in ranks:
            mine.tp, mine.tp_ctrl = data, ctrl
    for stage in range(layout.pp - 1):
        for tp_rank in range(layout.tp):
            a, b = layout.rank(stage, tp_rank), layout.rank(stage + 1, tp_rank)
            pair = _group([a, b], data_backend)
            if rank == a:
                mine.next = pair
            elif rank == b:
                mine.prev = pair
    hops = [layout.DRIVER, *(layout.leader(s) for s in range(layout.pp)), layout.DRIVER]
    for src, dst in zip(hops, hops[1:]):
        pair = _group([src, dst], "gloo")
        if rank == src:
            mine.ctrl_out = pair
        if rank == dst:
            mine.ctrl_in = pair
    return mine


class Channel:
    """Pickled objects to or from one peer over a 2-rank gloo group. ``send`` returns at once
    (the payload is sent when the peer posts its receive); ``recv`` blocks."""

    def __init__(self, group: Any, peer: int) -> None:
        self.group, self.peer = group, peer
        self._pending: list[tuple[Any, ...]] = []  # works and the buffers they send

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([len(data)], dtype=torch.int64)
        works = (dist.isend(size, self.peer, group=self.group),
                 dist.isend(payload, self.peer, group=self.group))
        self._pending = [p for p in self._pending if not all(w.is_completed() for w in p[0])]
        self._pending.append((works, size, payload))

    def recv(self) -> Any:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, self.peer, group=self.group)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(payload, self.peer, group=self.group)
        return pickle.loads(payload.numpy().tobytes())

    def flush(self) -> None:
        """Wait until every message sent has been received."""
        for works, *_ in self._pending:
            for work in works:
                work.wait()
        self._pending.clear()
