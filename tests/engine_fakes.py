"""Test doubles for the scheduler and engine: a pure-Python SlotAllocator, a model-free runner
that really stores and reads back KV, tokenizers, and the reference generation they imply."""
from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Sequence

import pytest

from orca_ext.batch import (NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput,
                          TokenLogprobs)
from orca_ext.model.builtin import BUILTIN_MODELS
from orca_ext.model.config import ModelConfig
from orca_ext.model.loader import ModelInfo
from orca_ext.runner.inputs import InputBatch


def fake_info(max_model_len: int, vocab_size: int = 256, tokenizer=None, eos_token_ids=(),
              chat_template: str | None = None, bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> ModelInfo:
    """The ``ModelInfo`` an Engine over a fake runner reads: orca-tiny's config with these
    limits, tokenizer, stop ids and chat template."""
    hf = {key: value for key, value in BUILTIN_MODELS["orca-tiny"].items()
          if key not in ("bos_token_id", "eos_token_id")}
    hf["vocab_size"] = vocab_size
    for key, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if value is not None:
            hf[key] = value
    return ModelInfo(ModelConfig.from_hf(hf), tokenizer, list(eos_token_ids), max_model_len,
                     chat_template)


class KVCacheFullError(RuntimeError):
    pass


class UnknownRequestError(KeyError):
    pass


class FakeSlotAllocator:
    """Same interface and semantics as ``orca_ext.kv.SlotAllocator`` (docs/internals.md)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self._num_blocks, self._block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._blocks: dict[int, list[int]] = {}

    num_blocks = property(lambda self: self._num_blocks)
    block_size = property(lambda self: self._block_size)
    num_free_blocks = property(lambda self: len(self._free))
    num_used_blocks = property(lambda self: self._num_blocks - len(self._free))
    num_requests = property(lambda self: len(self._blocks))

    def _need(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _get(self, request_id: int) -> list[int]:
        if request_id not in self._blocks:
            raise UnknownRequestError(request_id)
        return self._blocks[request_id]

    def can_allocate(self, num_tokens: int, prefix_hashes: Sequence[int] = ()) -> bool:
        self._no_prefix(prefix_hashes)
        return self._need(num_tokens) <= len(self._free)

    def allocate(self, request_id: int, num_tokens: int, prefix_hashes: Sequence[int] = ()) -> int:
        """As the real one, with no prefix cache: 0 cached tokens reused."""
        if request_id in self._blocks:
            raise ValueError(f"request {request_id} already holds blocks")
        if not self.can_allocate(num_tokens, prefix_hashes):
            raise KVCacheFullError(num_tokens)
        self._blocks[request_id] = [self._free.pop() for _ in range(self._need(num_tokens))]
        return 0

    @staticmethod
    def _no_prefix(prefix_hashes: Sequence[int]) -> None:
        if prefix_hashes:
            raise NotImplementedError(f"the fake allocator has no prefix cache, got "
                                      f"{len(prefix_hashes)} prefix hashes")

    def extend(self, request_id: int, total_tokens: int) -> None:
        blocks = self._get(request_id)
        more = self._need(total_tokens) - len(blocks)
        if more > len(self._free):
            raise KVCacheFullError(total_tokens)
        blocks.extend(self._free.pop() for _ in range(max(0, more)))

    def free(self, request_id: int) -> None:
        self._free.extend(self._get(request_id))
        del self._blocks[request_id]

    def capacity(self, request_id: int) -> int:
        return len(self._get(request_id)) * self._block_size

    def blocks(self, request_id: int) -> list[int]:
        return list(self._get(request_id))

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._blocks


def _real_allocator():
    kv = pytest.importorskip("orca_ext.kv", reason="C++ SlotAllocator not built")
    return kv.SlotAllocator


# Parametrize a test with ``allocator_cls`` over these: the fake, and the real one when built.
ALLOCATORS = [pytest.param(lambda: FakeSlotAllocator, id="fake"),
              pytest.param(_real_allocator, id="real")]


def next_token(context: list[int], vocab: int, seed: int = 0) -> int:
    """The fake model: a deterministic function of the whole context (never degenerate)."""
    return (sum(context) + 7 * len(context) + seed) % vocab


def reference(prompt: list[int], max_tokens: int, vocab: int, stop_ids=(), seed: int = 0
              ) -> list[int]:
    """What greedy generation must produce whatever the batching."""
    context, out = list(prompt), []
    while len(out) < max_tokens:
        token = next_token(context, vocab, seed)
        out.append(token)
        context.append(token)
        if token in stop_ids:
            break
    return out


class KVFakeRunner:
    """An executor that stores each token in its KV slot and computes the next token from the
    context it reads back through the block table: wrong block tables, positions or recompute
    after preemption give wrong tokens (and a clear assertion). Only the read-only cached
    prefix blocks (the allocator's ``shared_prefix_blocks``) may be held by two live requests,
    and no batch writes into them."""

    def __init__(self, allocator, vocab: int = 95) -> None:
        self.allocator = allocator
        self.vocab = vocab
        self.kv: dict[int, int] = {}
        self.batches: list[SchedulerOutput] = []
        # The real runner's copy of its requests, kept only from the scheduler's deltas.
        self.inputs = InputBatch(allocator.block_size)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.batches.append(out)
        reqs = out.requests
        inputs = self.inputs.prepare(out)
        meta = inputs.meta
        # Requests that ended since this batch was scheduled keep their state until the next
        # batch's finished_request_ids; they never run again, so only live ones are checked.
        live = [s for rid, s in self.inputs.requests.items() if rid in self.allocator]
        read_only = self.read_only_blocks()
        held = Counter(b for state in live for b in state.block_ids)
        shared = {b for b, count in held.items() if count > 1}
        assert shared <= read_only, f"two live requests hold writable KV blocks {shared}"
        written = {slot // self.allocator.block_size for slot in meta.slot_mapping.tolist()}
        assert not written & read_only, f"a batch writes cached KV blocks {written & read_only}"
        num_rows = [len(r.token_ids) + r.num_padding for r in reqs]
        expected_pos = [r.num_computed + i for r, n in zip(reqs, num_rows) for i in range(n)]
        assert inputs.positions.tolist() == expected_pos
        assert meta.cu_q_lens.tolist()[-1] == len(expected_pos)
        # Padding stores KV too, later overwritten.
        for token, slot in zip(inputs.input_ids.tolist(), meta.slot_mapping.tolist()):
            self.kv[slot] = token
        bs = self.allocator.block_size
        sampled_ids, sampled, logprobs = [], [], []
        for row, r in enumerate(reqs):
            if not r.sample:
                continue
            state = self.inputs.requests[r.request_id]
            n = int(meta.context_lens[row]) - r.num_padding  # up to the last real token
            blocks = meta.block_table[row].tolist()
            context = [self.kv[blocks[p // bs] * bs + p % bs] for p in range(n)]
            assert context == state.token_ids, f"bad KV for {r.request_id}"
            token = next_token(context, self.vocab, state.sampling_params.seed or 0)
            sampled_ids.append(r.request_id)
            sampled.append(token)
            k = state.sampling_params.logprobs
            logprobs.append(None if k is None else TokenLogprobs(
                -0.25, {(token + i) % self.vocab: -0.25 * (i + 1) for i in range(k)}))
        return RunnerOutput(out.batch_id, sampled_ids, sampled, logprobs)


    def read_only_blocks(self) -> set[int]:
        """The cached (hashed) prefix blocks of the requests the allocator still holds."""
        if not hasattr(self.allocator, "shared_prefix_blocks"):
            return set()
        return {b for rid, state in self.inputs.requests.items() if rid in self.allocator
                for b in state.block_ids[:self.allocator.shared_prefix_blocks(rid)]}


class PipelinedFakeExecutor:
    """submit/collect over a runner: batches queue up and run, in order, when collected."""

    def __init__(self, runner: KVFakeRunner) -> None:
        self.runner = runner
        self.queue: deque[SchedulerOutput] = deque()

    def submit(self, out: SchedulerOutput) -> None:
        self.queue.append(out)

    def collect(self) -> RunnerOutput:
        return self.runner.execute(self.queue.popleft())


class GatedRunner(KVFakeRunner):
    """Waits for ``gate`` before each batch (to hold a batch in flight, or to look stuck)."""

    def __init__(self, allocator, vocab: int = 95) -> None:
        super().__init__(allocator, vocab)
        self.gate = threading.Event()
        self.gate.set()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.gate.wait()
        return super().execute(out)


class CharTokenizer:
    """Token t is the printable ASCII character chr(32 + t) (vocab 95)."""

    vocab = 95

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(32 + t) for t in token_ids)


class ByteTokenizer:
    """Token t is byte t of the UTF-8 text, so characters may span tokens."""

    vocab = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode(errors="replace")


class ScriptedBatches:
    """Self-contained ``SchedulerOutput``s for driving a runner by hand, as the scheduler sends
    them: a request's data once, then the tokens to run and the blocks added since."""

    def __init__(self, allocator) -> None:
        self.allocator = allocator
        self.sent: dict[int, int] = {}  # request -> blocks the runner has been told of
        self.ended: list[int] = []
        self.batch_id = 0

    def free(self, request_id: int) -> None:
        self.allocator.free(request_id)
        self.sent.pop(request_id, None)
        self.ended.append(request_id)

    def batch(self, rows) -> SchedulerOutput:
        """``rows``: (request_id, token_ids, num_computed, params, num_prompt_tokens, sample)."""
        new, scheduled = [], []
        for request_id, token_ids, num_computed, params, num_prompt, sample in rows:
            if request_id not in self.sent:
                new.append(NewRequestData(request_id, num_prompt, params))
                self.sent[request_id] = 0
            blocks = self.allocator.blocks(request_id)
            scheduled.append(ScheduledRequest(request_id, list(token_ids), num_computed,
                                              blocks[self.sent[request_id]:], sample))
            self.sent[request_id] = len(blocks)
        out = SchedulerOutput(self.batch_id, scheduled, new, self.ended)
        self.batch_id += 1
        self.ended = []
        return out
