from contextlib import ExitStack

import pytest
import torch

import orca_ext
from orca_ext.testing import forced_isa

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() and orca_ext.has_cuda()),
        reason="needs a GPU and a CUDA build of orca_ext")),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def force_isa():
    """force_isa(kind, name): kernels of kind 'quant' / 'attention' / 'lora' on path name for
    the rest of the test (``orca_ext._C.set_isa``; the default comes back after it)."""
    with ExitStack() as stack:
        yield lambda kind, name: stack.enter_context(forced_isa(kind, name))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny batches gain nothing from threads, and spinning ones crawl on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    """transformers' own float32 load of the test module's ``gguf_path`` fixture (a real GGUF
    file): the reference for our load of the same file."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
