"""Paper-scale cost profiles, derived from the FastServe paper's own numbers.

Figure 5 (OPT-2.7B on one A100), §4.2 (OPT-175B on 16 A100s) and OPT's shapes become
``config/profiles/opt-*-a100-*`` JSONs: ``python -m fastserve.bench.sim.paper_profiles``. Each
constant is explained in ``fastserve/bench/sim/ASSUMPTIONS.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
DIMS_CSV = ROOT / "config" / "models" / "opt_model_dims.csv"
PROFILES_DIR = ROOT / "config" / "profiles"

GB = 1e9
GIB = 2**30
FP16_BYTES = 2

#: Figure 5 (OPT-2.7B, one A100): first-iteration time at two prompt lengths, and decode time.
ANCHOR_SMALL_MODEL = "opt-2.7b"
ANCHOR_SMALL_T_INIT: dict[int, float] = {128: 0.010, 1024: 0.090}
ANCHOR_SMALL_T_DEC = 0.002
#: §4.2: OPT-175B on 16 A100s (TP 8 x PP 2): decode iteration ~60 ms; a 512-token job's KV
#: (2.3 GB) swaps over PCIe 4.0 x16 in ~36 ms.
ANCHOR_LARGE_MODEL = "opt-175b"
ANCHOR_LARGE_TP = 8
ANCHOR_LARGE_T_DEC = 0.060
ANCHOR_SWAP_TOKENS = 512
ANCHOR_SWAP_SECONDS = 0.036
#: One direction of one PCIe 4.0 x16 link; §4.2's 64 GB/s is both directions, and a swap moves one way.
PCIE4_X16_BYTES_PER_S = 31.5e9

GPU_MEMORY_GIB = 80.0
#: Fraction of device memory the engine may use (vLLM's default gpu_memory_utilization).
GPU_MEMORY_UTILIZATION = 0.9
#: Per-GPU workspace for activations of a 2,048-token batch, kept out of the KV pool.
ACTIVATION_RESERVE_GIB = 2.0
#: Pinned host memory per GPU given to the host KV pool (a DGX A100 has 1-2 TB for 8 GPUs).
HOST_SWAP_GIB_PER_GPU = 64.0
BLOCK_SIZE = 16
MAX_BATCH_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 2048
#: Context of every sequence when t_dec(b) is quoted (the paper's 512-token KV example).
DECODE_CONTEXT = 512

PROMPT_LENS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class ModelDims:
    name: str
    hidden: int
    layers: int
    params: int
    kv_bytes_per_token: int   # fp16, all layers, K and V

    @property
    def weight_bytes(self) -> int:
        return self.params * FP16_BYTES


@dataclass(frozen=True)
class Setting:
    """One of the paper's serving configurations."""

    model: str
    tp: int
    pp: int

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def file_name(self) -> str:
        return f"{self.model}-a100-tp{self.tp}-pp{self.pp}.json"


#: The paper's three evaluation settings (Table 2), plus OPT-2.7B for Figures 5 and 8.
PAPER_SETTINGS: tuple[Setting, ...] = (
    Setting("opt-2.7b", 1, 1),
    Setting("opt-13b", 1, 1),
    Setting("opt-66b", 4, 1),
    Setting("opt-175b", 8, 2),
)


def load_dims(path: Path = DIMS_CSV) -> dict[str, ModelDims]:
    with path.open(newline="", encoding="utf-8") as handle:
        return {
            row["model"]: ModelDims(row["model"], int(row["hidden_size"]), int(row["num_hidden_layers"]),
                                    int(row["params_computed"]), int(row["kv_cache_bytes_per_token_fp16"]))
            for row in csv.DictReader(handle)
        }


def prefill_flops(dims: ModelDims, prompt_len: int) -> float:
    """Forward FLOPs of a first iteration: 2·params per token plus QKᵀ and AV (4·L·h·s²)."""
    dense = 2.0 * dims.params * prompt_len
    attention = 4.0 * dims.layers * dims.hidden * prompt_len**2
    return dense + attention


@dataclass(frozen=True)
class CostParams:
    """What the anchors pin down; shared by every setting."""

    prefill_flops_per_s: float   # effective per-GPU FLOP/s of a first iteration
    decode_exponent: float       # t_dec(1) ∝ (params / TP)^k between the two decode anchors
    swap_bytes_per_s: float      # host bandwidth the paper's swap example implies (all GPUs)


def fit_cost_params(dims: dict[str, ModelDims]) -> CostParams:
    small, large = dims[ANCHOR_SMALL_MODEL], dims[ANCHOR_LARGE_MODEL]
    flops = sum(prefill_flops(small, s) for s in ANCHOR_SMALL_T_INIT)
    seconds = sum(ANCHOR_SMALL_T_INIT.values())
    x_small = small.params
    x_large = large.params / ANCHOR_LARGE_TP
    exponent = math.log(ANCHOR_LARGE_T_DEC / ANCHOR_SMALL_T_DEC) / math.log(x_large / x_small)
    swap_bw = ANCHOR_SWAP_TOKENS * large.kv_bytes_per_token / ANCHOR_SWAP_SECONDS
    return CostParams(flops / seconds, exponent, swap_bw)


def swap_bytes_per_s(setting: Setting, params: CostParams) -> float:
    """The §4.2 anchor's swap rate, never more than the setting's links carry one way."""
    return min(params.swap_bytes_per_s, setting.num_gpus * PCIE4_X16_BYTES_PER_S)


def t_dec_single(dims: ModelDims, tp: int, small: ModelDims, params: CostParams) -> float:
    """Decode time at batch 1: power law in the weights one token's path reads per GPU."""
    return ANCHOR_SMALL_T_DEC * ((dims.params / tp) / small.params) ** params.decode_exponent


def t_dec_batch(dims: ModelDims, t1: float, batch: int) -> float:
    """Memory-bound decode: each extra sequence adds its KV reads on top of the weights."""
    per_seq = DECODE_CONTEXT * dims.kv_bytes_per_token / dims.weight_bytes
    return t1 * (1.0 + (batch - 1) * per_seq)


def t_init(dims: ModelDims, tp: int, s: int, t1: float, small: ModelDims, params: CostParams) -> float:
    """First iteration: compute-bound FLOPs over TP GPUs, plus the part of a decode iteration that
    is not weight reading (all-reduce, pipeline hops, launches), never less than a decode."""
    weight_part = ANCHOR_SMALL_T_DEC * (dims.params / tp) / small.params
    overhead = max(t1 - weight_part, 0.0)
    return max(prefill_flops(dims, s) / (tp * params.prefill_flops_per_s) + overhead, t1)


def pool_blocks(dims: ModelDims, setting: Setting) -> tuple[int, int, int]:
    """(device blocks, host blocks, bytes per logical block summed over all GPUs)."""
    block_bytes = BLOCK_SIZE * dims.kv_bytes_per_token
    per_gpu_block = block_bytes / setting.num_gpus
    free_gib = GPU_MEMORY_GIB * GPU_MEMORY_UTILIZATION - dims.weight_bytes / setting.num_gpus / GIB
    free_gib -= ACTIVATION_RESERVE_GIB
    if free_gib <= 0:
        raise ValueError(f"{setting.model} does not fit {setting.num_gpus} GPUs")
    device = int(free_gib * GIB // per_gpu_block)
    host = int(HOST_SWAP_GIB_PER_GPU * GIB // per_gpu_block)
    return device, host, block_bytes


def build_profile(setting: Setting, dims: dict[str, ModelDims], params: CostParams) -> dict[str, Any]:
    d, small = dims[setting.model], dims[ANCHOR_SMALL_MODEL]
    t1 = t_dec_single(d, setting.tp, small, params)
    device, host, block_bytes = pool_blocks(d, setting)
    return {
        "model": setting.model,
        "hardware": "a100",
        "host": "derived",
        "tp": setting.tp,
        "pp": setting.pp,
        "dtype": "float16",
        "block_size": BLOCK_SIZE,
        "decode_context": DECODE_CONTEXT,
        "t_init": {"prompt_lens": list(PROMPT_LENS),
                   "seconds": [t_init(d, setting.tp, s, t1, small, params) for s in PROMPT_LENS]},
        "t_dec": {"batch_sizes": list(BATCH_SIZES),
                  "seconds": [t_dec_batch(d, t1, b) for b in BATCH_SIZES]},
        "swap": {"bytes_per_block": block_bytes,
                 "seconds_per_block": block_bytes / swap_bytes_per_s(setting, params)},
        "serving": {"gpus": setting.num_gpus, "gpu_memory_gib": GPU_MEMORY_GIB,
                    "num_device_blocks": device, "num_host_blocks": host,
                    "max_batch_size": MAX_BATCH_SIZE, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS},
        "source": "derived by fastserve/bench/sim/paper_profiles.py from the FastServe paper's Figure 5 "
                  "(OPT-2.7B) and §4.2 (OPT-175B) numbers and config/models/opt_model_dims.csv",
        "assumptions": assumption_lines(params),
    }


def assumption_lines(params: CostParams) -> list[str]:
    return [
        f"t_init(s) = FLOPs(s) / (TP x {params.prefill_flops_per_s / 1e12:.1f} TFLOP/s) + decode "
        "overhead; FLOPs = 2*params*s + 4*L*h*s^2; the FLOP rate fits OPT-2.7B's 10 ms @128 and "
        "90 ms @1024 (Fig. 5)",
        f"t_dec(1) = 2 ms x ((params/TP) / params(OPT-2.7B))^{params.decode_exponent:.3f}, the power "
        "law through OPT-2.7B's 2 ms and OPT-175B TP8xPP2's 60 ms",
        f"t_dec(b) = t_dec(1) x (1 + (b-1) x {DECODE_CONTEXT}-token KV bytes / weight bytes)",
        f"swap: {params.swap_bytes_per_s / GB:.1f} GB/s for a whole logical block (all GPUs), from "
        f"2.3 GB in 36 ms (§4.2), capped at {PCIE4_X16_BYTES_PER_S / GB:g} GB/s per GPU (one direction "
        "of a PCIe 4.0 x16 link)",
        f"A100 {GPU_MEMORY_GIB:g} GiB x {GPU_MEMORY_UTILIZATION} - weights/GPU - "
        f"{ACTIVATION_RESERVE_GIB:g} GiB activations = device KV pool; host pool "
        f"{HOST_SWAP_GIB_PER_GPU:g} GiB per GPU",
        "pipeline parallelism does not shorten one plan's latency; the simulator runs PP stages "
        "as a pipeline (per-stage time = iteration time / PP)",
    ]


def write_profiles(out_dir: Path = PROFILES_DIR, settings: Sequence[Setting] = PAPER_SETTINGS) -> list[Path]:
    dims = load_dims()
    params = fit_cost_params(dims)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for setting in settings:
        path = out_dir / setting.file_name
        path.write_text(json.dumps(build_profile(setting, dims, params), indent=2) + "\n")
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=PROFILES_DIR)
    args = parser.parse_args(argv)
    for path in write_profiles(args.out_dir):
        raw = json.loads(path.read_text())
        t_init, t_dec = raw["t_init"], raw["t_dec"]
        print(f"{path.name}: t_dec(1)={t_dec['seconds'][0] * 1e3:.1f} ms "
              f"t_dec(16)={t_dec['seconds'][4] * 1e3:.1f} ms "
              f"t_init(128)={t_init['seconds'][4] * 1e3:.1f} ms t_init(1024)={t_init['seconds'][7] * 1e3:.1f} ms "
              f"swap/block={raw['swap']['seconds_per_block'] * 1e6:.0f} us "
              f"blocks dev={raw['serving']['num_device_blocks']} host={raw['serving']['num_host_blocks']}")


if __name__ == "__main__":
    main()
