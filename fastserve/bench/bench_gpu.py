"""The device check's measurements against the hardware's own limits, no Ray needed.

    python -m fastserve.bench.bench_gpu                      # every part, in this process
    python -m fastserve.bench.bench_gpu --part attention --results DIR   # one part -> DIR/attention.json
    python -m fastserve.bench.bench_gpu --report DIR          # the table and one JSON of DIR's parts
    python -m fastserve.bench.bench_gpu --smoke               # anywhere: tiny shapes on the CPU

``tests/gpu/run_on_device.sh`` runs each part in its own process under its own timeout, then ``--report``.
Each part (``PARTS``: copy ceilings, decode attention v1/v2, swaps, the 8B-shaped engine eager and
graphed, prefill, one TP8 rank of Llama-3.1-70B and of OPT-175B's first stage, ``cudaHostRegister`` of a
pool) is set against a ceiling measured on the same device. Timings: CUDA events around each call,
median of ``repeats`` after ``warmup``. A table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fastserve import kernels
from fastserve.kernels import reference
from fastserve.worker.executor import default_dtype
from fastserve.worker.graphs import GraphSettings
from fastserve.worker.kv_store import KVStore, register_host_memory, unregister_host_memory
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, SwapCommand, blocks_for
from fastserve.worker.model.config import ModelConfig, OPTConfig
from fastserve.worker.model.llama_config import LlamaConfig, RopeScaling
from fastserve.worker.model.registry import build_model
from fastserve.worker.model.shard import StageShard
from fastserve.worker.sampler import Sampler
from fastserve.worker.stage import StageRunner

GB = 1e9
GIB = 1 << 30
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
PARTS = ("ceilings", "attention", "swaps", "engine", "prefill", "llama70b_tp8", "opt175b_tp8_stage0",
         "host_register")
#: The runtime/driver calls that put work on a stream (what "a launch" is counted as).
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")

LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=8192),
                        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, name="llama3-8b-shape")
LLAMA3_70B = replace(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                     num_attention_heads=64, name="llama3.1-70b-shape")
OPT_175B = OPTConfig(vocab_size=50272, hidden_size=12288, num_hidden_layers=96, num_attention_heads=96,
                     ffn_dim=49152, max_position_embeddings=2048, name="opt-175b-shape")
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, name="tiny")
TINY_WIDE = replace(TINY, hidden_size=128, num_attention_heads=16, intermediate_size=256, name="tiny-tp8")
TINY_OPT = OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, ffn_dim=128,
                     max_position_embeddings=256, name="tiny-opt-tp8")


@dataclass(frozen=True)
class Production:
    """One rank of a production layout: its model, shard, dtype, KV pool and token budget (the
    config file's ``num_device_blocks`` and ``max_num_batched_tokens``)."""

    config: ModelConfig
    shard: StageShard
    dtype: torch.dtype
    device_blocks: int
    token_budget: int


@dataclass(frozen=True)
class Shapes:
    device: str
    dtype: torch.dtype
    model: LlamaConfig
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_context: int
    prefill_seqs: int
    prefill_len: int
    swap_blocks: int
    copy_bytes: int
    host_pool_bytes: int
    warmup: int
    repeats: int
    production: dict[str, Production]


GPU = Shapes("cuda", torch.bfloat16, LLAMA3_8B, block_size=16, batches=(1, 16, 64), contexts=(1024, 4096, 16384),
             decode_context=1024, prefill_seqs=8, prefill_len=1024, swap_blocks=1024, copy_bytes=2 << 30,
             host_pool_bytes=75 * GIB // 2, warmup=3, repeats=20,
             production={"llama70b_tp8": Production(LLAMA3_70B, StageShard(0, 80, 80, 0, 8), torch.bfloat16,
                                                    60000, 8192),
                         "opt175b_tp8_stage0": Production(OPT_175B, StageShard(0, 48, 96, 0, 8), torch.float16,
                                                          9000, 2048)})
SMOKE = Shapes("cpu", torch.float32, TINY, block_size=4, batches=(1, 2), contexts=(16, 32), decode_context=16,
               prefill_seqs=2, prefill_len=16, swap_blocks=8, copy_bytes=1 << 20, host_pool_bytes=1 << 20,
               warmup=1, repeats=3,
               production={"llama70b_tp8": Production(TINY_WIDE, StageShard(0, 2, 2, 0, 8), torch.float32, 64, 32),
                           "opt175b_tp8_stage0": Production(TINY_OPT, StageShard(0, 2, 4, 0, 8), torch.float32,
                                                            64, 32)})


def sync(s: Shapes) -> None:
    if s.device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], s: Shapes) -> float:
    """Median seconds of ``fn()`` over ``s.repeats`` calls after ``s.warmup``."""
    for _ in range(s.warmup):
        fn()
    times = []
    for _ in range(s.repeats):
        if s.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def environment(s: Shapes) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "machine": platform.processor() or platform.machine(), "device": s.device}
    if s.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        probe = torch.zeros(1, device="cuda", dtype=s.dtype)
        env |= {"gpu": props.name, "sm": f"{props.major}{props.minor}", "sms": props.multi_processor_count,
                "gpu_mem_GiB": round(props.total_memory / GIB, 1), "cuda": torch.version.cuda,
                "attention_backend": kernels.backend_for(probe)}
        try:
            import cupy

            env["cupy"] = cupy.__version__
        except ImportError:
            env["cupy"] = None
    return env




def ceilings(s: Shapes) -> dict[str, float]:
    n = s.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=s.device).random_()
    dst = torch.empty_like(src)
    out = {"copy_GBps": 2 * n / timed(lambda: dst.copy_(src), s) / GB}
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=s.device == "cuda")
    out["h2d_GBps"] = n / timed(lambda: src.copy_(pinned, non_blocking=True), s) / GB
    out["d2h_GBps"] = n / timed(lambda: pinned.copy_(src, non_blocking=True), s) / GB
    return {k: round(v, 2) for k, v in out.items()}


def _attention_kernels(s: Shapes) -> dict[str, Callable[..., torch.Tensor]]:
    if s.device != "cuda" or kernels.backend_for(torch.zeros(1, device=s.device, dtype=s.dtype)) != "cuda":
        return {"v1": kernels.paged_attention, "v2": kernels.paged_attention}   # the CPU's one kernel
    from fastserve.kernels import cupy_ops

    return {"v1": cupy_ops.paged_attention_v1, "v2": cupy_ops.paged_attention_v2}


def _attention_call(fn: Callable[..., torch.Tensor], query: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float) -> Callable[[], torch.Tensor]:
    return lambda: fn(query, cache[:, 0], cache[:, 1], tables, lens, scale)


def attention(s: Shapes, copy_gbps: float) -> list[dict[str, Any]]:
    cfg = s.model
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    impls = _attention_kernels(s)
    rows = []
    for context in s.contexts:
        blocks_per_seq = blocks_for(context, s.block_size)
        for batch in s.batches:
            num_blocks = batch * blocks_per_seq
            cache = torch.randn(num_blocks, 2, s.block_size, kv_heads, dim, device=s.device).to(s.dtype)
            query = torch.randn(batch, heads, dim, device=s.device).to(s.dtype)
            tables = torch.randperm(num_blocks, device=s.device, dtype=torch.int64).to(torch.int32)
            tables = tables.reshape(batch, blocks_per_seq)
            lens = torch.full((batch,), context, dtype=torch.int32, device=s.device)
            kv_bytes = batch * context * kv_heads * dim * 2 * cache.element_size()
            row: dict[str, Any] = {"batch": batch, "context": context}
            for name, fn in impls.items():
                seconds = timed(_attention_call(fn, query, cache, tables, lens, dim ** -0.5), s)
                gbps = kv_bytes / seconds / GB
                row |= {f"{name}_us": round(seconds * 1e6, 1), f"{name}_of_copy": round(gbps / copy_gbps, 3)}
            row["v2_speedup"] = round(row["v1_us"] / row["v2_us"], 2)
            rows.append(row)
            del cache
    return rows


def swaps(s: Shapes, ceiling: dict[str, float]) -> dict[str, Any]:
    cfg = s.model
    kv = KVStore(cfg.num_hidden_layers, cfg.num_kv_heads, cfg.head_dim, s.block_size, 2 * s.swap_blocks,
                 s.swap_blocks, s.dtype, s.device)
    try:
        n = s.swap_blocks
        moved = n * kv.bytes_per_block
        scattered = tuple(range(0, 2 * n, 2))   # every other block: runs of one, no coalescing

        def out_in(src: tuple[int, ...]) -> Callable[[], None]:
            def run() -> None:
                kv.swap(SwapCommand("out", "bench", src, tuple(range(n))))
                kv.swap(SwapCommand("in", "bench", tuple(range(n)), src))
                kv.wait_all()
            return run

        contiguous = 2 * moved / timed(out_in(tuple(range(n))), s) / GB
        strided = 2 * moved / timed(out_in(scattered), s) / GB
    finally:
        kv.close()
    pcie = (ceiling["h2d_GBps"] + ceiling["d2h_GBps"]) / 2
    return {"block_KiB": round(kv.bytes_per_block / 1024, 1), "blocks": n,
            "contiguous_GBps": round(contiguous, 2), "scattered_GBps": round(strided, 2),
            "contiguous_of_pinned": round(contiguous / pcie, 3), "scattered_of_pinned": round(strided / pcie, 3)}




def random_runner(config: ModelConfig, shard: StageShard, dtype: torch.dtype, device: str, block_size: int,
                  device_blocks: int, graphs: GraphSettings) -> StageRunner:
    """A stage built on ``device`` in ``dtype`` with its modules' own random initialisation (no
    checkpoint, no host copy), its linears fused as the executor fuses them, and a KV pool."""
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        model = build_model(config, shard)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
    model = model.eval()
    model.pack_linear_weights()
    kv = KVStore(shard.num_layers, model.num_local_kv_heads, config.head_dim, block_size, device_blocks, 0,
                 dtype, device)
    return StageRunner(model, kv, Sampler(0), graphs)


def _hidden_size(config: ModelConfig) -> int:
    return int(config.hidden_size)


def decode_plan(batch: int, context: int, block_size: int, step: int) -> BatchPlan:
    """``batch`` decode entries at position ``context`` over disjoint block runs."""
    per = blocks_for(context + 64, block_size)
    return BatchPlan(step, tuple(BatchEntry(str(b), (3 + b,), context, tuple(range(b * per, (b + 1) * per)), False,
                                            GREEDY, step) for b in range(batch)))


def decode_times(runner: StageRunner, s: Shapes, batch: int, context: int, graphs: bool,
                 hidden: torch.Tensor | None) -> float:
    """Median seconds of one whole decode step (tokens on the host when it returns)."""
    keep = runner.graphs
    runner.graphs = keep if graphs else None
    state = {"step": 0}
    sample = runner.model.shard.is_last

    def step() -> None:
        plan = decode_plan(batch, context + state["step"] % 32, s.block_size, state["step"])
        runner.run(plan, hidden, sample=sample)
        state["step"] += 1
    try:
        for _ in range(s.warmup):
            step()
        sync(s)
        times = []
        for _ in range(s.repeats):
            t0 = time.perf_counter()
            step()
            sync(s)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        runner.graphs = keep


def step_audit(runner: StageRunner, s: Shapes, batch: int, context: int) -> dict[str, Any]:
    """One graphed decode step: syncs torch's debug mode warns about, and the launch calls the
    profiler sees (everything outside the graph; the graph itself is one ``cudaGraphLaunch``)."""
    if s.device != "cuda" or runner.graphs is None:
        return {"syncs": None, "launches": None}
    plan = decode_plan(batch, context, s.block_size, 10_000)
    runner.run(plan, None, sample=True)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.run(plan, None, sample=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    launches: dict[str, int] = {}
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.run(plan, None, sample=True)
            torch.cuda.synchronize()
        for event in prof.events():
            if event.name in LAUNCH_CALLS:
                launches[event.name] = launches.get(event.name, 0) + 1
    except Exception as exc:   # the profiler is a diagnostic here: its absence must not fail the part
        launches = {"error": str(exc)[:200]}  # type: ignore[dict-item]
    total = sum(v for v in launches.values() if isinstance(v, int))
    return {"syncs": syncs, "launches": launches, "launches_total": total}


def engine(s: Shapes, copy_gbps: float) -> dict[str, Any]:
    cfg = s.model
    per = blocks_for(s.decode_context + 64, s.block_size)
    graphs = GraphSettings(enabled=True, max_batch=max(s.batches), max_context=s.decode_context + 64)
    runner = random_runner(cfg, StageShard.whole(cfg), s.dtype, s.device, s.block_size, max(s.batches) * per, graphs)
    try:
        runner.kv.device_pool.normal_()   # contexts over random keys and values (no prefill needed)
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        floor_s = weight_bytes / (copy_gbps * GB / 2)   # each weight read once: half a copy's traffic
        rows = []
        for batch in s.batches:
            eager = decode_times(runner, s, batch, s.decode_context, False, None)
            graphed = decode_times(runner, s, batch, s.decode_context, True, None) if runner.graphs else None
            rows.append({"batch": batch, "eager_ms": round(eager * 1e3, 2),
                         "graphs_ms": None if graphed is None else round(graphed * 1e3, 2),
                         "floor_ms": round(floor_s * 1e3, 3), "eager_over_floor": round(eager / floor_s, 2),
                         "graphs_over_floor": None if graphed is None else round(graphed / floor_s, 2)})
        audit = step_audit(runner, s, 16 if 16 in s.batches else s.batches[-1], s.decode_context)
    finally:
        runner.kv.close()
    return {"weight_GB": round(weight_bytes / GB, 2), "context": s.decode_context, "steps": rows, "audit": audit}


def prefill(s: Shapes) -> dict[str, Any]:
    """Prefill attention of one 8B layer: ours vs one raw varlen flash call vs the reference, for
    whole prompts and for chunks over a cached prefix of half the length."""
    out: dict[str, Any] = {"seqs": s.prefill_seqs, "tokens_each": s.prefill_len}
    for case, past in (("prompts", 0), ("chunks", s.prefill_len // 2)):
        out[case] = prefill_case(s, past)
    return out


def prefill_case(s: Shapes, past: int) -> dict[str, float]:
    cfg = s.model
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    n, length = s.prefill_seqs, s.prefill_len
    new = length - past
    per = blocks_for(length, s.block_size)
    cache = torch.randn(n * per, 2, s.block_size, kv_heads, dim, device=s.device).to(s.dtype)
    key_cache, value_cache = cache[:, 0], cache[:, 1]
    q = torch.randn(n * new, heads, dim, device=s.device).to(s.dtype)
    k = torch.randn(n * new, kv_heads, dim, device=s.device).to(s.dtype)
    v = torch.randn(n * new, kv_heads, dim, device=s.device).to(s.dtype)
    tables = torch.arange(n * per, dtype=torch.int32, device=s.device).reshape(n, per)
    bounds = tuple(range(0, n * new + 1, new))
    starts = (past,) * n
    cu_q = torch.tensor(bounds, dtype=torch.int32, device=s.device)
    cu_k = torch.tensor(tuple(range(0, n * length + 1, length)), dtype=torch.int32, device=s.device)
    scale = dim ** -0.5
    times: dict[str, float] = {"reference_ms": timed(lambda: reference.context_prefill_attention(
        q, k, v, key_cache, value_cache, bounds, starts, tables, scale), s) * 1e3}
    if kernels.varlen_prefill_supported(q, key_cache):
        from fastserve.kernels import cupy_ops, varlen

        times["ours_ms"] = timed(lambda: kernels.varlen_prefill_attention(
            q, k, v, key_cache, value_cache, cu_q, cu_k, new, length, starts, tables, scale), s) * 1e3
        keys, values, cu = k, v, cu_q
        if past:   # the flash call alone, on keys and values already packed
            keys, values = cupy_ops.gather_kv(key_cache, value_cache, tables, cu_k, n * length, length)
            cu = cu_k
        times["flash_ms"] = timed(lambda: varlen._flash(q, keys, values, cu_q, cu, new, length, scale), s) * 1e3
        times["ours_over_flash"] = times["ours_ms"] / times["flash_ms"]
    return {k_: round(v_, 3) for k_, v_ in times.items()}


def production(s: Shapes, name: str) -> dict[str, Any]:
    """One production rank: peak memory after a full-budget prefill, decode steps at batch 1/16/64."""
    p = s.production[name]
    cfg = p.config
    context = s.decode_context
    per = blocks_for(context + 64, s.block_size)
    need = max(max(s.batches) * per, blocks_for(p.token_budget, s.block_size) + 8)
    blocks = max(p.device_blocks, need) if s.device == "cuda" else need
    graphs = GraphSettings(enabled=True, max_batch=max(s.batches), max_context=context + 64)
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runner = random_runner(cfg, p.shard, p.dtype, s.device, s.block_size, blocks, graphs)
    model = runner.model
    try:
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        hidden_size = _hidden_size(cfg)
        first, last = model.shard.is_first, model.shard.is_last
        # A full-budget prefill: the token budget as prompts of `context` tokens.
        prompts = max(1, p.token_budget // context)
        length = p.token_budget // prompts
        plan = BatchPlan(0, tuple(BatchEntry(str(b), tuple(range(3, 3 + length)), 0,
                                             tuple(range(b * per, (b + 1) * per)), True, GREEDY)
                                  for b in range(prompts)))
        dtype = p.dtype
        hidden_in = None if first else torch.randn(prompts * length, hidden_size, device=s.device).to(dtype)
        start = time.perf_counter()
        runner.run(plan, hidden_in, sample=last)
        sync(s)
        prefill_s = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if s.device == "cuda" else 0
        total = torch.cuda.get_device_properties(0).total_memory if s.device == "cuda" else 0
        runner.kv.device_pool.normal_()
        rows = []
        for batch in s.batches:
            hidden = None if first else torch.randn(batch, hidden_size, device=s.device).to(dtype)
            graphed = decode_times(runner, s, batch, context, True, hidden)
            rows.append({"batch": batch, "step_ms": round(graphed * 1e3, 2)})
    finally:
        runner.kv.close()
    return {"model": cfg.name, "layers": model.shard.num_layers, "tp": model.shard.tp_size,
            "heads": model.num_local_heads, "kv_heads": model.num_local_kv_heads, "dtype": str(p.dtype)[6:],
            "weight_GB": round(weight_bytes / GB, 2), "kv_blocks": blocks,
            "kv_GB": round(runner.kv.device_pool.numel() * runner.kv.device_pool.element_size() / GB, 2),
            "prefill_tokens": prompts * length, "prefill_s": round(prefill_s, 3),
            "peak_GiB": round(peak / GIB, 2), "device_GiB": round(total / GIB, 2), "decode": rows}


def host_register(s: Shapes) -> dict[str, Any]:
    """The host KV pool's pinning: touching its pages (``torch.zeros``), then ``cudaHostRegister``."""
    if s.device != "cuda":
        return {"skipped": "no CUDA device"}
    start = time.perf_counter()
    pool = torch.zeros(s.host_pool_bytes, dtype=torch.uint8)
    touched = time.perf_counter() - start
    start = time.perf_counter()
    register_host_memory(pool)
    registered = time.perf_counter() - start
    start = time.perf_counter()
    unregister_host_memory(pool)
    released = time.perf_counter() - start
    return {"GiB": round(s.host_pool_bytes / GIB, 2), "zeros_s": round(touched, 2),
            "register_s": round(registered, 2), "unregister_s": round(released, 2)}




def run_part(part: str, s: Shapes, results: dict[str, Any]) -> Any:
    if part == "ceilings":
        return ceilings(s)
    if part in ("attention", "engine", "swaps") and "copy_GBps" not in (results.get("ceilings") or {}):
        results["ceilings"] = ceilings(s)
    copy = float(results["ceilings"]["copy_GBps"]) if "ceilings" in results else 0.0
    if part == "attention":
        return attention(s, copy)
    if part == "swaps":
        return swaps(s, results["ceilings"])
    if part == "engine":
        return engine(s, copy)
    if part == "prefill":
        return prefill(s)
    if part in s.production:
        return production(s, part)
    if part == "host_register":
        return host_register(s)
    raise ValueError(f"unknown part {part!r}; parts: {', '.join(PARTS)}")


#: The issue's goals: (name, where in the results, comparison, bound).
GOALS = (
    ("decode step at batch 1 <= 1.25x floor (graphs)", ("engine", "steps", 1, "graphs_over_floor"), "<=", 1.25),
    ("decode step at batch 64 <= 1.5x floor (graphs)", ("engine", "steps", 64, "graphs_over_floor"), "<=", 1.5),
    ("attention v2 at batch 64, 4K >= 70% of copy", ("attention", 64, 4096, "v2_of_copy"), ">=", 0.70),
    ("attention v2 at batch 1, 16K >= 30% of copy", ("attention", 1, 16384, "v2_of_copy"), ">=", 0.30),
    ("graphed decode step: 0 syncs", ("engine", "audit", "syncs"), "<=", 0),
    ("graphed decode step: <= 5 launches outside the graph", ("engine", "audit", "launches_total"), "<=", 5),
    ("prefill 8 x 1K within 1.3x one flash call", ("prefill", "prompts", "ours_over_flash"), "<=", 1.3),
)


def _lookup(results: dict[str, Any], path: tuple[Any, ...]) -> Any:
    """A value by path: dict keys, or for a list of rows the row whose batch (and context) match."""
    node: Any = results.get(path[0])
    rest = path[1:]
    while rest and node is not None:
        key = rest[0]
        if isinstance(node, dict):
            node, rest = node.get(key), rest[1:]
        elif isinstance(node, list) and "context" in (node[0] if node else {}) and len(rest) > 1:
            node = next((r for r in node if r.get("batch") == key and r.get("context") == rest[1]), None)
            rest = rest[2:]
        elif isinstance(node, list):
            node = next((r for r in node if r.get("batch") == key), None)
            rest = rest[1:]
        else:
            return None
    return node


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, path, op, bound in GOALS:
        value = _lookup(results, path)
        met = None if not isinstance(value, (int, float)) else (value <= bound if op == "<=" else value >= bound)
        out.append({"goal": name, "value": value, "met": met})
    return out


def report(results: dict[str, Any]) -> None:
    """The readable table of whatever parts ``results`` holds, and the goals against them."""
    print("\nenvironment:", json.dumps(results.get("env", {})))
    if "status" in results:
        print("steps:", json.dumps(results["status"]))
    if "ceilings" in results:
        print("ceilings (GB/s, measured):", results["ceilings"])
    if isinstance(results.get("attention"), list):
        print(f"\n{'batch':>6} {'context':>8} {'v1 us':>10} {'v2 us':>10} {'v1 of copy':>11} {'v2 of copy':>11}"
              f" {'speedup':>8}   paged decode attention (one 8B layer)")
        for r in results["attention"]:
            print(f"{r['batch']:>6} {r['context']:>8} {r['v1_us']:>10} {r['v2_us']:>10} {r['v1_of_copy']:>11} "
                  f"{r['v2_of_copy']:>11} {r['v2_speedup']:>8}")
    if isinstance(results.get("swaps"), dict):
        print("\nswaps (out + in, KV store):", results["swaps"])
    if isinstance(results.get("engine"), dict):
        e = results["engine"]
        print(f"\n{'batch':>6} {'eager ms':>9} {'graphs ms':>10} {'floor ms':>9} {'eager/floor':>12} "
              f"{'graphs/floor':>13}   decode step, 8B shape ({e['weight_GB']} GB), context {e['context']}")
        for r in e["steps"]:
            print(f"{r['batch']:>6} {r['eager_ms']:>9} {r['graphs_ms']!s:>10} {r['floor_ms']:>9} "
                  f"{r['eager_over_floor']:>12} {r['graphs_over_floor']!s:>13}")
        print("graphed step audit:", e["audit"])
    if isinstance(results.get("prefill"), dict):
        print("\nprefill attention, one 8B layer:", json.dumps(results["prefill"]))
    for name in ("llama70b_tp8", "opt175b_tp8_stage0"):
        r = results.get(name)
        if isinstance(r, dict) and "decode" in r:
            steps = ", ".join(f"b{d['batch']} {d['step_ms']} ms" for d in r["decode"])
            print(f"\n{name}: {r['layers']} layers, {r['heads']}q/{r['kv_heads']}kv heads, "
                  f"weights {r['weight_GB']} GB, KV {r['kv_GB']} GB; prefill {r['prefill_tokens']} tok "
                  f"{r['prefill_s']} s, peak {r['peak_GiB']}/{r['device_GiB']} GiB; decode {steps}")
    if isinstance(results.get("host_register"), dict):
        print("\nhost pool register:", results["host_register"])
    for name, value in results.items():
        if isinstance(value, dict) and "error" in value:
            print(f"\n{name}: FAILED: {value['error']}")
    results["goals"] = goals(results)
    print(f"\n{'goal':<58} {'value':>10}  met")
    for g in results["goals"]:
        print(f"{g['goal']:<58} {g['value']!s:>10}  {g['met']}")


def load_results(directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            out[path.stem] = {"error": f"unreadable: {exc}"}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a rehearsal)")
    parser.add_argument("--part", choices=PARTS, action="append", help="run only these parts (repeatable)")
    parser.add_argument("--results", type=Path, help="write each part's JSON here (PART.json)")
    parser.add_argument("--report", type=Path, help="print the table and JSON of the parts in this folder")
    args = parser.parse_args(argv)
    if args.report is not None:
        found = load_results(args.report)
        report(found)
        print(json.dumps(found))
        return found
    s = SMOKE if args.smoke else GPU
    if s.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke for the CPU rehearsal")
    started = time.perf_counter()
    results: dict[str, Any] = {"mode": "smoke" if args.smoke else "gpu", "env": environment(s)}
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        known = load_results(args.results)
        if "ceilings" in known:
            results["ceilings"] = known["ceilings"]
        (args.results / "env.json").write_text(json.dumps(results["env"]))
    for part in args.part or PARTS:
        print(f"== {part}", flush=True)
        try:
            results[part] = run_part(part, s, results)
        except Exception as exc:   # one part's failure is reported and the rest still run
            results[part] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        if args.results is not None:
            (args.results / f"{part}.json").write_text(json.dumps(results[part]))
        print(json.dumps(results[part]), flush=True)
    results["seconds"] = round(time.perf_counter() - started, 1)
    report(results)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
