"""Model families on packed tokens, their loader, tokenizers and the built-in ``orca-tiny``."""
from .builtin import BUILTIN_MODELS
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .layers import AttentionMetadata
from .loader import (DTYPES, LoadedModel, ModelInfo, build_model, load_model, load_model_info,
                     resolve_dtype, save_pretrained_folder)
from .tokenizer import Tokenizer, byte_level_tokenizer

__all__ = [
    "AttentionMetadata", "BUILTIN_MODELS", "DTYPES", "LoadedModel", "ModelConfig", "ModelInfo",
    "SUPPORTED_ARCHITECTURES", "Tokenizer", "build_model", "byte_level_tokenizer", "load_model",
    "load_model_info", "resolve_dtype", "save_pretrained_folder",
]
