"""The tests of opake.transformers: one torch thread and quiet transformers logs in each test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Seconds, not minutes, on a shared 2-core machine; also keeps float sums in one order."""
    transformers = pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)
