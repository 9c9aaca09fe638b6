"""What this CPU can do, read from ``/proc/cpuinfo``: its name, its flags, and whether it computes
bfloat16 natively.

Owns the one answer to "does this CPU have bf16?" (and AMX's bf16 tiles?) that the model's
``dtype: auto``, the kernels' bf16 paths, the roofline benchmark and the bf16 tests share.
Detected from the kernel's flag list, never assumed from the vendor or from torch:
``avx512_bf16`` (AVX-512 BF16: Intel Cooper Lake and later, AMD Zen 4 and later) or
``amx_bf16`` (AMX tiles). A CPU without either still runs bf16 tensors in torch, but by
emulation, slower than fp32 — so ``auto`` picks fp32 there.

Stdlib only; nothing here imports torch, ``app`` or ``actors``.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
#: Flags that mean native bf16 arithmetic (dot products with fp32 accumulation).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: Flags of AMX's bf16 tile multiply: the tiles themselves and their bf16 dot product.
AMX_BF16_FLAGS = ("amx_tile", "amx_bf16")


def _field(name: str, cpuinfo: str) -> str | None:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


@functools.cache
def _cpuinfo() -> str:
    try:
        return CPUINFO.read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's flags (``/proc/cpuinfo`` unless ``cpuinfo`` text is given)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    return frozenset((_field("flags", text) or "").split())


def bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """Which of ``BF16_FLAGS`` this CPU has (empty: no native bf16)."""
    flags = cpu_flags(cpuinfo)
    return tuple(f for f in BF16_FLAGS if f in flags)


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX)."""
    return bool(bf16_flags(cpuinfo))


def cpu_has_amx_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU names AMX tiles with their bf16 multiply (``fastserve.bench.roofline``'s AMX
    peak; whether the OS lets a process use them is ``fastserve.kernels.cpu_linear.amx_available``)."""
    return set(AMX_BF16_FLAGS) <= cpu_flags(cpuinfo)


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name, with its bf16 flags, e.g. ``AMD EPYC (avx512_bf16)``; what every
    benchmark figure is labelled with."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    name = _field("model name", text) or platform.processor() or platform.machine()
    found = bf16_flags(text)
    return f"{name} ({', '.join(found) if found else 'no native bf16'})"
