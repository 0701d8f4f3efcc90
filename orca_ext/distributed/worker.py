"""A worker process: one device, one pipeline stage's layers, one tensor-parallel shard.

    python -m orca_ext.distributed.worker --rank R --world-size W --master-addr A --master-port P
                                          [--local-index I] [--threads N] [--parent-pid PID]

It joins the driver's rendezvous (a TCPStore on the master address, as torchrun does), receives
its ``WorkerSpec`` from the driver, builds its shard, reports, and then runs one batch per control
message (a ``SchedulerOutput``, through the same ``ModelRunner`` steps as the in-process engine;
or a LoRA adapter to add or remove, of which it keeps its share) until it gets ``STOP``. A stage
leader (TP rank 0) receives each message from the previous hop, forwards it to the next stage at
once (before computing), and broadcasts it to its TP peers.
A failure is written to the store (``orca/error/<rank>``) for the driver, and the process exits
non-zero; its peers then fail on their closed connections, so no worker lingers.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import signal
import sys
import traceback
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..batch import RunnerOutput, SchedulerOutput
from ..kv import KVCache
from ..lora.manager import LoRAManager
from ..lora.shard import AdapterShard
from ..model.dtypes import resolve_dtype
from ..model.loader import load_model_info
from ..runner import ModelRunner
from .comm import Channel, Groups, build_groups
from .config import Layout
from .messages import STOP, AddLoRA, RemoveLoRA, WorkerSpec
from .pipeline import cut_stage, stage_keeps
from .sharded_load import build_meta_model, load_shards
from .tensor_parallel import TPGroup, parallelize


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int, groups: Groups, device: torch.device) -> None:
        layout = Layout(spec.tp, spec.pp)
        self.layout, self.rank, self.groups, self.device = layout, rank, groups, device
        self.stage, self.tp_rank = layout.coords(rank)
        self.first, self.last = self.stage == 0, self.stage == spec.pp - 1
        self.leader = self.tp_rank == 0
        info = load_model_info(spec.model)
        config = info.config
        dtype = resolve_dtype(spec.dtype)
        layers = range(*spec.stage_layers[self.stage])
        keep = stage_keeps(layers, self.first, self.last)
        model = build_meta_model(config, dtype, device)
        load_shards(model, info, keep, self.tp_rank, spec.tp, dtype, device)
        tp_group = None
        if spec.tp > 1:
            tp_group = TPGroup(groups.tp, layout.stage_ranks(self.stage), self.tp_rank,
                               "gloo" if device.type == "cpu" else "nccl")
        parallelize(model, config, tp_group, keep)
        self.received = cut_stage(model, layers, self.first)
        self.model = model.eval()
        self.hidden_size, self.dtype = config.hidden_size, dtype
        local = dataclasses.replace(config, num_layers=len(layers),
                                    num_heads=config.num_heads // spec.tp,
                                    num_kv_heads=config.num_kv_heads // spec.tp,
                                    layer_types=config.layer_types[layers.start:layers.stop])
        kv_cache = KVCache(local, spec.num_blocks, spec.block_size, dtype, device)
        self.lora = None
        if spec.lora is not None:  # this worker's share of each adapter, read from its files
            shard = AdapterShard(build_meta_model(config, dtype, "cpu"), layers, self.tp_rank,
                                 spec.tp)
            self.lora = LoRAManager(self.model, *spec.lora, shard=shard)
        # The in-process runner's input preparation and forward path, on this stage's layers.
        self.runner = ModelRunner(self.model, kv_cache, cuda_graphs=False,
                                  lora_manager=self.lora)
        if self.leader:
            prev_hop = layout.DRIVER if self.first else layout.leader(self.stage - 1)
            next_hop = layout.DRIVER if self.last else layout.leader(self.stage + 1)
            self.ctrl_in = Channel(groups.ctrl_in, prev_hop)
            self.ctrl_out = Channel(groups.ctrl_out, next_hop)
        # The leader passes each control message to its TP peers point to point (cheaper than
        # a gloo broadcast), on the stage's control group.
        stage_ranks = layout.stage_ranks(self.stage)
        self.peers = [Channel(groups.tp_ctrl, r) for r in stage_ranks[1:]] if self.leader else []
        self.from_leader = None if self.leader else Channel(groups.tp_ctrl, stage_ranks[0])
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()  # hidden states in flight

    def run(self) -> None:
        with torch.inference_mode():
            while True:
                msg = self._next_message()
                if isinstance(msg, str):  # STOP
                    break
                if isinstance(msg, AddLoRA):
                    self.lora.add(msg.request)
                elif isinstance(msg, RemoveLoRA):
                    self.lora.remove(msg.lora_int_id)
                else:
                    self._step(msg)
        for work, _ in self._sends:
            work.wait()
        if self.leader:
            if self.last:
                self.ctrl_out.send(STOP)
            for channel in [self.ctrl_out, *self.peers]:
                channel.flush()

    def _next_message(self) -> SchedulerOutput | AddLoRA | RemoveLoRA | str:
        if not self.leader:
            return self.from_leader.recv()
        msg = self.ctrl_in.recv()
        if not self.last:
            self.ctrl_out.send(msg)  # forward at once: the next stage prepares meanwhile
        for peer in self.peers:
            peer.send(msg)
        return msg

    def _step(self, batch: SchedulerOutput) -> None:
        runner = self.runner
        runner.sampler.drop(batch.finished_request_ids)
        inputs = runner.prepare(batch)
        output = RunnerOutput(batch.batch_id, [s.request_id for s in inputs.sampled], [], [])
        if not batch.requests:
            if self.last and self.leader:
                self.ctrl_out.send(output)
            return
        inputs = runner.to_device(inputs)
        if not self.first:
            hidden = torch.empty(inputs.num_tokens, self.hidden_size, dtype=self.dtype,
                                 device=self.device)
            dist.recv(hidden, self.layout.rank(self.stage - 1, self.tp_rank),
                      group=self.groups.prev)
            self.received.hidden = hidden
        hidden = runner.forward(inputs)
        if not self.last:
            while self._sends and self._sends[0][0].is_completed():
                self._sends.popleft()
            dst = self.layout.rank(self.stage + 1, self.tp_rank)
            self._sends.append((dist.isend(hidden, dst, group=self.groups.next), hidden))
            return
        if inputs.sampled:
            logits = runner.logits(inputs, hidden)  # every TP rank: the vocab slices gather
            if self.leader:
                runner.sample(inputs, logits, output, batch.token_bitmask)
        if self.leader:
            self.ctrl_out.send(output)


def _die_with_parent(parent_pid: int | None) -> None:
    """Get SIGKILLed when the process (thread) that started us goes away."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)


def _device(spec: WorkerSpec, local_index: int) -> torch.device:
    if spec.device == "cpu":
        return torch.device("cpu")
    if local_index >= torch.cuda.device_count():
        raise RuntimeError(f"worker {local_index} on this node needs cuda:{local_index}, but "
                           f"only {torch.cuda.device_count()} GPUs are visible")
    torch.cuda.set_device(local_index)
    return torch.device("cuda", local_index)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orca_ext.distributed.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--local-index", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when workers stop
    torch.set_num_threads(args.threads)
    rank = args.rank
    timeout = timedelta(seconds=args.startup_timeout)
    store = dist.TCPStore(args.master_addr, args.master_port, args.world_size, is_master=False,
                          timeout=timeout)
    store.set(f"orca/joined/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world_size,
                            timeout=timeout)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    spec: WorkerSpec = box[0]
    layout = Layout(spec.tp, spec.pp)
    where = layout.describe(rank)
    groups = build_groups(layout, rank, "gloo" if spec.device == "cpu" else "nccl")
    try:
        worker = Worker(spec, rank, groups, _device(spec, args.local_index))
        status = None
    except Exception as exc:  # noqa: BLE001  (reported to the driver, which stops everyone)
        traceback.print_exc()
        status = f"{where}: {type(exc).__name__}: {exc}"
    dist.gather_object(status, None, dst=0)
    box = [None]
    dist.broadcast_object_list(box, src=0)
    if status is not None or box[0] != "go":
        return 1
    try:
        worker.run()
    except Exception as exc:  # noqa: BLE001
        text = f"{where}: {type(exc).__name__}: {exc}"
        print(f"orca worker: {text}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        try:
            store.set(f"orca/error/{rank}", text)
        except Exception:  # noqa: BLE001  (the driver may be gone)
            pass
        os._exit(1)  # do not wait on peers in process-group teardown
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
