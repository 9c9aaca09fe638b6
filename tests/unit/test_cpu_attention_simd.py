"""The C decode attention's AVX-512 path (fastserve/kernels/cpu/paged_attention.c) against the torch reference.

On a CPU with AVX-512 (and avx512_bf16) these shapes take the intrinsics path: head_dim a
multiple of 32; a bf16 cache with an exactly-bf16 query goes through vdpbf16ps, with a float32
query through widened keys; float32 caches through FMAs. head_dim 48 and 80 take the scalar
fallback in the same call. Without those instructions every case runs the scalar kernels, and
must still match. Caches are per-layer views of a shuffled block-major pool, contexts end
mid-block.

Tolerances: every path multiplies exact products (float32 x float32 in FMA, bf16 x bf16 in
vdpbf16ps, both exact in float32 for bf16) and sums them in float32 in another order than torch,
so a float32 output stays within atol 1e-6 / rtol 1e-5 of the float32 reference on the same
(bf16-valued) inputs; a bf16 output is that result rounded once, so within one bf16 unit
(rtol 2**-7) of the reference rounded the same way.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fastserve.kernels import reference

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine")

F32_TOL = {"atol": 1e-6, "rtol": 1e-5}
BF16_OUT_TOL = {"atol": 1e-6, "rtol": 2**-7}
CONTEXTS = [1, 15, 17, 100, 511, 33]
LAYERS, LAYER = 3, 1


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def paged_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype,
               seed: int, contexts: list[int] = CONTEXTS) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in contexts]
    num_blocks = sum(per_seq) + 3
    pool = torch.randn(num_blocks, LAYERS, 2, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(contexts), max(per_seq) + 1, dtype=torch.int32)
    for seq, n in enumerate(per_seq):
        tables[seq, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    query = torch.randn(len(contexts), num_heads, head_dim, generator=gen)
    return query, pool[:, LAYER, 0], pool[:, LAYER, 1], tables, torch.tensor(contexts, dtype=torch.int32)


def run_kernel(threads: int, *args: object) -> torch.Tensor:
    from fastserve.kernels import cpu_ops

    assert cpu_ops.available(), "the C compiler is there, so the CPU kernels must build"
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cpu_ops.paged_attention(*args)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(previous)


def expected(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: torch.Tensor,
             lens: torch.Tensor, scale: float) -> torch.Tensor:
    return reference.paged_attention(query.float(), key.float(), value.float(), tables, lens, scale)


SHAPES = [   # (query heads, KV heads, head_dim): what each exercises
    (9, 3, 64),    # SmolLM2-135M: group 3, one 64-dim value pass
    (10, 2, 128),  # group 5: a run of 4 query heads then 1; two 64-dim value passes
    (4, 2, 96),    # group 2: a 64-dim then a 32-dim value pass
    (6, 6, 32),    # no grouping, one 32-wide vdpbf16ps step
    (9, 3, 80),    # head_dim % 32 != 0: the scalar fallback
    (6, 3, 48),    # the scalar fallback
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_float32_cache_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                                         threads: int) -> None:
    query, key, value, tables, lens = paged_case(num_heads, num_kv_heads, head_dim, block_size, torch.float32, 1)
    scale = head_dim**-0.5
    out = run_kernel(threads, query, key, value, tables, lens, scale)
    torch.testing.assert_close(out, expected(query, key, value, tables, lens, scale), **F32_TOL)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_bf16_cache_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                                      threads: int) -> None:
    query, key, value, tables, lens = paged_case(num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, 2)
    scale = head_dim**-0.5
    # A float32 query that is not bf16: keys widened, nothing rounded.
    out = run_kernel(threads, query, key, value, tables, lens, scale)
    torch.testing.assert_close(out, expected(query, key, value, tables, lens, scale), **F32_TOL)
    # The same query's bf16 values, still as float32: the vdpbf16ps path, float32 out.
    exact = query.to(torch.bfloat16).float()
    out_exact = run_kernel(threads, exact, key, value, tables, lens, scale)
    torch.testing.assert_close(out_exact, expected(exact, key, value, tables, lens, scale), **F32_TOL)
    # A bf16 query (the model in bf16): same path, the output rounded to bf16 once.
    out_bf16 = run_kernel(threads, exact.to(torch.bfloat16), key, value, tables, lens, scale)
    assert out_bf16.dtype == torch.bfloat16
    rounded = expected(exact, key, value, tables, lens, scale).to(torch.bfloat16)
    torch.testing.assert_close(out_bf16.float(), rounded.float(), **BF16_OUT_TOL)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_uneven_items_and_empty_contexts_match_reference(cache_dtype: torch.dtype, threads: int) -> None:
    """Each thread runs its own run of work items and fetches the next one's rows while it
    computes: item counts that do not divide among the threads, a thread with none (5 threads,
    4 sequences of one KV head: 4 items), and empty sequences (zeros out) before, between and
    after real ones."""
    if threads == 5:
        contexts, (num_heads, num_kv_heads) = [0, 0, 200, 33], (4, 1)
    else:
        contexts, (num_heads, num_kv_heads) = [0, 300, 0, 0, 47, 129, 0], (9, 3)
    query, key, value, tables, lens = paged_case(num_heads, num_kv_heads, 64, 16, cache_dtype, 3, contexts)
    query = query.to(torch.bfloat16).float()
    scale = 64**-0.5
    out = run_kernel(threads, query, key, value, tables, lens, scale)
    want = expected(query, key, value, tables, lens, scale)
    torch.testing.assert_close(out, want, **F32_TOL)
    assert out[lens == 0].abs().max() == 0


def test_kernel_flags_compile_the_simd_path_on_this_cpu() -> None:
    """The cases above run the intrinsics only if the kernel's compiler flags turn on the
    instruction sets this CPU has: check the macros the source tests, under those flags."""
    from fastserve.kernels import cpu_ops

    flags = cpu_flags()
    if "avx512f" not in flags:
        pytest.skip("no AVX-512 on this CPU: the cases above ran the scalar kernels")
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    build_flags = [f for f in cpu_ops.CFLAGS if f not in ("-shared", "-fPIC")]
    done = subprocess.run([cc, *build_flags, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True,
                          check=True, timeout=60)
    macros = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    assert "__AVX512F__" in macros
    assert ("__AVX512BF16__" in macros) == ("avx512_bf16" in flags)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_rows_entry_is_the_float32_entry_rounded_once(threads: int) -> None:
    """``paged_attention_bf16_rows`` (the step's entry: bf16 query rows and output rows inside
    wider buffers) gives exactly the float32 entry's result on the same query, rounded to bf16
    as torch rounds; the buffer around the rows is untouched."""
    from fastserve.kernels import cpu_ops

    if not cpu_ops.bf16_rows_available():
        pytest.skip("no AVX-512 BF16 in this build: the step keeps the float32 entry")
    query, key, value, tables, lens = paged_case(9, 3, 64, 16, torch.bfloat16, 4)
    query = query.to(torch.bfloat16)
    scale = 64**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = cpu_ops.paged_attention(query.float(), key, value, tables, lens, scale).to(torch.bfloat16)
        n, width, pad = query.shape[0], 9 * 64, 40   # rows of a wider matrix, starting 2 rows in
        q_rows = torch.zeros(n + 2, width + pad, dtype=torch.bfloat16)
        q_rows[2:, :width] = query.view(n, width)
        out_rows = torch.full((n + 2, width + pad), 7.0, dtype=torch.bfloat16)
        block_stride, token_stride, head_stride, _ = key.stride()
        status = getattr(cpu_ops.library(), cpu_ops.BF16_ROWS)(
            q_rows[2:].data_ptr(), width + pad, key.data_ptr(), value.data_ptr(), block_stride, token_stride,
            head_stride, tables.data_ptr(), tables.stride(0), lens.data_ptr(), n, 9, 3, 64, 16, scale,
            out_rows[2:].data_ptr(), width + pad, threads)
    finally:
        torch.set_num_threads(previous)
    assert status == 0
    assert torch.equal(out_rows[2:, :width].view(n, 9, 64), want)
    assert torch.equal(out_rows[:2], torch.full((2, width + pad), 7.0, dtype=torch.bfloat16))
    assert torch.equal(out_rows[2:, width:], torch.full((n, pad), 7.0, dtype=torch.bfloat16))


def test_bf16_rows_entry_refuses_a_head_dim_it_cannot_take() -> None:
    """head_dim 48 (not a multiple of 32): the entry writes nothing and says why."""
    from fastserve.kernels import cpu_ops

    if not cpu_ops.bf16_rows_available():
        pytest.skip("no AVX-512 BF16 in this build")
    _, key, value, tables, lens = paged_case(6, 3, 48, 16, torch.bfloat16, 5)
    query = torch.zeros(len(CONTEXTS), 6, 48, dtype=torch.bfloat16)
    out = torch.full_like(query, 3.0)
    block_stride, token_stride, head_stride, _ = key.stride()
    status = getattr(cpu_ops.library(), cpu_ops.BF16_ROWS)(
        query.data_ptr(), 6 * 48, key.data_ptr(), value.data_ptr(), block_stride, token_stride, head_stride,
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), len(CONTEXTS), 6, 3, 48, 16, 48**-0.5,
        out.data_ptr(), 6 * 48, 1)
    assert status == cpu_ops.BF16_ROWS_UNSUPPORTED
    assert torch.equal(out, torch.full_like(query, 3.0))
    with pytest.raises(RuntimeError, match="head_dim is not a multiple of 32"):
        cpu_ops.raise_for_status(cpu_ops.BF16_ROWS, status)
