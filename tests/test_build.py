"""The one build path: ``import orca_ext`` stays light, the package has no import cycles,
``EngineConfig`` checks its values without reading files, and ``build_engine`` gives an engine
whose ``info`` describes the model."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orca_ext import EngineConfig, build_engine
from orca_ext.model import dtypes

PACKAGE = Path(__file__).resolve().parents[1] / "orca_ext"
# What only loading a model needs (numpy is not listed: torch itself imports it).
HEAVY = ("gguf", "tokenizers", "safetensors", "transformers")


def test_import_orca_ext_is_light():
    code = (f"import sys, orca_ext\n"
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.split() == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_at_load(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports when it is loaded (not inside functions, nor
    under ``if TYPE_CHECKING``), each with the packages above it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for child in ast.walk(node) if not isinstance(node, ast.FunctionDef | ast.ClassDef) \
                else ():
            targets: list[str] = []
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [base, *(f"{base}.{alias.name}" for alias in child.names)]
            elif isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            for target in targets:
                while target:
                    if target in modules:
                        found.add(target)
                    target = target.rpartition(".")[0]
    # A module's own packages are being imported already: not edges of a cycle.
    ancestors = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
    return found - ancestors


def test_the_package_has_no_import_cycles():
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imports_at_load(path, name, set(paths)) for name, path in paths.items()}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert cycles == []


def test_engine_config_reads_no_files(monkeypatch, tmp_path):
    def no_io(*args, **kwargs):
        raise AssertionError("EngineConfig read a file")

    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", no_io)
    monkeypatch.setattr(Path, "is_file", no_io)
    monkeypatch.setattr(Path, "is_dir", no_io)
    config = EngineConfig(str(tmp_path / "model"), device="cpu", quantization="none")
    assert config.dtype == "auto"  # resolved at build
    assert EngineConfig("orca-tiny", device="cpu", dtype="bfloat16").dtype == torch.bfloat16


def test_a_bad_model_path_is_a_value_error_at_build(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    config = EngineConfig(str(tmp_path), device="cpu")  # checked without reading the folder
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)"):
        build_engine(config)


def test_build_engine_gives_the_models_description():
    engine = build_engine(EngineConfig("orca-tiny", device="cpu", dtype="float32",
                                       max_model_len=100, kv_cache_tokens=256))
    info = engine.info
    assert (info.max_model_len, info.vocab_size, info.config.architecture) == \
        (100, 257, "GPT2LMHeadModel")
    assert info.tokenizer.decode(info.tokenizer.encode("hi")) == "hi"
    assert engine.executor.model.lm_head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="max_model_len 2000 is longer than the model's "
                                         r"context \(1024 tokens\)"):
        build_engine(EngineConfig("orca-tiny", device="cpu", max_model_len=2000))
