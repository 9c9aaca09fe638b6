"""CPU tensors on transparent huge pages: the packed weights (``relocate``) and KV pools (``zeros``)
a decode step streams cold once a step, on mappings aligned to 2 MiB and advised ``MADV_HUGEPAGE``.
With THP in ``madvise`` mode torch's own allocations get 4 KiB pages: a TLB miss per page and
prefetchers stopped at each boundary (figures: docs/engine.md). ``THP_MEM_ALLOC_ENABLE`` would do
it for every tensor, small ones too. THP off or not Linux: plain ``torch.empty``/``zeros``.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Sequence
from pathlib import Path

import torch

#: The huge page size the mappings are aligned to (x86-64's and AArch64's PMD page).
HUGE_PAGE_BYTES = 2 << 20
#: The base page size: touching one byte in each maps a whole mapping, whatever pages back it.
SMALL_PAGE_BYTES = mmap.PAGESIZE
#: Alignment of each tensor within a shared mapping: a cache line, and the kernels' vector.
TENSOR_ALIGN_BYTES = 64
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def available() -> bool:
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in setting or "[madvise]" in setting)


def empty_bytes(nbytes: int) -> torch.Tensor:
    """A 2 MiB-aligned uint8 tensor on a mapping advised for huge pages (zero: fresh anonymous memory)."""
    if not available() or nbytes <= 0:
        return torch.empty(max(nbytes, 0), dtype=torch.uint8)
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES + HUGE_PAGE_BYTES   # room to align
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)   # keeps the mapping alive while in use
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES
    region.madvise(mmap.MADV_HUGEPAGE, offset, size - offset)
    return whole[offset:offset + nbytes]


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros`` on huge pages, every page faulted in now so no step pays a first touch."""
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if not available() or numel * itemsize < HUGE_PAGE_BYTES:
        return torch.zeros(tuple(shape), dtype=dtype)
    memory = empty_bytes(numel * itemsize)
    # Fresh pages are zero already: a write a small page apart maps them, where zero_() clears again.
    memory[::SMALL_PAGE_BYTES] = 0
    return memory.view(dtype).view(tuple(shape))


def relocate(tensors: Sequence[torch.Tensor]) -> int:
    """Move the tensors onto one huge-page mapping in place (``set_``: every holder sees it); returns
    the bytes moved, 0 where huge pages are unavailable or the tensors are smaller than one."""
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"relocate: a {t.device} tensor of shape {tuple(t.shape)} and strides "
                             f"{t.stride()} is not a contiguous CPU tensor")
        total = -(-total // TENSOR_ALIGN_BYTES) * TENSOR_ALIGN_BYTES
        offsets.append(total)
        total += t.numel() * t.element_size()
    if not available() or total < HUGE_PAGE_BYTES:
        return 0
    arena = empty_bytes(total)
    with torch.no_grad():
        for t, at in zip(tensors, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            view = arena[at:at + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    return total
