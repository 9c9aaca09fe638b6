"""CPU tensors on transparent huge pages: the memory a decode step streams once a step.

Owns where the CPU step's large, long-lived tensors live: the packed linear weights (moved
there in place once packed, ``relocate``) and the KV pools (``zeros``). Each goes on an
anonymous mapping aligned to 2 MiB and advised ``MADV_HUGEPAGE``, so the kernel backs it
with 2 MiB pages where it can (and with 4 KiB pages, silently, where it cannot).

Why: a bf16 decode step reads every weight and the KV its sequences attend over once, cold:
SmolLM2-135M's 269 MB of weights are ~66,000 4 KiB pages a step, each a TLB miss and a page
walk, and the hardware prefetchers stop at every 4 KiB boundary. On the 2-core AMD EPYC Zen 4
(THP in ``madvise`` mode, so torch's own allocations get 4 KiB pages), the 30 layers' linears
and the LM head with cold weights, interleaved in one process (median of 15): 32 rows 19.6 ->
17.6 ms and 4.65 -> 4.50 ms; 1 row 7.08 -> 6.71 and 1.89 -> 1.58 ms. The whole bf16 step
(in-process executor, context 128, the packed weights swapped between the two placements each
round, median of 12): batch 1 9.88 -> 9.64 ms, 16 16.7 -> 15.8, 32 32.1 -> 30.6. The KV pool
on huge pages: batch 32 even at context 128, 45.3 -> 44.4 ms at 512. torch can do the same
for every allocation (``THP_MEM_ALLOC_ENABLE=1``), but for all of a process's tensors, small
and short-lived ones included; here only the few large ones that are read every step.

Where THP is off (``never``) or not Linux, the tensors are plain ``torch.empty``/``zeros``.
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
    """Whether this kernel can back an advised mapping with huge pages: THP in ``always`` or
    ``madvise`` mode, and ``MADV_HUGEPAGE`` known to Python's ``mmap``."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in setting or "[madvise]" in setting)


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised (in fact zero: fresh anonymous memory) uint8 tensor of ``nbytes``, its
    first byte 2 MiB aligned, on a mapping advised for huge pages; its pages are faulted in on
    first touch. ``torch.empty`` where huge pages are not ``available()``."""
    if not available() or nbytes <= 0:
        return torch.empty(max(nbytes, 0), dtype=torch.uint8)
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES + HUGE_PAGE_BYTES   # room to align
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)   # keeps the mapping alive while in use
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES
    region.madvise(mmap.MADV_HUGEPAGE, offset, size - offset)
    return whole[offset:offset + nbytes]


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on huge pages, every page faulted in now (as
    ``torch.zeros`` touches them), so no step pays for a first touch."""
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if not available() or numel * itemsize < HUGE_PAGE_BYTES:
        return torch.zeros(tuple(shape), dtype=dtype)
    memory = empty_bytes(numel * itemsize)
    # Fresh anonymous pages are zero already (the kernel clears each as it maps it): a write a
    # small page apart maps them all, where zero_() would clear them again (4 GiB: 4.7 s vs ~1).
    memory[::SMALL_PAGE_BYTES] = 0
    return memory.view(dtype).view(tuple(shape))


def relocate(tensors: Sequence[torch.Tensor]) -> int:
    """Move each contiguous CPU tensor's data onto one huge-page mapping, in place (``set_``: every
    holder of the tensor sees the new memory), each start ``TENSOR_ALIGN_BYTES`` aligned. Returns
    the bytes moved; 0 (nothing changes) where huge pages are not available or the tensors add
    up to less than a huge page."""
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
