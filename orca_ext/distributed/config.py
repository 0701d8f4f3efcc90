"""How a distributed engine is laid out: tensor/pipeline sizes, the stage-to-layer map, nodes,
and which global rank is which worker.

World ranks: 0 is the driver (the engine process on node 0; it holds no weights), workers are
``1 + stage * tp + tp_rank``. Each node runs ``num_workers // nnodes`` consecutive workers; node 0
also runs the driver.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..model.config import ModelConfig


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Layers per stage, e.g. (3, 5); None: an even split (earlier stages take the remainder).
    pipeline_layers: Sequence[int] | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one node only); several nodes must agree on one
    worker_threads: int | None = None  # CPU threads per worker (default: cores / local workers)
    startup_timeout: float = 300.0  # seconds for every worker to join and load its shard

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got "
                             f"{self.node_rank}")
        if self.num_workers % self.nnodes:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.num_workers} "
                             f"workers do not split evenly over nnodes={self.nnodes}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("several nodes need an agreed master_port (e.g. 29500)")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port: not a port: {self.master_port}")
        if self.worker_threads is not None and self.worker_threads < 1:
            raise ValueError(f"worker_threads must be >= 1, got {self.worker_threads}")
        if self.pipeline_layers is not None:
            self.pipeline_layers = tuple(int(n) for n in self.pipeline_layers)
            if len(self.pipeline_layers) != self.pipeline_parallel_size:
                raise ValueError(f"pipeline_layers: {len(self.pipeline_layers)} stages given for "
                                 f"pipeline_parallel_size={self.pipeline_parallel_size}")
            if min(self.pipeline_layers) < 1:
                raise ValueError(f"pipeline_layers: every stage needs a layer, got "
                                 f"{list(self.pipeline_layers)}")

    @property
    def enabled(self) -> bool:
        """Whether the engine needs worker processes at all."""
        return self.num_workers > 1 or self.nnodes > 1

    @property
    def num_workers(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return 1 + self.num_workers

    @property
    def workers_per_node(self) -> int:
        return self.num_workers // self.nnodes

    def local_ranks(self) -> list[int]:
        """World ranks of the workers this node runs."""
        first = 1 + self.node_rank * self.workers_per_node
        return list(range(first, first + self.workers_per_node))

    def threads_per_worker(self) -> int:
        if self.worker_threads is not None:
            return self.worker_threads
        return max(1, (os.cpu_count() or 1) // self.workers_per_node)

    def stage_layers(self, num_layers: int) -> list[range]:
        """The global layer indices of each stage."""
        pp = self.pipeline_parallel_size
        if self.pipeline_layers is not None:
            counts = list(self.pipeline_layers)
            if sum(counts) != num_layers:
                raise ValueError(f"pipeline_layers {counts} add up to {sum(counts)} layers; the "
                                 f"model has {num_layers}")
        else:
            if pp > num_layers:
                raise ValueError(f"pipeline_parallel_size={pp} is more than the model's "
                                 f"{num_layers} layers")
            counts = [num_layers // pp + (s < num_layers % pp) for s in range(pp)]
        starts = [sum(counts[:s]) for s in range(pp)]
        return [range(a, a + n) for a, n in zip(starts, counts)]

    def check_model(self, config: ModelConfig) -> None:
        """Raise ValueError (naming the sizes) if the model cannot be split this way."""
        tp = self.tensor_parallel_size
        for what, value in (("num_attention_heads", config.num_heads),
                            ("num_key_value_heads", config.num_kv_heads),
                            ("intermediate_size", config.intermediate_size)):
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                                 f"{what} ({value})")
        self.stage_layers(config.num_layers)


@dataclass(frozen=True)
class Layout:
    """Global rank arithmetic for ``tp`` x ``pp`` workers after the driver (rank 0)."""

    tp: int
    pp: int

    DRIVER = 0

    @property
    def world_size(self) -> int:
        return 1 + self.tp * self.pp

    def rank(self, stage: int, tp_rank: int) -> int:
        return 1 + stage * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, tp_rank) of a worker's global rank."""
        return divmod(rank - 1, self.tp)

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, t) for t in range(self.tp)]

    def leader(self, stage: int) -> int:
        """The stage's TP rank 0: it receives and forwards control messages."""
        return self.rank(stage, 0)

    def describe(self, rank: int) -> str:
        stage, tp_rank = self.coords(rank)
        return f"worker rank {rank} (stage {stage}, TP rank {tp_rank})"
