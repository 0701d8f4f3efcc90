import pytest
import torch

import orca_ext

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() and orca_ext.has_cuda()),
        reason="needs a GPU and a CUDA build of orca_ext")),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """Tiny batches gain nothing from threads, and spinning ones crawl on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
