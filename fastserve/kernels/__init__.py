"""Device code of the data plane: KV-cache writes, attention, block copies, and the norms,
activation and rotary embedding of LLaMA layers.

Owns the kernel API the model code calls (``write_kv``, ``prefill_attention``,
``context_prefill_attention``, ``paged_attention``, ``copy_blocks``, ``rms_norm``, ``silu_mul``,
``rotate``) and the choice, per call,
between the CuPy/CUDA kernels in ``fastserve/kernels/cuda/`` (launched by ``fastserve.kernels.cupy_ops``) and the
torch reference implementations in ``fastserve.kernels.reference`` (same signatures, same results to
rounding).

Which implementation runs:

* ``write_kv`` and ``paged_attention`` use the CUDA kernels when the tensor is on a CUDA device,
  its dtype is float16/bfloat16/float32, and ``cupy`` imports and sees a device; otherwise the
  torch reference, except on the CPU cases below. ``backend_for(tensor)`` says which. Setting the
  environment variable ``FASTSERVE_KERNEL_BACKEND=torch`` forces the reference everywhere.
* ``write_kv`` on CPU tensors whose K/V already have the cache's dtype (float32 or bfloat16),
  each token's row of heads contiguous in both, is one call of the C copy in ``fastserve/kernels/cpu/``
  (``fastserve.kernels.cpu_ops.supports_write``); otherwise the torch reference.
* ``paged_attention`` on CPU tensors with a float32 or bfloat16 cache uses the C kernel in
  ``fastserve/kernels/cpu/`` (built with the system C compiler by ``fastserve.kernels.cpu_ops``, which reads each page
  in place instead of gathering pages into a dense tensor; a bf16 cache is widened to fp32 as it
  is read) when it builds; otherwise the torch reference.
  ``paged_attention_backend(query, key_cache)`` says which.
* ``prefill_attention`` always uses torch's ``scaled_dot_product_attention`` (flash/efficient
  kernels on CUDA), one call per sequence.
* ``varlen_prefill_attention`` (what the model calls on a GPU where ``varlen_prefill_supported``:
  fp16/bf16 CUDA tensors, the CuPy kernels usable, torch's varlen flash kernel present) is one
  FlashAttention-2 varlen call per layer over every prompt and chunk, a chunk's cached prefix
  gathered from the paged cache in one CuPy launch (``fastserve.kernels.varlen``).
* A sliding window (``window``, Gemma's local layers) is honoured by the torch reference only:
  every attention call given one runs there. Callers pass it only where it cuts some context
  (``fastserve.worker.model.attention``), so short contexts keep the C and CUDA kernels.
* ``context_prefill_attention`` (chunked prefill: chunks that continue a cached prefix; start 0
  is a whole prompt) on a bf16 CPU query and cache runs the C kernel in
  ``fastserve/kernels/cpu/prefill_attention_bf16.c`` (``fastserve.kernels.cpu_prefill``; flash-style, reading every
  key and value in place from the cache, so the new tokens' K/V must be written first, as
  ``fastserve.worker.model.attention`` does) where it builds; ``prefill_reads_cache`` says when, and then
  the model sends whole prompts here too. Otherwise the torch reference on every device: it
  gathers the prefix from the paged cache into a dense tensor, then one masked SDPA call per
  sequence. Correct on CUDA, not a fused kernel.
* ``rms_norm`` (with the residual add before it), ``silu_mul`` and ``rotate`` (the rotary
  embedding) on bf16 CPU tensors run the C kernels in ``fastserve/kernels/cpu/elementwise_bf16.c``
  (``fastserve.kernels.cpu_elementwise``: one pass each instead of four to eight torch ops) where they
  build (AVX-512 BF16); otherwise, and on every other device and dtype, the torch reference.
* The sampler's greedy argmax and finiteness check over float32 CPU logits run the C kernel in
  ``fastserve/kernels/cpu/greedy.c`` (``fastserve.kernels.cpu_greedy``, called by ``fastserve.worker.sampler``
  directly) where
  it builds; otherwise torch's ``argmax`` and a float64 sum.
* ``copy_blocks`` copies one slice per run of consecutive block ids: a torch copy on CUDA
  (``cudaMemcpyAsync`` underneath; with pinned host memory and ``non_blocking=True`` on a side
  stream it overlaps with compute), a single-threaded memcpy between CPU tensors (it runs on the
  KV store's copier thread, which must not start an OpenMP team of its own).

KV cache layout (fixed by the lead): one tensor per pipeline stage,
``cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (2 = key, value), so one
block is one contiguous range. Kernels receive the per-layer views ``cache[:, layer, 0]`` and
``cache[:, layer, 1]`` of shape ``[num_blocks, block_size, num_heads, head_dim]``, strided along
dim 0; every implementation honours the strides.

cupy is imported lazily (any wheel: cupy-cuda12x, cupy-cuda13x, ...); importing this package never
needs CUDA. Nothing here imports ``app`` or ``actors``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from fastserve.kernels import reference
from fastserve.kernels.cuda_specs import CUDA_KERNEL_SUFFIX

__all__ = [
    "BACKEND_ENV_VAR",
    "CPU_BACKEND",
    "CUDA_BACKEND",
    "TORCH_BACKEND",
    "backend_for",
    "context_prefill_attention",
    "copy_blocks",
    "paged_attention",
    "paged_attention_backend",
    "prefill_attention",
    "prefill_reads_cache",
    "varlen_prefill_attention",
    "varlen_prefill_supported",
    "rms_norm",
    "rotate",
    "silu_mul",
    "write_kv",
]

CUDA_BACKEND = "cuda"
CPU_BACKEND = "cpu"
TORCH_BACKEND = "torch"
BACKEND_ENV_VAR = "FASTSERVE_KERNEL_BACKEND"

_log = logging.getLogger(__name__)


#: The probe ``_cupy_usable`` compiles (NVRTC) and runs before choosing the CuPy kernels.
_PROBE_SOURCE = r'''
extern "C" __global__ void fastserve_probe(int* out) { out[threadIdx.x] = 2 * threadIdx.x + 1; }
'''
_PROBE_THREADS = 32


@functools.cache
def _cupy_usable() -> bool:
    """Whether cupy imports, sees a device, and can compile and run a kernel (probed once per
    process). Compiling matters: a broken NVRTC or a driver too old for the toolkit passes the
    device count and would fail the first forward instead of falling back here."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        probe = cupy.RawKernel(_PROBE_SOURCE, "fastserve_probe")
        out = cupy.zeros(_PROBE_THREADS, dtype=cupy.int32)
        probe((1,), (_PROBE_THREADS,), (out,))
        if out.tolist() != [2 * i + 1 for i in range(_PROBE_THREADS)]:
            raise RuntimeError(f"the probe kernel computed {out.tolist()}")
    except Exception as exc:  # any import/driver/compiler/runtime failure means "no CUDA path"
        if torch.cuda.is_available():
            _log.warning("cupy unusable (%s); CUDA tensors use the torch reference kernels", exc)
        return False
    return True


def backend_for(tensor: torch.Tensor) -> str:
    """``"cuda"`` or ``"torch"``: which implementation a kernel call on ``tensor`` would use."""
    if _forced_reference():
        return TORCH_BACKEND
    if tensor.is_cuda and tensor.dtype in CUDA_KERNEL_SUFFIX and _cupy_usable():
        return CUDA_BACKEND
    return TORCH_BACKEND


def _forced_reference() -> bool:
    return os.environ.get(BACKEND_ENV_VAR, "").strip().lower() == TORCH_BACKEND


def cpu_step_allowed() -> bool:
    """Whether a step may take ``fastserve.kernels.cpu_step``'s run of C calls (not while the
    torch reference is forced: that run has no reference inside it)."""
    return not _forced_reference()


def paged_attention_backend(query: torch.Tensor, key_cache: torch.Tensor) -> str:
    """``"cuda"``, ``"cpu"`` (the C kernel) or ``"torch"``: which decode attention would run."""
    if _forced_reference():
        return TORCH_BACKEND
    if query.is_cuda:
        return backend_for(query)
    from fastserve.kernels import cpu_ops

    return CPU_BACKEND if cpu_ops.supports(query, key_cache) else TORCH_BACKEND


def _cupy_ops() -> ModuleType:
    from fastserve.kernels import cupy_ops

    return cupy_ops


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V into its cache slot, in place.

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_dim]``; ``slot_mapping``: int64
    ``[num_tokens]`` with ``slot = block_id * block_size + offset``; a slot < 0 is padding and is
    skipped. Caches are per-layer views ``[num_blocks, block_size, num_heads, head_dim]``.
    """
    if backend_for(key_cache) == CUDA_BACKEND:
        _cupy_ops().write_kv(key_cache, value_cache, key, value, slot_mapping)
    elif key_cache.device.type == "cpu" and not _forced_reference() and _cpu_writes(key_cache, key, value):
        from fastserve.kernels import cpu_ops

        cpu_ops.write_kv(key_cache, value_cache, key, value, slot_mapping)
    else:
        reference.write_kv(key_cache, value_cache, key, value, slot_mapping)


def _cpu_elementwise() -> ModuleType | None:
    """``fastserve.kernels.cpu_elementwise`` unless the reference is forced."""
    if _forced_reference():
        return None
    from fastserve.kernels import cpu_elementwise

    return cpu_elementwise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of ``x`` [rows, hidden], after adding ``delta`` (the residual add
    fused in): returns (``x + delta`` rounded to x's dtype, or ``x`` itself; the normed rows).
    Rows are normed in float32, cast back, then scaled by ``weight`` [hidden]."""
    cpu = _cpu_elementwise()
    if cpu is not None and cpu.fits_rms_norm(x, weight, delta):
        return cpu.rms_norm(x, weight, eps, delta)
    return reference.rms_norm(x, weight, eps, delta)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for ``gate``/``up`` [rows, width], in their dtype."""
    cpu = _cpu_elementwise()
    if cpu is not None and cpu.fits_silu_mul(gate, up):
        return cpu.silu_mul(gate, up)
    return reference.silu_mul(gate, up)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The half-split rotary embedding of ``x`` [tokens, heads, head_dim] by per-token angles:
    ``cos`` and ``signed_sin`` (sin with its first half negated), each [tokens, 1, head_dim] in
    x's dtype. Returns a new contiguous tensor."""
    cpu = _cpu_elementwise()
    if cpu is not None and cpu.fits_rotary(x, cos, signed_sin):
        return cpu.rotate(x, cos, signed_sin)
    return reference.rotate(x, cos, signed_sin)


def _cpu_writes(key_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    from fastserve.kernels import cpu_ops

    return cpu_ops.supports_write(key_cache, key, value)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Varlen causal self-attention over the new tokens of packed sequences.

    ``query``: ``[num_tokens, num_heads, head_dim]``; ``key``/``value``: ``[num_tokens,
    num_kv_heads, head_dim]`` (grouped-query attention when ``num_kv_heads < num_heads``: query
    head h reads KV head ``h // (num_heads // num_kv_heads)``); ``cu_seqlens``: ``[B + 1]``
    cumulative starts, host-side ints (a device tensor works but costs a host sync per call).
    Token t of a sequence attends to tokens 0..t of the same sequence; scores are
    ``scale * q.k``, softmax in float32. Returns ``[num_tokens, num_heads, head_dim]`` in the
    input dtype. With ``window``, token t attends to the last ``window`` tokens up to itself only.
    """
    return reference.prefill_attention(query, key, value, cu_seqlens, scale, window)


def context_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    start_positions: Sequence[int],
    block_tables: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Prefill attention where a sequence may continue a cached prefix (chunked prefill).

    As ``prefill_attention`` for the new tokens (``query``/``key``/``value``: ``[num_tokens,
    num_heads, head_dim]``, ``cu_seqlens`` cumulative starts), except that sequence b's tokens
    sit at positions ``start_positions[b] ..`` and also attend to positions
    ``0 .. start_positions[b]-1``, read from the per-layer caches through ``block_tables[b]``
    (int32 ``[B, max_blocks]``, padded with 0). Start 0 is plain causal prefill. Returns
    ``[num_tokens, num_heads, head_dim]`` in the input dtype. The new tokens' K/V must already
    be in the cache at their positions (the C kernel reads them there; the reference from
    ``key``/``value``). ``window``: as ``prefill_attention``'s (the reference runs).
    """
    if window is None and prefill_reads_cache(query, key_cache):
        from fastserve.kernels import cpu_prefill

        return cpu_prefill.context_prefill_attention(query, key_cache, value_cache, cu_seqlens, start_positions,
                                                     block_tables, scale)
    return reference.context_prefill_attention(query, key, value, key_cache, value_cache,
                                               cu_seqlens, start_positions, block_tables, scale, window)


def prefill_reads_cache(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether ``context_prefill_attention`` runs the CPU C kernel here, which reads the new
    tokens' keys and values from the cache (so they must be written first) and takes whole
    prompts (start 0) faster than ``prefill_attention``."""
    if _forced_reference() or query.device.type != "cpu":
        return False
    from fastserve.kernels import cpu_prefill

    return cpu_prefill.supports(query, key_cache)


def varlen_prefill_supported(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether ``varlen_prefill_attention`` runs here (see the module docstring)."""
    if backend_for(key_cache) != CUDA_BACKEND:
        return False
    from fastserve.kernels import varlen

    return varlen.supports(query, key_cache)


def varlen_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    start_positions: Sequence[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``context_prefill_attention`` as one varlen flash call (GPU only: ``varlen_prefill_supported``).

    ``cu_q``/``cu_k``: int32 device ``[B + 1]`` cumulative new tokens and contexts (prefix + new);
    ``max_q``/``max_k``: the longest of each, host ints (no read of the device); the new tokens'
    K/V must already be in the caches (a sequence with a prefix is read from there whole).
    """
    from fastserve.kernels import varlen

    return varlen.prefill_attention(query, key, value, key_cache, value_cache, cu_q, cu_k, max_q, max_k,
                                    start_positions, block_tables, scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention: one query token per sequence over its paged KV (already written).

    ``query``: ``[B, num_heads, head_dim]``; caches ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` with ``num_kv_heads`` dividing ``num_heads`` (query head h reads KV head
    ``h // (num_heads // num_kv_heads)``, in every backend); ``block_tables``: int32 ``[B, max_blocks_per_seq]``
    (padded with 0); ``context_lens``: int32 ``[B]`` (>= 1). Sequence b attends to positions
    ``0..context_lens[b]-1``; position p lives in block ``block_tables[b, p // block_size]`` at
    offset ``p % block_size``. Returns ``[B, num_heads, head_dim]`` in the input dtype. With
    ``window``, sequence b attends to its last ``window`` positions only (the reference runs).
    """
    if window is not None:
        return reference.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, window)
    backend = paged_attention_backend(query, key_cache)
    if backend == CPU_BACKEND:
        from fastserve.kernels import cpu_ops

        return cpu_ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    impl = _cupy_ops() if backend == CUDA_BACKEND else reference
    return impl.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale)


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: Sequence[int] | torch.Tensor,
    dst_ids: Sequence[int] | torch.Tensor,
    non_blocking: bool = False,
) -> None:
    """Copy whole blocks ``src[src_ids[k]] -> dst[dst_ids[k]]`` of full block-major caches.

    Runs of consecutive ids (in both lists) become one slice copy each. Used for swaps between
    device and pinned host memory: call it on a side stream with ``non_blocking=True`` to overlap
    with compute, and synchronise that stream before reusing the source blocks.
    """
    reference.copy_blocks(src, dst, src_ids, dst_ids, non_blocking=non_blocking)
