"""The process's memory as the OS sees it: which pages of a region are in RAM, the allocator's free memory."""

from __future__ import annotations

import sys

import pytest
import torch

from server import memory

MIB = 1 << 20
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and malloc_trim as Linux has them")


@linux
def test_a_regions_resident_bytes_are_those_of_its_pages_written_so_far():
    """64 MiB is past glibc's largest mmap threshold: a mapping of its own, whose pages come as they are written."""
    region = torch.empty(64 * MIB, dtype=torch.uint8)
    where = [(region.data_ptr(), region.untyped_storage().nbytes())]
    before = memory.resident_bytes(where)
    assert before is not None
    assert before < 4 * MIB  # the allocator's header shares the first page (a huge page where the system makes them)
    region[: 16 * MIB].fill_(1)
    written = memory.resident_bytes(where)
    assert written is not None
    assert 16 * MIB <= written <= 16 * MIB + before + 2 * MIB  # a huge page around the end is in RAM whole
    region.fill_(2)
    assert memory.resident_bytes(where) == 64 * MIB


@linux
def test_a_region_counts_only_its_own_bytes_of_the_pages_it_shares():
    page = memory.PAGE_BYTES
    block = torch.ones(4 * page, dtype=torch.uint8)  # written: every page in RAM
    start = block.data_ptr()
    assert memory.resident_bytes([(start + 10, 100)]) == 100
    assert memory.resident_bytes([(start + page - 7, 14)]) == 14  # across a page boundary
    assert memory.resident_bytes([(start + 10, 100), (start + 2 * page, page)]) == 100 + page
    assert memory.resident_bytes([]) == 0


@linux
def test_a_region_not_mapped_cannot_be_told():
    assert memory.resident_bytes([(0, memory.PAGE_BYTES)]) is None


@linux
def test_the_allocators_free_memory_goes_back_and_the_process_says_so():
    """Tensors freed below one still held stay in the allocator's arena, in RAM, until given back."""
    held = [torch.ones(64 << 10, dtype=torch.uint8) for _ in range(1024)]  # 64 MiB of 64 KiB: from the arena
    fence = torch.ones(64 << 10, dtype=torch.uint8)  # above them: the arena cannot shrink from its top
    del held
    before = memory.process_rss()
    assert memory.release_freed()
    after = memory.process_rss()
    assert before - after >= 32 * MIB, (before, after)
    del fence
