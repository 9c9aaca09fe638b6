"""What this CPU can do, from ``/proc/cpuinfo``: its name, its flags, whether it computes bf16
natively (``avx512_bf16`` or ``amx_bf16``; elsewhere torch emulates bf16, slower than fp32, so
``dtype: auto`` picks fp32). Detected from flags, never assumed from the vendor. Stdlib only.
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
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    return frozenset((_field("flags", text) or "").split())


def bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    flags = cpu_flags(cpuinfo)
    return tuple(f for f in BF16_FLAGS if f in flags)


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    return bool(bf16_flags(cpuinfo))


def cpu_has_amx_bf16(cpuinfo: str | None = None) -> bool:
    """Named only: whether the OS grants the tiles is ``cpu_linear.amx_available``."""
    return set(AMX_BF16_FLAGS) <= cpu_flags(cpuinfo)


def cpu_name(cpuinfo: str | None = None) -> str:
    """E.g. ``AMD EPYC (avx512_bf16)``: what every benchmark figure is labelled with."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    name = _field("model name", text) or platform.processor() or platform.machine()
    found = bf16_flags(text)
    return f"{name} ({', '.join(found) if found else 'no native bf16'})"
