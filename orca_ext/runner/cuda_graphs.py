"""The model runner's CUDA-only parts: metadata uploads staged through pinned memory, and decode
iterations replayed from CUDA graphs captured per batch-size bucket.

A CPU tensor copied to the GPU with ``non_blocking=True`` from pageable memory is staged by the
driver and the call returns only when the copy is done; from pinned memory it is queued like a
kernel. ``PinnedUpload`` packs an iteration's metadata into one reused pinned buffer and sends it
in one transfer.

``DecodeGraphs`` follows nano-vllm's and vLLM's scheme: a decode iteration (one new token per
request, every request sampled) of ``n`` requests runs as the graph of the smallest bucket
``b >= n``, captured on first use, with requests ``n..b`` padded (no KV slot, context 0: their
rows attend to nothing and are dropped). The graphs read static input buffers, shared by all
buckets, that each step overwrites in place: token ids, positions, slots and contexts in one
transfer, and the used part of a block table padded to the graphs' longest context. The KV
split is chosen on the device from the actual contexts, so the padded table costs no
parallelism. Prompts, prompt chunks, larger batches and longer contexts run eagerly.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import envs
from ..model.layers import AttentionMetadata
from ..kv import KVCache

# (input_ids, positions, meta, sample_rows) -> float32 logits [len(sample_rows), vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]

# nano-vllm's buckets: small batches exactly, then every 16 up to 512.
DEFAULT_BUCKETS = (1, 2, 4, 8, *range(16, 513, 16))


def cuda_graphs_enabled(flag: bool | None) -> bool:
    """The runner's ``cuda_graphs`` argument; None: on unless ``ORCA_CUDA_GRAPHS=0``."""
    if flag is not None:
        return flag
    return envs.ORCA_CUDA_GRAPHS


def _aligned(n: int) -> int:
    return -(-n // 16) * 16


class PinnedUpload:
    """Sends CPU tensors to ``device`` in one transfer from a reused pinned buffer; returns the
    device tensors (views of one allocation)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.empty(0, dtype=torch.uint8)
        self.sent = torch.cuda.Event()  # the last transfer out of self.host

    def stage(self, nbytes: int) -> torch.Tensor:
        """The pinned buffer (at least ``nbytes``), once the previous transfer from it is done."""
        self.sent.synchronize()
        if self.host.numel() < nbytes:
            self.host = torch.empty(max(nbytes, 2 * self.host.numel(), 4096), dtype=torch.uint8,
                                    pin_memory=True)
        return self.host

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += _aligned(t.numel() * t.element_size())
        host = self.stage(total)
        for t, off in zip(tensors, offsets):
            host[off:off + t.numel() * t.element_size()].view(t.dtype).copy_(t.reshape(-1))
        dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        dev.copy_(host[:total], non_blocking=True)
        self.sent.record()
        return [dev[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for t, off in zip(tensors, offsets)]


class _Graph:
    """One bucket's captured decode iteration, the output it writes, and the inputs it reads
    that live nowhere else: replays read them at their captured addresses, so they must stay
    allocated (freed, the caching allocator hands their memory to other tensors)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor,
                 meta: AttentionMetadata, sample_rows: torch.Tensor) -> None:
        # meta also keeps what the warm-up run may have cached on it.
        self.graph, self.logits, self.meta, self.sample_rows = graph, logits, meta, sample_rows


class DecodeGraphs:
    """Decode iterations of up to ``max(buckets)`` requests whose contexts fit ``max_context``
    positions, replayed from one CUDA graph per bucket (captured on first use)."""

    def __init__(self, forward: Forward, kv_cache: KVCache, max_context: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be batch sizes >= 1, got {list(buckets)}")
        self.forward, self.kv_cache = forward, kv_cache
        self.buckets = sorted(set(buckets))
        self.max_batch = self.buckets[-1]
        self.block_size = kv_cache.block_size
        self.max_blocks = max(1, -(-max_context // self.block_size))
        self.max_context = self.max_blocks * self.block_size
        self.device = kv_cache.device
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        self.replays = 0
        # Static inputs of every bucket: ids, positions, slots (int64) and contexts (int32) of
        # bucket b in the first 28 b bytes of `meta`, and rows 0..b of `table`.
        self.meta = torch.zeros(28 * self.max_batch, dtype=torch.uint8, device=self.device)
        self.table = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int32,
                                 device=self.device)
        self.upload = PinnedUpload(self.device)

    def bucket(self, num_requests: int, longest_context: int) -> int | None:
        """The bucket a decode iteration runs in, or None (run it eagerly)."""
        if num_requests > self.max_batch or longest_context > self.max_context:
            return None
        return next(b for b in self.buckets if b >= num_requests)

    def _views(self, b: int, meta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Bucket b's ids, positions, slots, contexts within a 28 b-byte meta buffer."""
        i64 = meta[:24 * b].view(torch.int64)
        return i64[:b], i64[b:2 * b], i64[2 * b:3 * b], meta[24 * b:28 * b].view(torch.int32)

    def _capture(self, b: int) -> _Graph:
        ids, positions, slots, context_lens = self._views(b, self.meta)
        # Padding everywhere while warming up and capturing: no KV slot is written.
        ids.zero_()
        positions.zero_()
        slots.fill_(-1)
        context_lens.zero_()
        cu_q_lens = torch.arange(b + 1, dtype=torch.int32, device=self.device)
        sample_rows = torch.arange(b, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(cu_q_lens, context_lens, self.table[:b], slots)

        def run() -> torch.Tensor:
            return self.forward(ids, positions, meta, sample_rows)

        # One eager run first (cuBLASLt algorithms, kernel attributes), on a side stream as
        # torch's CUDA-graph notes advise.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = run()
        self.pool = graph.pool()
        entry = self.graphs[b] = _Graph(graph, logits, meta, sample_rows)
        return entry

    def run(self, b: int, input_ids: torch.Tensor, positions: torch.Tensor,
            slot_mapping: torch.Tensor, context_lens: torch.Tensor,
            block_table: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode iteration of ``n`` requests (CPU metadata as
        ``SlotAllocator.build_metadata`` gives it) in bucket ``b``. They are a view of the
        graph's output, valid until the next replay."""
        entry = self.graphs.get(b) or self._capture(b)
        n, width = block_table.shape
        meta_bytes, table_bytes = 28 * b, 4 * n * width
        host = self.upload.stage(_aligned(meta_bytes) + table_bytes)
        ids, pos, slots, ctx = self._views(b, host[:meta_bytes])
        ids[:n].copy_(input_ids)
        ids[n:].zero_()
        pos[:n].copy_(positions)
        pos[n:].zero_()
        slots[:n].copy_(slot_mapping)
        slots[n:].fill_(-1)
        ctx[:n].copy_(context_lens)
        ctx[n:].zero_()
        self.meta[:meta_bytes].copy_(host[:meta_bytes], non_blocking=True)
        if table_bytes:
            start = _aligned(meta_bytes)
            staged = host[start:start + table_bytes].view(torch.int32).view(n, width)
            staged.copy_(block_table)
            # Columns past `width` keep stale ids: no context reaches them.
            self.table[:n, :width].copy_(staged, non_blocking=True)
        self.upload.sent.record()
        entry.graph.replay()
        self.replays += 1
        return entry.logits[:n]
