"""``EngineConfig``: everything that shapes an engine, validated once, in one place.

``LLM``, ``AsyncEngine.from_config``, ``orca-serve``, the distributed launcher and the benchmarks
all build one and pass it to ``build_engine`` (vLLM's ``EngineArgs`` in one dataclass).
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .model.builtin import DEFAULT_MODEL
from .model.dtypes import check_dtype, resolve_dtype
from .quantize import check_quantization
from .scheduler import SchedulerConfig
from .spec_decode import SpeculativeConfig

if TYPE_CHECKING:
    from .distributed import ParallelConfig
    from .model import LoadedModel


@dataclass
class EngineConfig:
    """``model``: a built-in name, a Hugging Face folder or a GGUF file, or a loaded model (with
    its own dtype and device). ``dtype="auto"`` is bfloat16 where the hardware has native
    bfloat16 matrix instructions, float32 elsewhere. ``max_model_len`` caps the model's context.
    Without a KV budget (``kv_cache_tokens`` or ``kv_cache_memory``, per worker when
    distributed), the cache holds ``max_batch_size`` full-context requests, capped by memory
    (``kv.plan_kv_blocks``). With ``tensor_parallel_size`` x ``pipeline_parallel_size`` > 1 (or a
    ``parallel_config``: more nodes, the stage-to-layer map, threads) the model runs on worker
    processes (``orca_ext.distributed``). ``enable_prefix_caching`` (None: on for the orca and
    paged policies, off for request, which cannot use it) reuses the KV of cached prompt
    prefixes. ``quantization`` (``model/quantized.py``): None runs a GGUF file in its stored
    formats, ``"none"`` dequantizes, ``"q8_0"`` / ``"q4_0"`` / ``"q4_1"`` quantize every linear
    weight at load (CPU, one process). ``speculative_config`` (vLLM's: a dict, its JSON text or a
    ``SpeculativeConfig``) turns on speculative decoding (``spec_decode``). ``kv_cache_dtype``
    (``kv.resolve_kv_cache_dtype``): ``"auto"`` keeps K/V in the activations' dtype, ``"int8"``
    stores them with a scale per token and KV head (CPU, one process), ``"fp8_e4m3"`` (or
    ``"fp8"``) as float8 e4m3 values (CUDA, one process), so the KV budget holds more tokens.
    ``enable_lora`` serves LoRA adapters (``lora/``): up to ``max_loras`` of them in one batch,
    of rank up to ``max_lora_rank``, and the tensors of ``max_cpu_loras`` (default
    ``max_loras``) kept on the CPU; distributed workers each keep their share of them.
    ``check_kv_writes`` (debugging) checks every batch's KV writes against its requests' blocks
    before it runs: a write into a cached, possibly shared block raises."""

    model: str | LoadedModel = DEFAULT_MODEL
    dtype: torch.dtype | str = "auto"
    device: str | None = None  # default: a loaded model's, else cuda when available, else cpu
    max_model_len: int | None = None
    max_batch_size: int = 32
    policy: str = "orca"
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_cache_memory: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    parallel_config: ParallelConfig | None = None
    enable_prefix_caching: bool | None = None
    quantization: str | None = None
    speculative_config: SpeculativeConfig | dict | str | None = None
    kv_cache_dtype: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    check_kv_writes: bool = False

    def __post_init__(self) -> None:
        if self.device is None and not isinstance(self.model, str):
            self.device = str(self.model.device)
        elif self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device: {self.device!r} is not a device ({exc})") from None
        self.device = str(device)
        in_process = self.parallel_config is None and \
            self.tensor_parallel_size * self.pipeline_parallel_size == 1
        if isinstance(self.model, str):
            if not in_process and self.quantization not in (None, "none"):
                raise ValueError(f"quantization: {self.quantization!r} runs in one process; "
                                 "distributed workers load float weights")
            check_quantization(self.quantization, device)
            self.dtype = check_dtype(self.dtype)  # "auto" is resolved at build (``resolved``)
            if self.quantization not in (None, "none") and self.dtype != "auto":
                resolve_dtype(self.dtype, device, quantized=True)  # refuses float16
        elif self.quantization is not None:
            raise ValueError(f"quantization: {self.quantization!r} asked for a loaded model; "
                             "pass quantization to load_model, or pass the model's name")
        elif self.dtype != "auto" and resolve_dtype(self.dtype, device) != self.model.dtype:
            raise ValueError(f"dtype: {self.dtype} asked for a model loaded in "
                             f"{self.model.dtype}; load it in that dtype, or pass its name")
        else:
            self.dtype = self.model.dtype
        for name in ("max_model_len", "kv_cache_tokens", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.kv_cache_tokens is not None and self.kv_cache_memory is not None:
            raise ValueError("give at most one of kv_cache_tokens and kv_cache_memory, got "
                             f"kv_cache_tokens={self.kv_cache_tokens}, "
                             f"kv_cache_memory={self.kv_cache_memory}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self._kv_dtype(torch.float32 if self.dtype == "auto" else self.dtype)  # a check
        if self.kv_cache_dtype != "auto" and not in_process:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} runs in one process; "
                             "distributed workers keep the activations' dtype")
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = self.policy != "request"
        self.parallel_config = _parallel_config(self.tensor_parallel_size,
                                                self.pipeline_parallel_size, self.parallel_config)
        if self.parallel_config is not None:
            self.tensor_parallel_size = self.parallel_config.tensor_parallel_size
            self.pipeline_parallel_size = self.parallel_config.pipeline_parallel_size
            if not isinstance(self.model, str):
                raise ValueError("model: distributed workers load the weights themselves; pass "
                                 "a built-in name or a model path, not a loaded model")
        self._check_lora()
        self.scheduler_config()  # checks the policy and its limits
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if (self.speculative_config is not None and self.parallel_config is not None
                and self.speculative_config.method == "draft_model"):
            raise ValueError("speculative_config.method 'draft_model' runs in one process; with "
                             "tensor or pipeline parallelism use method 'ngram'")

    def resolved(self) -> EngineConfig:
        """This config with its dtype resolved (``"auto"``; float16 refused for quantized
        kernels), which reads the model's files (is it a quantized GGUF file?) and the CPU's
        flags: ``build_engine`` calls it, so that the checks above do no I/O."""
        if not isinstance(self.model, str):
            return self  # a loaded model's own dtype
        from .model.loader import runs_quantized

        quantized = not self.distributed and runs_quantized(self.model, self.quantization,
                                                            self.device)
        dtype = resolve_dtype(self.dtype, self.device, quantized)
        return self if dtype == self.dtype else self.replace(dtype=dtype)

    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype (``kv_cache_dtype`` resolved for the model's dtype and device);
        on a ``resolved`` config."""
        if self.dtype == "auto":
            raise ValueError("kv_dtype: resolve the config's dtype first (EngineConfig.resolved)")
        return self._kv_dtype(self.dtype)

    def _kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        from .kv.cache import resolve_kv_cache_dtype

        return resolve_kv_cache_dtype(self.kv_cache_dtype, dtype, self.device)

    def _check_lora(self) -> None:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def distributed(self) -> bool:
        return self.parallel_config is not None

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.policy, self.max_batch_size, self.pipeline_parallel_size,
                               self.max_num_batched_tokens, bool(self.enable_prefix_caching),
                               self.prefix_cache_salt(),
                               self.max_loras if self.enable_lora else 0, self.check_kv_writes)

    def prefix_cache_salt(self) -> int:
        """The block hashes' extra key: a stable signed 64-bit digest of what, besides the
        tokens, decides their KV (the model, its dtype and quantization)."""
        if isinstance(self.model, str):
            what = f"{self.model}|{self.dtype}|{self.quantization}"
        else:
            what = f"{self.model.config!r}|{self.model.dtype}"
        if self.kv_cache_dtype != "auto":
            what += f"|kv {self.kv_cache_dtype}"
        digest = hashlib.blake2b(what.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def _parallel_config(tp: int, pp: int,
                     config: ParallelConfig | None) -> ParallelConfig | None:
    """The distributed layout asked for, or None for the in-process runner."""
    if config is None:
        if tp == 1 and pp == 1:
            return None
        from .distributed import ParallelConfig

        return ParallelConfig(tp, pp)
    if (tp, pp) not in ((1, 1), (config.tensor_parallel_size, config.pipeline_parallel_size)):
        raise ValueError(f"tensor_parallel_size / pipeline_parallel_size ({tp}, {pp}) disagree "
                         f"with parallel_config ({config.tensor_parallel_size}, "
                         f"{config.pipeline_parallel_size})")
    return config
