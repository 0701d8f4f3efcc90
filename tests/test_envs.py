"""The runtime knobs: ``orca_ext.envs`` (the Python's variables, read when accessed) and the
kernels' ORCA_*_ISA variables (read once, at load, by csrc/envs.h: they seed
``orca_ext._C.get_isa``, which ``_C.set_isa`` changes)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orca_ext import envs
from orca_ext.model.builtin import cache_dir


def test_python_variables_are_read_when_accessed(monkeypatch, tmp_path):
    monkeypatch.delenv("ORCA_CUDA_GRAPHS", raising=False)
    assert envs.ORCA_CUDA_GRAPHS is True
    monkeypatch.setenv("ORCA_CUDA_GRAPHS", "0")
    assert envs.ORCA_CUDA_GRAPHS is False
    monkeypatch.setenv("ORCA_API_KEY", "secret")
    assert envs.ORCA_API_KEY == "secret"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "orca_ext"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert envs.XDG_CACHE_HOME == Path.home() / ".cache"
    with pytest.raises(AttributeError, match="has no attribute 'ORCA_NOPE'"):
        envs.ORCA_NOPE  # noqa: B018
    assert sorted(dir(envs)) == ["ORCA_API_KEY", "ORCA_CUDA_GRAPHS", "XDG_CACHE_HOME"]


def test_no_other_module_reads_a_variable():
    root = Path(envs.__file__).parent
    readers = [str(path.relative_to(root)) for path in sorted(root.rglob("*.py"))
               if path.name != "envs.py" and
               re.search(r"os\.environ\.get|os\.getenv|os\.environ\[", path.read_text())]
    assert readers == []


# In a process started with these variables: each kernel family's path as they say, a bad one
# refused (naming the variable) until set_isa replaces it, a later change to os.environ unseen.
SCRIPT = """
import os
import torch
from orca_ext import _C, ops
assert _C.get_isa("lora") == "portable" and _C.get_isa("attention") == "portable"
os.environ["ORCA_LORA_ISA"] = _C.lora_isas()[-1]
assert _C.get_isa("lora") == "portable"
q = torch.zeros(3, 34, dtype=torch.uint8)
for call in (lambda: _C.get_isa("quant"), lambda: ops.quantized_linear(torch.ones(1, 32), q,
                                                                       "q8_0", 32)):
    try:
        call()
    except (ValueError, RuntimeError) as e:
        assert "ORCA_QUANT_ISA must be one of 'portable', 'avx2'" in str(e), e
    else:
        raise AssertionError("a bad ORCA_QUANT_ISA was taken")
_C.set_isa("quant", "portable")
assert ops.quantized_linear(torch.ones(1, 32), q, "q8_0", 32).abs().sum() == 0
"""


def test_kernel_variables_are_read_once_at_load():
    env = {**os.environ, "ORCA_QUANT_ISA": "sse9", "ORCA_LORA_ISA": "portable",
           "ORCA_ATTENTION_ISA": "portable"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
