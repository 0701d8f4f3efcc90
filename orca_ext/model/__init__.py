"""Model families on packed tokens, their loader, tokenizers and the built-in ``orca-tiny``."""
from .builtin import BUILTIN_MODELS
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .layers import AttentionMetadata
from .loader import DTYPES, LoadedModel, build_model, load_model, resolve_dtype, save_pretrained_folder
from .tokenizer import Tokenizer, byte_level_tokenizer

__all__ = [
    "AttentionMetadata", "BUILTIN_MODELS", "DTYPES", "LoadedModel", "ModelConfig",
    "SUPPORTED_ARCHITECTURES", "Tokenizer", "build_model", "byte_level_tokenizer", "load_model",
    "resolve_dtype", "save_pretrained_folder",
]
