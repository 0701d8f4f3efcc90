"""Offline generation, mirroring vLLM's ``LLM``."""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from .build import build_engine
from .chat import ChatTemplate
from .config import EngineConfig
from .engine import PromptError
from .lora.request import LoRARequest
from .model.builtin import DEFAULT_MODEL
from .outputs import RequestOutput
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .model import LoadedModel

# Text, token ids, or vLLM's TextPrompt / TokensPrompt dicts of them.
Prompt = str | list[int] | dict[str, Any]


class LLM:
    """``LLM(model=...).generate(prompts, params)``: every prompt arrives at once and the engine
    runs until all have finished. The keyword arguments are ``EngineConfig``'s (or pass one as
    ``config``)."""

    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, *,
                 config: EngineConfig | None = None, **engine_args: Any) -> None:
        if config is None:
            config = EngineConfig(model, **engine_args)
        elif engine_args or model is not DEFAULT_MODEL:
            raise ValueError("give either config or model and EngineConfig's keyword arguments")
        self.engine = build_engine(config)
        self._next_id = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if it has any (also done at exit)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.info.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text, a list of token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``); outputs in input order.
        ``lora_request``: one LoRA adapter for every prompt, or one (or None: the base) per
        prompt. ``max_tokens`` None generates up to the context; a prompt plus ``max_tokens``
        longer than the context is a ValueError naming both (``Engine.prepare``)."""
        return self._generate(_prompt_list(prompts), sampling_params, use_tqdm, lora_request)

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Generate a reply to each conversation (a list of ``{"role", "content"}`` messages, or
        a list of such lists), rendered with ``chat_template`` (a Jinja template's text) or else
        the model's own; ValueError when the model has none and none is given."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.engine.info.tokenizer is None:
            raise ValueError("chat needs a model with a tokenizer")
        template = None if chat_template is None else \
            ChatTemplate.for_model(self.engine.info, chat_template)
        return self._generate([list(c) for c in conversations], sampling_params, use_tqdm,
                              chat_template=template)

    def _generate(self, prompts: list[Prompt | list[dict[str, Any]]],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: bool,
                  lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                  chat_template: ChatTemplate | None = None) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} "
                                 "prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        # Every prompt checked before any runs: all or nothing.
        prepared = [self.engine.prepare(prompt, p, chat_template=chat_template)
                    for prompt, p in zip(prompts, params)]
        ids: list[str] = []
        try:
            for prompt, lora in zip(prepared, loras):
                ids.append(str(next(self._next_id)))
                self.engine.add_request(ids[-1], prompt, stream=False, lora_request=lora)
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        start, num_tokens = time.perf_counter(), 0
        with (tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar,
              torch.inference_mode()):
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    done[output.request_id] = output
                    num_tokens += sum(len(o.token_ids) for o in output.outputs)
                    bar.update(1)
                    bar.set_postfix_str(
                        f"output {num_tokens / (time.perf_counter() - start):.1f} tok/s")
        return [done[request_id] for request_id in ids]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return [_unwrapped(prompt) for prompt in prompts]


def _unwrapped(prompt: Prompt) -> str | list[int]:
    """vLLM's ``TextPrompt`` (``{"prompt": text}``) as its text and ``TokensPrompt``
    (``{"prompt_token_ids": ids}``) as its ids; other prompts as given."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"}:
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"])
    raise PromptError("a prompt dict holds one key, 'prompt' (text) or 'prompt_token_ids' "
                      f"(token ids), got keys {sorted(prompt)}", "prompt")
