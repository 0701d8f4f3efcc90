"""Distributed execution (Orca's intra- and inter-layer parallelism) on torch.distributed.

``build_engine`` (``LLM``, ``orca-serve`` with ``tensor_parallel_size`` /
``pipeline_parallel_size``) starts ``tp x pp`` worker processes: each holds one pipeline stage's
layers and one tensor-parallel shard of them, loaded straight from the checkpoint. This process
(the driver) keeps the scheduler and sends each batch's ``SchedulerOutput`` down the pipeline;
``run_node`` runs the workers of another node. See docs/distributed.md.
"""
from .config import ParallelConfig
from .executor import DistributedExecutor, WorkerError
from .launcher import run_node

__all__ = ["DistributedExecutor", "ParallelConfig", "WorkerError", "run_node"]
