"""orca_ext: an Orca-style LLM serving engine built on PyTorch custom ops."""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _build_check  # noqa: F401  (before _C: is this the torch it was built against?)
from . import _C, ops  # noqa: F401  (registers torch.ops.orca)
from .async_engine import AsyncEngine, EngineDeadError
from .build import build_engine
from .config import EngineConfig
from .llm import LLM
from .lora import LoRARequest
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def has_cuda() -> bool:
    """Whether this build of the extension contains the CUDA kernels."""
    return _C.has_cuda()


__all__ = ["AsyncEngine", "CompletionOutput", "EngineConfig", "EngineDeadError", "LLM", "LoRARequest",
           "RequestOutput", "SamplingParams", "StructuredOutputsParams", "__version__",
           "build_engine", "has_cuda", "ops"]
