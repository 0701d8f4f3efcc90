"""Imported first by ``orca_ext``: the compiled extension links the libtorch it was built
against, so under another torch it would fail to load with a bare loader error, or crash later;
this says so, and what to do, as an ImportError."""
import torch


def check_torch(built: str, running: str) -> None:
    if built != running:
        raise ImportError(
            f"orca_ext was built against torch {built}, but torch {running} is installed; its "
            f"compiled extension works only with the torch it was built against. Rebuild "
            f"orca_ext for this torch (in its source folder: pip install --no-deps "
            f"--force-reinstall .), or install torch=={built} again.")


try:
    from ._build_info import TORCH_VERSION
except ModuleNotFoundError:
    raise ImportError("orca_ext's compiled extension is not built, or was built by an older "
                      "version of orca_ext: build it (in its source folder: pip install .; in a "
                      "checkout: make setup)") from None
check_torch(TORCH_VERSION, torch.__version__)
