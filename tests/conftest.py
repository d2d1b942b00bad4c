"""Shared pytest configuration.

* tests/ is on sys.path, so the shared helpers that live here (dense.py, engine_support.py,
  spawn_support.py, the *_support.py and *_workers.py modules) import by their bare names from
  any folder below, and in the processes the tests spawn (which inherit sys.path). Test modules
  themselves are imported with ``--import-mode=importlib`` (pyproject.toml), so that files with
  the same name in different folders (tests/accounting/test_gaussian.py,
  tests/dpftrl/accounting/test_gaussian.py) do not clash; they are never imported by other tests.
* One deterministic hypothesis profile for the whole suite.
* Under pytest-xdist (``make test``: ``-n 2 --dist loadfile``): one thread per worker, for torch and
  BLAS (two workers on two cores), and the modules holding slow tests handed out first, so that the last
  file to finish is a short one.
"""

import os
import sys
from pathlib import Path

from hypothesis import settings

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

settings.register_profile("opake", derandomize=True, max_examples=50, deadline=None, print_blob=True)
settings.load_profile("opake")


def _xdist_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def pytest_configure(config):
    if _xdist_worker():
        import threadpoolctl
        import torch

        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[name] = "1"            # and in the processes a test starts
        torch.set_num_threads(1)
        threadpoolctl.threadpool_limits(1)    # numpy's BLAS, loaded before this hook


def pytest_collection_modifyitems(config, items):
    """Under xdist, modules with a test marked slow go first (stable order otherwise): with
    ``--dist loadfile --no-loadscope-reorder`` each worker takes the next module as it frees up."""
    if not _xdist_worker():
        return
    slow_modules = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_modules)
