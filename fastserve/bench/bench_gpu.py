"""The device check's measurements against the hardware's own limits (issue #25), no Ray needed.

    python -m fastserve.bench.bench_gpu            # on a GPU: LLaMA-3-8B shapes, bf16 (a few minutes)
    python -m fastserve.bench.bench_gpu --smoke    # anywhere: tiny shapes on the CPU (CI runs this)

Each ceiling is measured in the same run, on the same device:

- ``copy_GBps``: a device-to-device copy of a large buffer (bytes read + written per second), the
  HBM bandwidth a memory-bound kernel can reach. Paged decode attention is reported as KV bytes
  read per second ÷ this, for batch 1/16/64 at context 1K/4K (32 query heads, 8 KV heads, 128
  dims, block 16: one LLaMA-3-8B layer).
- ``h2d_GBps`` / ``d2h_GBps``: one large copy between pinned host memory and the device. The KV
  store's swaps (side stream, registered host pool, runs of blocks as the plan names them) are
  reported as bytes per second ÷ these.
- The engine: an in-process LLaMA-3-8B-shaped model in bf16 with random weights, greedy decode
  steps at batch 1/16/64 (prompts of ``PROMPT_LEN``), timed per step; its floor is reading every
  weight once per step at ``copy_GBps``. ``transformers``' ``LlamaForCausalLM`` with the *same*
  weights decodes the same batch with its KV cache, timed the same way.

Timings: CUDA events around each call, median of ``REPEATS`` after ``WARMUP`` (wall clock and
``perf_counter`` on the CPU). A readable table first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastserve import kernels
from fastserve.worker.executor import default_dtype
from fastserve.worker.kv_store import KVStore
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, SwapCommand
from fastserve.worker.model.llama_config import LlamaConfig, RopeScaling
from fastserve.worker.model.registry import build_model
from fastserve.worker.model.shard import StageShard
from fastserve.worker.model.weights import load_weights
from fastserve.worker.sampler import Sampler
from fastserve.worker.stage import StageRunner


@dataclass(frozen=True)
class Shapes:
    device: str
    dtype: torch.dtype
    model: LlamaConfig
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prompt_len: int
    decode_steps: int
    swap_blocks: int
    copy_bytes: int
    warmup: int
    repeats: int


LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=8192),
                        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, name="llama3-8b-shape")
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, name="tiny")
GPU = Shapes("cuda", torch.bfloat16, LLAMA3_8B, block_size=16, batches=(1, 16, 64), contexts=(1024, 4096),
             prompt_len=512, decode_steps=16, swap_blocks=1024, copy_bytes=2 << 30, warmup=3, repeats=20)
SMOKE = Shapes("cpu", torch.float32, TINY, block_size=4, batches=(1, 2), contexts=(16, 32), prompt_len=8,
               decode_steps=3, swap_blocks=8, copy_bytes=1 << 20, warmup=1, repeats=3)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
GB = 1e9


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
        env |= {"gpu": props.name, "sm": f"{props.major}{props.minor}",
                "gpu_mem_GiB": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                "attention_backend": kernels.backend_for(probe)}
        try:
            import cupy

            env["cupy"] = cupy.__version__
        except ImportError:
            env["cupy"] = None
    return env


def ceilings(s: Shapes) -> dict[str, float]:
    n = s.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=s.device)
    dst = torch.empty_like(src)
    out = {"copy_GBps": 2 * n / timed(lambda: dst.copy_(src), s) / GB}
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=s.device == "cuda")
    out["h2d_GBps"] = n / timed(lambda: src.copy_(pinned, non_blocking=True), s) / GB
    out["d2h_GBps"] = n / timed(lambda: pinned.copy_(src, non_blocking=True), s) / GB
    return out


def paged_attention(s: Shapes, copy_gbps: float) -> list[dict[str, Any]]:
    cfg = s.model
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    rows = []
    for context in s.contexts:
        blocks_per_seq = -(-context // s.block_size)
        for batch in s.batches:
            num_blocks = batch * blocks_per_seq
            cache = torch.randn(num_blocks, 2, s.block_size, kv_heads, dim, device=s.device).to(s.dtype)
            query = torch.randn(batch, heads, dim, device=s.device).to(s.dtype)
            tables = torch.randperm(num_blocks, device=s.device, dtype=torch.int64).to(torch.int32)
            tables = tables.reshape(batch, blocks_per_seq)
            lens = torch.full((batch,), context, dtype=torch.int32, device=s.device)
            seconds = timed(lambda c=cache, q=query, t=tables, n=lens: kernels.paged_attention(
                q, c[:, 0], c[:, 1], t, n, dim ** -0.5), s)
            kv_bytes = batch * context * kv_heads * dim * 2 * cache.element_size()
            gbps = kv_bytes / seconds / GB
            rows.append({"batch": batch, "context": context, "us": round(seconds * 1e6, 1),
                         "GBps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3)})
            del cache
    return rows


def swaps(s: Shapes, ceiling: dict[str, float]) -> dict[str, Any]:
    cfg = s.model
    kv = KVStore(cfg.num_hidden_layers, cfg.num_kv_heads, cfg.head_dim, s.block_size, 2 * s.swap_blocks,
                 s.swap_blocks, s.dtype, s.device)
    try:
        n = s.swap_blocks
        moved = n * kv.bytes_per_block
        # Every other block: runs of one, the worst case the plan can name (no coalescing).
        scattered = tuple(range(0, 2 * n, 2))

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


def hf_and_ours(s: Shapes) -> tuple[Any, StageRunner, int]:
    """transformers' model with random weights on the device, and our stage loaded from it."""
    import transformers

    torch.manual_seed(0)
    with torch.device(s.device), default_dtype(s.dtype):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**s.model.to_hf_dict())).eval()
        model = build_model(s.model, StageShard.whole(s.model))
    hf.generation_config.eos_token_id = None
    load_weights(model, hf.state_dict().items())
    model = model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = max(s.batches) * -(-(s.prompt_len + s.warmup + s.repeats + 2) // s.block_size)
    kv = KVStore(s.model.num_hidden_layers, s.model.num_kv_heads, s.model.head_dim, s.block_size, blocks, 0,
                 s.dtype, s.device)
    return hf, StageRunner(model, kv, Sampler(0)), weight_bytes


def engine(s: Shapes, copy_gbps: float) -> list[dict[str, Any]]:
    hf, runner, weight_bytes = hf_and_ours(s)
    floor_s = weight_bytes / (copy_gbps * GB / 2)   # each weight read once: half a copy's traffic
    try:
        return [engine_row(s, hf, runner, batch, floor_s) for batch in s.batches]
    finally:
        runner.kv.close()


def engine_row(s: Shapes, hf: Any, runner: StageRunner, batch: int, floor_s: float) -> dict[str, Any]:
    """Prefill ``batch`` random prompts in both engines, then time one greedy decode step of each."""
    per_seq = -(-(s.prompt_len + s.warmup + s.repeats + 2) // s.block_size)
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, s.model.vocab_size, (batch, s.prompt_len), generator=gen)
    tables = [tuple(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    entries = tuple(BatchEntry(str(b), tuple(prompts[b].tolist()), 0, tables[b], True, GREEDY) for b in range(batch))
    with torch.inference_mode():
        tokens = runner.run(BatchPlan(0, entries), None, sample=True).tokens
    state = {"pos": s.prompt_len, "tokens": tokens, "step": 1}

    def ours_step() -> None:
        step = tuple(BatchEntry(str(b), (state["tokens"][str(b)],), state["pos"], tables[b], False, GREEDY,
                                state["step"]) for b in range(batch))
        with torch.inference_mode():
            state["tokens"] = runner.run(BatchPlan(state["step"], step), None, sample=True).tokens
        state["pos"] += 1
        state["step"] += 1

    ours = timed(ours_step, s)
    with torch.inference_mode():
        out = hf(input_ids=prompts.to(s.device), use_cache=True)
    hf_state = {"cache": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def hf_step() -> None:
        with torch.inference_mode():
            o = hf(input_ids=hf_state["next"], past_key_values=hf_state["cache"], use_cache=True)
        hf_state["cache"], hf_state["next"] = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)

    theirs = timed(hf_step, s)
    return {"batch": batch, "ours_ms": round(ours * 1e3, 2), "hf_ms": round(theirs * 1e3, 2),
            "floor_ms": round(floor_s * 1e3, 4), "ours_over_floor": round(ours / floor_s, 2),
            "hf_over_ours": round(theirs / ours, 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a rehearsal)")
    parser.add_argument("--skip-engine", action="store_true", help="kernels and swaps only")
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke else GPU
    if s.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke for the CPU rehearsal")
    started = time.perf_counter()
    result: dict[str, Any] = {"mode": "smoke" if args.smoke else "gpu", "env": environment(s)}
    print("environment:", json.dumps(result["env"]))
    result["ceilings"] = {k: round(v, 2) for k, v in ceilings(s).items()}
    print("ceilings (GB/s, measured):", result["ceilings"])
    result["paged_attention"] = paged_attention(s, result["ceilings"]["copy_GBps"])
    print(f"\n{'batch':>6} {'context':>8} {'us':>10} {'GB/s':>8} {'of copy':>8}   paged decode attention")
    for r in result["paged_attention"]:
        print(f"{r['batch']:>6} {r['context']:>8} {r['us']:>10} {r['GBps']:>8} {r['of_copy']:>8}")
    result["swaps"] = swaps(s, result["ceilings"])
    print("\nswaps (out + in, KV store):", result["swaps"])
    if not args.skip_engine:
        result["engine"] = engine(s, result["ceilings"]["copy_GBps"])
        print(f"\n{'batch':>6} {'ours ms':>9} {'HF ms':>9} {'floor ms':>9} {'ours/floor':>11} {'HF/ours':>8}"
              "   decode step")
        for r in result["engine"]:
            print(f"{r['batch']:>6} {r['ours_ms']:>9} {r['hf_ms']:>9} {r['floor_ms']:>9} "
                  f"{r['ours_over_floor']:>11} {r['hf_over_ours']:>8}")
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
