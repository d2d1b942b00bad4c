"""Memory for the step's output vector on CPU: recycled when free, else huge-page backed.

Each step returns an output vector the caller owns. A large CPU tensor is mapped fresh by the
allocator, and the first write to fresh memory costs one page fault per 4 KiB page: for 10^7
float32 parameters that is 10^4 faults (the kernel also zeroes every page), measured at about a
third of a whole step. Two remedies, in order:

- :class:`OutputVectors` keeps the last output of each dtype and hands it out again once nothing
  else references its memory: torch's count of references to the storage is exact (every
  tensor, view, ``detach()``, ``.numpy()`` array or storage object the caller keeps counts), so
  memory the caller still holds is never reused. In a training loop that drops the noisy
  gradients after the optimizer step, every step after the first writes into warm pages.
- Otherwise a new tensor, hinted to transparent huge pages (2 MiB: 20 faults instead of 10^4).
  ``torch`` does the same for all of its allocations when ``THP_MEM_ALLOC_ENABLE=1`` is set;
  this does it only for the engine's outputs. ``madvise(MADV_HUGEPAGE)`` changes only how the
  kernel backs the memory, never its contents, and is a no-op where transparent huge pages are
  disabled. Anything unexpected (not Linux, no libc, an error return) leaves the tensor as is.

GPU memory is already recycled by torch's caching allocator, so only CPU outputs are kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

__all__ = ["OutputVectors", "advise_huge_pages"]

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2**21
_PAGE = 4096


@functools.lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Hint huge pages for a new, untouched CPU tensor of at least two huge pages."""
    if tensor.device.type != "cpu" or tensor.nbytes < 2 * _HUGE_PAGE:
        return
    madvise = _madvise()
    if madvise is None:
        return
    start = tensor.data_ptr()
    end = start + tensor.nbytes
    aligned_start = -(-start // _PAGE) * _PAGE  # madvise needs a page-aligned start
    aligned_end = end // _PAGE * _PAGE
    if aligned_end > aligned_start:
        madvise(aligned_start, aligned_end - aligned_start, _MADV_HUGEPAGE)


def _storage_use_count():
    # torch's count of references to a storage (a private helper; absent: never recycle).
    return getattr(torch._C, "_storage_Use_Count", None)


class OutputVectors:
    """Hands out each step's output vector of a given dtype and length (see the module doc).

    The one vector per dtype it keeps between steps is the step's "one d-vector": while the
    caller holds the last output, the next step allocates a new one (and keeps that instead).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._recycle = self.device.type == "cpu" and _storage_use_count() is not None
        self._last: dict[torch.dtype, torch.Tensor] = {}

    def _unreferenced(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        try:
            # References: ``tensor`` (ours) and ``storage`` just taken; any more are the caller's.
            return _storage_use_count()(storage._cdata) == 2
        except (AttributeError, RuntimeError, TypeError):
            return False

    def get(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        last = self._last.get(dtype)
        if last is not None and last.numel() == numel and self._unreferenced(last):
            return last
        vector = torch.empty(numel, dtype=dtype, device=self.device)
        advise_huge_pages(vector)
        if self._recycle:
            self._last[dtype] = vector
        return vector
