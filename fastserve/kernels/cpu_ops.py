"""The CPU kernels in ``cpu/`` (paged attention, K/V writes, table checks): built with the system C
compiler into a disk cache (atomically, per source, flags and CPU), loaded through ctypes (which
releases the GIL), tensors checked. C and not a torch extension: it compiles in under a second with
no headers, and reads each page in place where the reference gathers pages into a dense copy.
No compiler: ``available()`` is False and the torch reference runs. ``FASTSERVE_CPU_KERNEL_CACHE``,
``FASTSERVE_CC`` move the cache and name the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
PAGED_ATTENTION_SOURCE = SOURCE_DIR / "paged_attention.c"
CACHE_ENV_VAR = "FASTSERVE_CPU_KERNEL_CACHE"
COMPILER_ENV_VAR = "FASTSERVE_CC"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "fastserve" / "cpu-kernels"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
BUILD_TIMEOUT_S = 120.0
#: Query and output cross these entries as float32; a bf16 query over a bf16 cache takes ``BF16_ROWS``.
KERNEL_FOR_CACHE = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}
SUPPORTED_DTYPES = frozenset(KERNEL_FOR_CACHE)
BF16_ROWS = "paged_attention_bf16_rows"
BF16_ROWS_PROBE = "paged_attention_bf16_rows_available"
CHECK_TABLES = "check_block_tables"
WRITE_KV = "write_kv_rows"
SCRATCH_FAILED = -1
TABLE_TOO_SHORT = -3
OUTSIDE_POOL = -4
BF16_ROWS_UNSUPPORTED = -5

_log = logging.getLogger(__name__)


class KernelBuildError(RuntimeError):
    """The C compiler is missing or failed on a source."""


def _compiler() -> str | None:
    return os.environ.get(COMPILER_ENV_VAR) or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR)


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on one CPU must not load on another."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def build(source: Path, compiler: str | None = None) -> Path:
    cc = compiler or _compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (install gcc, or set FASTSERVE_CC)")
    # The headers beside the source (shared SIMD math) are part of what is compiled.
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join((source.read_text(), *headers, cc, *CFLAGS, _cpu_signature())).encode()
                         ).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *CFLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise KernelBuildError(f"{cc} failed on {source.name}:\n{done.stderr.strip()}")
        os.replace(tmp, target)   # atomic: another process sees the old state or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: Path) -> ctypes.CDLL:
    """An older revision (the benchmark's) may lack later entry points: those are left unset."""
    lib = ctypes.CDLL(str(build(source)))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    signatures = {name: [ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i32, i32, i32, i32, i32, ctypes.c_float,
                         ptr, i32] for name in KERNEL_FOR_CACHE.values()}
    signatures[CHECK_TABLES] = [ptr, i64, i64, ptr, i32, i32, i64]
    signatures[WRITE_KV] = [ptr, ptr, i64, i64, ptr, ptr, i64, i64, ptr, i32, i32, i64, i64]
    signatures[BF16_ROWS] = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i32, i32, i32, i32, i32,
                             ctypes.c_float, ptr, i64, i32]
    signatures[BF16_ROWS_PROBE] = []
    for name, argtypes in signatures.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name in KERNEL_FOR_CACHE.values():
                raise
            continue
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def load_optional(source: Path, probe: str, signatures: dict[str, list[type]], fallback: str) -> ctypes.CDLL | None:
    """An optional ISA-specific kernel, or None where it does not build or its ``probe()`` is 0."""
    try:
        lib = ctypes.CDLL(str(build(source)))
    except (KernelBuildError, OSError, subprocess.TimeoutExpired) as exc:
        _log.warning("%s unavailable, using %s: %s", source.name, fallback, exc)
        return None
    getattr(lib, probe).restype = ctypes.c_int
    if not getattr(lib, probe)():
        _log.info("the C compiler does not target %s's instructions here: using %s", source.name, fallback)
        return None
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        return load(PAGED_ATTENTION_SOURCE)
    except (KernelBuildError, OSError, subprocess.TimeoutExpired) as exc:
        _log.warning("CPU kernels unavailable, using the torch reference: %s", exc)
        return None


def available() -> bool:
    return _library() is not None


def bf16_rows_available(library: ctypes.CDLL | None = None) -> bool:
    """Whether the kernels here (or ``library``, another build) have ``paged_attention_bf16_rows``."""
    lib = library or _library()
    probe = getattr(lib, BF16_ROWS_PROBE, None) if lib is not None else None
    return bool(probe is not None and probe())


def library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise KernelBuildError("CPU kernels are not available on this machine")
    return lib


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and key_cache.device.type == "cpu"
            and key_cache.dtype in SUPPORTED_DTYPES
            and query.dtype in (torch.float32, key_cache.dtype)
            and key_cache.stride(-1) == 1 and available())


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """``reference.paged_attention`` on CPU; ``library``: another build, for comparisons."""
    lib = library or _library()
    if lib is None:
        raise KernelBuildError("CPU kernels are not available on this machine")
    if key_cache.stride() != value_cache.stride() or key_cache.shape != value_cache.shape:
        raise ValueError(f"key/value caches differ: {tuple(key_cache.shape)} {key_cache.stride()} vs "
                         f"{tuple(value_cache.shape)} {value_cache.stride()}")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = key_cache.shape
    if cache_dim != head_dim or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"query heads/dim {(num_heads, head_dim)} do not match the cache's "
                         f"{(num_kv_heads, cache_dim)}: head_dim must be equal and the KV heads divide the query heads")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in KERNEL_FOR_CACHE:
        raise ValueError(f"caches of {key_cache.dtype}/{value_cache.dtype}: the C kernel reads float32 or bfloat16")
    tables = block_tables.to(dtype=torch.int32).contiguous()
    lens = context_lens.to(dtype=torch.int32).contiguous()
    if lens.numel() != num_seqs or tables.shape[0] != num_seqs:
        raise ValueError(f"{num_seqs} queries but {tables.shape[0]} block tables and {lens.numel()} context lengths")
    if num_seqs == 0:
        return torch.empty(query.shape, dtype=query.dtype)
    # The C kernel trusts its tables: checked first (in torch for an older build).
    check = getattr(lib, CHECK_TABLES, None)
    status = (_check_tables_torch(tables, lens, block_size, key_cache.shape[0]) if check is None else
              check(tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(), num_seqs, block_size,
                    key_cache.shape[0]))
    raise_for_tables(status, lens, tables.shape[1], block_size, key_cache.shape[0])
    block_stride, token_stride, head_stride, _ = key_cache.stride()
    if query.dtype == key_cache.dtype == torch.bfloat16 and head_dim % 32 == 0 and bf16_rows_available(lib):
        q16 = query.contiguous()
        out16 = torch.empty_like(q16)
        status = getattr(lib, BF16_ROWS)(
            q16.data_ptr(), num_heads * head_dim, key_cache.data_ptr(), value_cache.data_ptr(), block_stride,
            token_stride, head_stride, tables.data_ptr(), tables.stride(0), lens.data_ptr(), num_seqs, num_heads,
            num_kv_heads, head_dim, block_size, float(scale), out16.data_ptr(), num_heads * head_dim,
            torch.get_num_threads())
        raise_for_status(BF16_ROWS, status)
        return out16
    q = query.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    status = getattr(lib, KERNEL_FOR_CACHE[key_cache.dtype])(
        q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_stride, token_stride, head_stride,
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        float(scale), out.data_ptr(), torch.get_num_threads())
    raise_for_status(KERNEL_FOR_CACHE[key_cache.dtype], status)
    return out.to(query.dtype)


def raise_for_tables(status: int, context_lens: torch.Tensor, table_width: int, block_size: int,
                     num_blocks: int) -> None:
    if status == TABLE_TOO_SHORT:
        raise ValueError(f"a context of {int(context_lens.max())} tokens needs more than the table's "
                         f"{table_width} blocks of {block_size}")
    if status == OUTSIDE_POOL:
        raise IndexError(f"a block id the contexts reach is outside the cache's {num_blocks} blocks")


def raise_for_status(kernel: str, status: int) -> None:
    if status == SCRATCH_FAILED:
        raise MemoryError(f"{kernel}: scratch allocation failed")
    if status == BF16_ROWS_UNSUPPORTED:
        raise RuntimeError(f"{kernel}: this build lacks AVX-512 BF16, or head_dim is not a multiple of 32")
    if status != 0:
        raise RuntimeError(f"{kernel} failed with status {status}")


def _check_tables_torch(tables: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int) -> int:
    width = -(-int(lens.max()) // block_size)
    if width > tables.shape[1]:
        return TABLE_TOO_SHORT
    used = tables[:, :width]
    return OUTSIDE_POOL if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks) else 0


def supports_write(key_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return (key_cache.device.type == "cpu" and key.device.type == "cpu" and value.device.type == "cpu"
            and key.dtype == value.dtype == key_cache.dtype and key_cache.dtype in SUPPORTED_DTYPES
            and key.dim() == value.dim() == 3 and key.shape[1:] == value.shape[1:] == key_cache.shape[2:]
            and all(_row_contiguous(t) for t in (key, value, key_cache)) and available())


def _row_contiguous(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    lib = library()
    if key_cache.stride() != value_cache.stride() or key_cache.shape != value_cache.shape:
        raise ValueError(f"key/value caches differ: {tuple(key_cache.shape)} {key_cache.stride()} vs "
                         f"{tuple(value_cache.shape)} {value_cache.stride()}")
    slots = slot_mapping.to(dtype=torch.int64).contiguous()
    if slots.numel() != key.shape[0] or value.shape[0] != key.shape[0]:
        raise ValueError(f"{slots.numel()} slots for {key.shape[0]} keys and {value.shape[0]} values")
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    elem = key_cache.element_size()
    status = lib.write_kv_rows(key.data_ptr(), value.data_ptr(), key.stride(0) * elem, value.stride(0) * elem,
                               key_cache.data_ptr(), value_cache.data_ptr(), key_cache.stride(0) * elem,
                               key_cache.stride(1) * elem, slots.data_ptr(), slots.numel(), block_size,
                               num_blocks, key_cache.shape[2] * key_cache.shape[3] * elem)
    if status == OUTSIDE_POOL:
        raise IndexError(f"slot {int(slots.max())} lies past the cache's {num_blocks} blocks of {block_size}")
