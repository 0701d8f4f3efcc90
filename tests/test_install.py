"""docs/install.md's pip lines in a fresh venv, with pip's default build isolation: without torch
the build stops at once saying what to run; with torch 2.13.0 installed, ``pip install .`` and
``pip install -e .`` build against it and ``import orca_ext`` runs an op; under another torch
the import is an ImportError naming both versions and the fix. Slow (two builds of the
extension in a copy of this source tree, a few minutes on 2 cores); and the version check
itself."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the Makefile's TORCH_SPEC (the CPU build)
OP_CALL = """
import torch, orca_ext
x, w = torch.randn(3, 8), torch.randn(5, 8)
torch.testing.assert_close(torch.ops.orca.packed_linear(x, w, None, "none"), x @ w.T)
print("op ok", orca_ext.__file__)
"""


def copy_source(dest: Path) -> Path:
    """The working tree's files as git sees them (tracked, or new and not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def run(*args: str | Path, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_readme_pip_lines_in_a_fresh_venv(tmp_path: Path) -> None:
    check_install(copy_source(tmp_path / "orca_ext"), tmp_path)


def check_install(source: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pip = (python, "-m", "pip", "install", "--quiet")

    # No torch yet: the build stops in CMake's configure step (no compiling), saying what to run.
    started = time.monotonic()
    failed = run(*pip, "--no-deps", ".", cwd=source)
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0, output
    assert "cannot import torch in the Python environment being built for" in output, output
    assert "pip install torch==2.13.0" in output and "Building CXX" not in output
    assert time.monotonic() - started < 300

    installed = run(*pip, TORCH, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    for line in (".", "-e ."):  # docs/install.md's lines: the build finds the torch just installed
        built = run(*pip, *line.split(), cwd=source)
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        imported = run(python, "-c", OP_CALL, cwd=tmp_path)
        assert imported.returncode == 0, imported.stderr
        assert imported.stdout.startswith("op ok")
        editable = str(source) in imported.stdout
        assert editable == (line == "-e ."), imported.stdout

    # Another torch under the same build: the version torch reports is all the check reads.
    (version_file,) = (env_dir / "lib").glob("python3*/site-packages/torch/version.py")
    text = version_file.read_text()
    built_version = re.search(r"__version__\s*(?::\s*str\s*)?=\s*'([^']+)'", text).group(1)
    version_file.write_text(text.replace(f"'{built_version}'", "'2.99.0+cpu'"))
    mismatched = run(python, "-c", "import orca_ext", cwd=tmp_path)
    assert mismatched.returncode != 0
    assert (f"ImportError: orca_ext was built against torch {built_version}, but torch "
            f"2.99.0+cpu is installed") in mismatched.stderr, mismatched.stderr
    assert "pip install --no-deps --force-reinstall ." in mismatched.stderr
    assert f"install torch=={built_version} again" in mismatched.stderr


def test_version_check_names_both_versions_and_the_fix() -> None:
    from orca_ext._build_check import check_torch

    check_torch("2.13.0+cpu", "2.13.0+cpu")
    with pytest.raises(ImportError, match=r"built against torch 2\.13\.0\+cpu, but torch "
                                          r"2\.14\.1\+cu130 is installed.*pip install --no-deps "
                                          r"--force-reinstall \..*torch==2\.13\.0\+cpu"):
        check_torch("2.13.0+cpu", "2.14.1+cu130")
    import torch
    from orca_ext import _build_info

    assert _build_info.TORCH_VERSION == torch.__version__  # what this build recorded
