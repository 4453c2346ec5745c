"""The process's memory as the operating system sees it: its resident set, which pages of a region are in RAM, and
handing memory the allocator keeps back to the system.

A server's tensors are allocated by torch through the C library's malloc. glibc keeps what is freed in its arenas
for reuse, and a thread's arena gives back only the free memory at its top: the temporaries of loading a model (the
checkpoint's float32 tensors cast to bf16, the linear weights before they were packed, the dense copies the
bf16_gemv copies were laid out from) stayed resident after load, 233 MiB of the default model's 1,376 MiB
(docs/architecture.md, "What a server holds"). `release_freed` gives them back once the models are up.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable, Iterable

import psutil

PAGE_BYTES = mmap.PAGESIZE
_RESIDENT_BIT = bytes(b & 1 for b in range(256))  # mincore's answer, a byte per page: its lowest bit says resident


def process_rss() -> int:
    """The process's resident set in bytes (every model, Python, the libraries' pages, what the allocator keeps)."""
    return int(psutil.Process().memory_info().rss)


def resident_bytes(regions: Iterable[tuple[int, int]]) -> int | None:
    """Bytes of these (address, bytes) regions of this process whose pages are in RAM now, or None where that
    cannot be told (no mincore, or a region not mapped). Memory allocated and never written takes no page: a K/V
    pool is allocated whole at start, its pages come as its slots are first written."""
    mincore = _libc_function("mincore")
    if mincore is None:
        return None
    total = 0
    for address, nbytes in regions:
        if nbytes <= 0:
            continue
        start = address - address % PAGE_BYTES
        length = address + nbytes - start
        vector = (ctypes.c_ubyte * -(-length // PAGE_BYTES))()
        if mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) != 0:
            return None
        pages = bytes(vector).translate(_RESIDENT_BIT).count(1)
        # the region's first and last pages may hold other memory too: count only its own bytes of them
        head, tail = address - start, -(address + nbytes) % PAGE_BYTES
        total += pages * PAGE_BYTES - head * (vector[0] & 1) - tail * (vector[-1] & 1)
    return total


def release_freed() -> bool:
    """Give the memory the C library's allocator keeps free back to the system (glibc's malloc_trim, every arena);
    False where there is no such call (another C library)."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True


def _libc_function(name: str) -> Callable[..., int] | None:
    """`name` from the C library the process runs on (None where it has no such function)."""
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    return function
