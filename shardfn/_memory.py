"""Host memory: transparent huge pages for the large buffers shardfn allocates on every step.

Note [huge pages]
-----------------
The unit buffers of Note [slot arenas] and the gradient shards are given back to the system between
uses (the FSDP paper's free), and allocated again when next needed. On Linux, a fresh allocation
is mapped page by page as it is first written: a 16 MB buffer is 4096 page faults, which cost more
than the copy that fills it, and they come back on every step. Asking the kernel for transparent
huge pages (`madvise(MADV_HUGEPAGE)`) on such a buffer right after it is allocated, before it is
touched, maps it 2 MB at a time, with a few hundred times fewer faults (`benchmarks/README.md` has
the figures). Memory use is the same (the buffers are written whole), and it is still returned to
the system when freed. The invariant (Note [freed memory] in `_debug.py`): the advice covers only
the 2 MB-aligned inside of a storage just allocated, before anything is written to it, and
`MADV_HUGEPAGE` keeps contents (it is not `MADV_DONTNEED`), so no tensor, a neighbour's included,
can see it; debug mode checks the range.

It applies where the kernel allows it: `/sys/kernel/mm/transparent_hugepage/enabled` set to
`madvise` or `always` (with `always` it is the default anyway); elsewhere (`never`, other systems,
no libc) it does nothing. PyTorch's own allocator does the same for every tensor of 2 MB or more
when `THP_MEM_ALLOC_ENABLE=1` is set in the environment.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from . import _debug

__all__ = ["huge_pages", "HUGE_PAGES"]

HUGE_PAGES = True
"""Advise transparent huge pages on large host buffers (see Note [huge pages])."""

_HUGE = 2 << 20
_MIN_BYTES = 2 * _HUGE  # smaller buffers would have at most one aligned huge page inside
_MADV_HUGEPAGE = 14
_madvise: list = []  # [function] once found, [None] when unavailable


def _find_madvise():
    if not _madvise:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _madvise.append(fn)
    return _madvise[0]


def huge_pages(storage: torch.UntypedStorage) -> None:
    """Advises huge pages on the 2 MB-aligned inside of a freshly allocated host storage."""
    n = storage.nbytes()
    if not HUGE_PAGES or n < _MIN_BYTES or storage.device.type != "cpu":
        return
    madvise = _find_madvise()
    if madvise is None:
        return
    ptr = storage.data_ptr()
    lo = -(-ptr // _HUGE) * _HUGE
    hi = (ptr + n) // _HUGE * _HUGE
    if _debug.ON:  # Note [freed memory] 5 in `_debug.py`: the advice stays inside this storage
        _debug.check_advice(storage, lo, hi)
    if hi > lo and madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        _madvise[0] = None  # not allowed here (e.g. THP disabled): stop asking
