"""Model families on packed tokens, their loader, tokenizers and the built-in ``orca-tiny``.

The names below are imported on first use, so that importing a light module of this package
(``model.config``, ``model.builtin``, ``model.dtypes``) does not load the checkpoint readers
(gguf, safetensors) and the tokenizers."""
import importlib
from typing import Any

_HOMES = {
    "BUILTIN_MODELS": "builtin", "DTYPES": "dtypes", "resolve_dtype": "dtypes",
    "SUPPORTED_ARCHITECTURES": "config", "ModelConfig": "config",
    "AttentionMetadata": "layers", "Tokenizer": "tokenizer", "byte_level_tokenizer": "tokenizer",
    **{name: "loader" for name in ("LoadedModel", "ModelInfo", "build_model", "load_model",
                                   "load_model_info", "save_pretrained_folder")},
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
