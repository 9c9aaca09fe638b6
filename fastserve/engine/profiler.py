"""The job profiler (paper §3.2): measure iteration times offline, write a profile JSON: ``t_init(s)``
over prompt lengths, ``t_dec(b)`` over batch sizes, and one KV block's swap cost, which the scheduler
interpolates to place jobs (skip-join) and size quanta (q1 = t_dec).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, SwapCommand, blocks_for
from fastserve.worker.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROMPT_LENS = (1, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
#: Context each decoding sequence has when t_dec is measured (ShareGPT's mean prompt is ~160).
DECODE_CONTEXT = 128
DEFAULT_REPEATS = 5
SWAP_PROBE_BLOCKS = 32
#: The GEMM paths profiled: chosen as a server chooses them (``engine.gemm_choice``'s default).
SERVING_GEMM_CHOICE = "cached"
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def hardware_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name().lower().replace("nvidia ", "").split()[0]
    return "cpu"


Progress = Callable[[str], None] | None


def _report(progress: Progress, line: str) -> None:
    if progress is not None:
        progress(line)


class _GpuMemory:
    """CUDA weights (held after loading, less our KV pool) and peak activations (the peak above)."""

    def __init__(self, device: str, pool_bytes: int) -> None:
        self.enabled = device.startswith("cuda")
        if not self.enabled:
            return
        import torch

        torch.cuda.synchronize()
        self.loaded = torch.cuda.memory_allocated()
        self.pool_bytes = pool_bytes
        torch.cuda.reset_peak_memory_stats()

    def read(self) -> dict[str, int]:
        import torch

        torch.cuda.synchronize()
        return {"weight_bytes": self.loaded - self.pool_bytes,
                "activation_bytes": torch.cuda.max_memory_allocated() - self.loaded}


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: allocator, kernel caches
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_t_init(ex: InProcessExecutor, prompt_lens: Sequence[int], repeats: int,
                   progress: Progress = None) -> list[float]:
    bs = ex.kv.block_size
    out = []
    for s in prompt_lens:
        entry = BatchEntry("p", tuple(2 + (i % 1000) for i in range(s)), 0,
                           tuple(range(blocks_for(s, bs))), True, GREEDY)
        plan = BatchPlan(0, (entry,))
        out.append(_median_seconds(partial(ex.execute, plan), repeats))
        _report(progress, f"t_init({s:5d}) = {out[-1] * 1e3:8.2f} ms")
    return out


def measure_t_dec(ex: InProcessExecutor, batch_sizes: Sequence[int], repeats: int,
                  progress: Progress = None) -> list[float]:
    bs = ex.kv.block_size
    per_seq = blocks_for(DECODE_CONTEXT + 1, bs)
    out = []
    for b in batch_sizes:
        entries = tuple(
            BatchEntry(f"d{j}", (7,), DECODE_CONTEXT, tuple(range(j * per_seq, (j + 1) * per_seq)),
                       False, GREEDY, 1)
            for j in range(b)
        )
        out.append(_median_seconds(partial(ex.execute, BatchPlan(0, entries)), repeats))
        _report(progress, f"t_dec(b={b:3d}) = {out[-1] * 1e3:8.2f} ms")
    return out


def measure_swap(ex: InProcessExecutor, repeats: int) -> float:
    n = min(SWAP_PROBE_BLOCKS, ex.kv.num_device_blocks, ex.kv.num_host_blocks)
    ids = tuple(range(n))

    def round_trip() -> None:
        ex.kv.swap(SwapCommand("out", "probe", ids, ids)).wait()
        ex.kv.swap(SwapCommand("in", "probe", ids, ids)).wait()

    return _median_seconds(round_trip, repeats) / (2 * n)


def profile(model: str, dtype: str, device: str, block_size: int,
            prompt_lens: Sequence[int], batch_sizes: Sequence[int], repeats: int,
            progress: Progress = None) -> dict[str, Any]:
    """Measure the grid; on a GPU also ``memory`` (weights and activations: what the KV pool is
    sized from, as vLLM's profile run does)."""
    need = max(blocks_for(max(prompt_lens), block_size),
               max(batch_sizes) * blocks_for(DECODE_CONTEXT + 1, block_size))
    _report(progress, f"loading {Path(model).name} ({dtype}, {device}) to profile "
                      f"{len(prompt_lens)} prompt lengths and {len(batch_sizes)} batch sizes")
    ex = InProcessExecutor(ModelSpec(model, num_device_blocks=need, num_host_blocks=SWAP_PROBE_BLOCKS,
                           block_size=block_size, dtype=dtype, device=device, gemm_choice=SERVING_GEMM_CHOICE))
    memory = _GpuMemory(device, need * ex.kv.bytes_per_block)
    try:
        result = {
            "model": Path(model).name,
            "hardware": hardware_name(device),
            "host": platform.node(),
            "tp": 1,
            "pp": 1,
            "dtype": dtype,
            "block_size": block_size,
            "decode_context": DECODE_CONTEXT,
            "t_init": {"prompt_lens": list(prompt_lens),
                       "seconds": measure_t_init(ex, prompt_lens, repeats, progress)},
            "t_dec": {"batch_sizes": list(batch_sizes),
                      "seconds": measure_t_dec(ex, batch_sizes, repeats, progress)},
            "swap": {"bytes_per_block": ex.kv.bytes_per_block,
                     "seconds_per_block": measure_swap(ex, repeats)},
        }
        if memory.enabled:
            result["memory"] = memory.read()
    finally:
        ex.close()
    return result


def profile_path(result: dict[str, Any], out_dir: Path) -> Path:
    name = f"{result['model']}-{result['hardware']}-tp{result['tp']}-pp{result['pp']}.json"
    return out_dir / name


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", "--config", dest="model", default=str(ROOT / "config/models/opt-125m"),
                        help="folder with the model's config.json (weights are dummy)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=list(DEFAULT_PROMPT_LENS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "config/profiles")
    args = parser.parse_args(argv)
    result = profile(args.model, args.dtype, args.device, args.block_size,
                     sorted(args.prompt_lens), sorted(args.batch_sizes), args.repeats)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = profile_path(result, args.out_dir)
    path.write_text(json.dumps(result, indent=2) + "\n")
    for s, t in zip(result["t_init"]["prompt_lens"], result["t_init"]["seconds"], strict=True):
        print(f"t_init({s:5d}) = {t * 1e3:8.2f} ms")
    for b, t in zip(result["t_dec"]["batch_sizes"], result["t_dec"]["seconds"], strict=True):
        print(f"t_dec(b={b:3d}) = {t * 1e3:8.2f} ms")
    print(f"swap: {result['swap']['seconds_per_block'] * 1e6:.1f} us per block "
          f"of {result['swap']['bytes_per_block']} B")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
