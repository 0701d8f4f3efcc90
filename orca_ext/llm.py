"""Offline generation, mirroring vLLM's ``LLM``."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from .engine import Engine
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .scheduler import SchedulerConfig, make_scheduler

if TYPE_CHECKING:
    from .distributed import ParallelConfig
    from .model import LoadedModel

_log = logging.getLogger(__name__)
Prompt = str | list[int]


def build_engine(model: str | LoadedModel, *, dtype: torch.dtype | str = "auto",
                 device: torch.device | str | None = None, max_batch_size: int = 32,
                 kv_cache_tokens: int | None = None, kv_cache_memory: int | None = None,
                 block_size: int = 16, policy: str = "orca",
                 max_num_batched_tokens: int | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1,
                 parallel_config: ParallelConfig | None = None) -> Engine:
    """Load ``model`` (a built-in name, a Hugging Face folder or a GGUF file; or take a loaded
    one, with its own dtype and device) and wire allocator, KV cache, runner and scheduler into an
    Engine. ``dtype="auto"`` is bfloat16 where the hardware has native bfloat16 matrix
    instructions, float32 elsewhere. Without a KV budget, the cache holds ``max_batch_size``
    full-context requests, capped by memory (``plan_kv_blocks``).

    With ``tensor_parallel_size`` x ``pipeline_parallel_size`` > 1 (or a ``parallel_config``, for
    more nodes, the stage-to-layer map, threads), the model runs on worker processes that this
    call starts (see ``orca_ext.distributed``); ``Engine.shutdown`` stops them."""
    # Imported here so that ``import orca_ext`` stays light.
    from .executor import KVCache, ModelRunner
    from .executor.kv_cache import kv_bytes_per_block, plan_kv_blocks
    from .kv import SlotAllocator
    from .model import load_model

    parallel = _parallel_config(tensor_parallel_size, pipeline_parallel_size, parallel_config)
    if parallel is not None:
        from .distributed import build_distributed_engine

        return build_distributed_engine(
            model, parallel, dtype=dtype, device=device, max_batch_size=max_batch_size,
            kv_cache_tokens=kv_cache_tokens, kv_cache_memory=kv_cache_memory,
            block_size=block_size, policy=policy, max_num_batched_tokens=max_num_batched_tokens)
    config = SchedulerConfig(policy, max_batch_size, 1, max_num_batched_tokens)
    if isinstance(model, str):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded = load_model(model, dtype, device)
    else:
        loaded = model
    num_blocks, why = plan_kv_blocks(loaded.config, block_size, loaded.dtype, loaded.device,
                                     max_batch_size, loaded.max_model_len, kv_cache_tokens,
                                     kv_cache_memory)
    _log.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB: %s", num_blocks,
              block_size, num_blocks * block_size,
              num_blocks * kv_bytes_per_block(loaded.config, block_size, loaded.dtype) / 2**30,
              why)
    allocator = SlotAllocator(num_blocks, block_size)
    kv_cache = KVCache(loaded.config, num_blocks, block_size, loaded.dtype, loaded.device)
    runner = ModelRunner(loaded.model, kv_cache, allocator)
    return Engine(runner, make_scheduler(config, allocator), max_model_len=loaded.max_model_len,
                  tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids,
                  vocab_size=loaded.config.vocab_size, chat_template=loaded.chat_template,
                  bos_token_id=loaded.config.bos_token_id)


class LLM:
    """``LLM(model=...).generate(prompts, params)``: every prompt arrives at once and the engine
    runs until all have finished. Arguments are those of ``build_engine``."""

    def __init__(self, model: str | LoadedModel, dtype: torch.dtype | str = "auto",
                 max_batch_size: int = 32, kv_cache_tokens: int | None = None,
                 kv_cache_memory: int | None = None, block_size: int = 16, policy: str = "orca",
                 max_num_batched_tokens: int | None = None,
                 device: torch.device | str | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1,
                 parallel_config: ParallelConfig | None = None) -> None:
        self.engine = build_engine(
            model, dtype=dtype, device=device, max_batch_size=max_batch_size,
            kv_cache_tokens=kv_cache_tokens, kv_cache_memory=kv_cache_memory,
            block_size=block_size, policy=policy, max_num_batched_tokens=max_num_batched_tokens,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, parallel_config=parallel_config)
        self._next_id = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if it has any (also done at exit)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids); outputs in input order."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} "
                                 "prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(str(next(self._next_id)))
                self.engine.add_request(ids[-1], prompt, p, stream=False)
        except Exception:
            for request_id in ids:  # all or nothing
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate a reply to each conversation (a list of ``{"role", "content"}`` messages, or
        a list of such lists), rendered with the model's chat template (or a plain
        "role: content" one for a model without)."""
        from .server.chat import ChatTemplate

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        engine = self.engine
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a model with a tokenizer")

        def token(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.inner.id_to_token(token_id)

        eos = min(engine.eos_token_ids) if engine.eos_token_ids else None
        template = ChatTemplate(engine.chat_template, bos_token=token(engine.bos_token_id),
                                eos_token=token(eos))
        prompts = [tokenizer.encode(template.render(list(c)), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        start, num_tokens = time.perf_counter(), 0
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    done[output.request_id] = output
                    num_tokens += sum(len(o.token_ids) for o in output.outputs)
                    bar.update(1)
                    bar.set_postfix_str(
                        f"output {num_tokens / (time.perf_counter() - start):.1f} tok/s")
        return [done[request_id] for request_id in ids]


def _parallel_config(tp: int, pp: int,
                     config: ParallelConfig | None) -> ParallelConfig | None:
    """The distributed layout asked for, or None for the in-process runner."""
    if config is None:
        if tp == 1 and pp == 1:
            return None
        from .distributed import ParallelConfig

        config = ParallelConfig(tp, pp)
    elif (tp, pp) not in ((1, 1), (config.tensor_parallel_size, config.pipeline_parallel_size)):
        raise ValueError("tensor_parallel_size / pipeline_parallel_size disagree with "
                         "parallel_config")
    return config


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
