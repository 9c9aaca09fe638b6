"""The roofline's arithmetic (``fastserve.bench.roofline``) on a hand-made model, counted by hand; the CPU
feature parsing it labels figures with; and a smoke run of the command on that model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastserve.bench.roofline import StepCost, decode_step_cost, floor_s
from fastserve.kernels.cpu_features import bf16_flags, cpu_has_amx_bf16, cpu_has_bf16, cpu_name
from fastserve.worker.model.llama_config import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]
#: hidden 8, MLP 12, 2 layers, 2 query heads and 1 KV head of 4 dims, a vocabulary of 10.
TINY = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.mark.parametrize("tied", [True, False])
def test_decode_step_cost_by_hand(tied: bool) -> None:
    config = LlamaConfig(**TINY, tie_word_embeddings=tied)
    # Per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate 8x12 + up 8x12 + down 12x8 = 480 weights,
    # two norms of 8. Two layers: 960 linear + 32 norm; final norm 8; the head 10x8 = 80 (the
    # embedding when tied, lm_head otherwise: read once either way); 3 token rows of 8.
    # bf16: (960 + 32 + 8 + 80 + 3 x 8) x 2 bytes = 2,208.
    # KV: 3 sequences x 5 tokens x (2 [k, v] x 2 layers x 1 head x 4 dims x 2 bytes) = 480.
    # FLOPs: 3 x (2 x (960 + 80) + 4 x 2 layers x 2 heads x 4 dims x 5 tokens) = 3 x 2,400.
    cost = decode_step_cost(config, batch=3, context=5, dtype_bytes=2)
    assert cost == StepCost(weight_bytes=2208, kv_bytes=480, flops=7200)
    assert cost.bytes == 2688


def test_floor_is_the_slower_of_memory_and_compute() -> None:
    cost = StepCost(weight_bytes=2208, kv_bytes=480, flops=7200)
    assert floor_s(cost, bandwidth=1000.0, peak_flops=1000.0) == pytest.approx(7.2)     # compute
    assert floor_s(cost, bandwidth=1000.0, peak_flops=10000.0) == pytest.approx(2.688)  # memory


def test_fp32_reads_twice_the_bytes_and_does_the_same_flops() -> None:
    config = LlamaConfig(**TINY, tie_word_embeddings=True)
    half, full = (decode_step_cost(config, 3, 5, width) for width in (2, 4))
    assert (full.weight_bytes, full.kv_bytes, full.flops) == (2 * half.weight_bytes, 2 * half.kv_bytes, half.flops)


CPUINFO_ZEN4 = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14\n"
                "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16\n")
CPUINFO_AMX = "model name\t: Intel Xeon\nflags\t\t: avx512f amx_bf16 amx_tile avx512_bf16\n"
CPUINFO_OLD = "model name\t: Intel Xeon E5\nflags\t\t: sse2 avx avx2 fma\n"


def test_amx_bf16_is_read_from_the_flags() -> None:
    assert cpu_has_amx_bf16(CPUINFO_AMX)
    assert not cpu_has_amx_bf16(CPUINFO_ZEN4) and not cpu_has_amx_bf16(CPUINFO_OLD)
    assert not cpu_has_amx_bf16("flags\t\t: amx_bf16\n")   # the multiply without its tiles


def test_bf16_is_read_from_the_flags() -> None:
    assert bf16_flags(CPUINFO_ZEN4) == ("avx512_bf16",) and cpu_has_bf16(CPUINFO_ZEN4)
    assert bf16_flags(CPUINFO_AMX) == ("avx512_bf16", "amx_bf16")
    assert not cpu_has_bf16(CPUINFO_OLD) and not cpu_has_bf16("")
    assert cpu_name(CPUINFO_ZEN4) == "AMD EPYC 9R14 (avx512_bf16)"
    assert cpu_name(CPUINFO_OLD) == "Intel Xeon E5 (no native bf16)"


def test_roofline_smoke_run(tmp_path: Path) -> None:
    """The command end to end on a tiny random model: a table, then one JSON object whose floors
    are the arithmetic's at the machine it measured."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    shape = {**TINY, "vocab_size": 256}   # the benchmark's prompts use ids up to 129
    (folder / "config.json").write_text(json.dumps({**shape, "model_type": "llama", "tie_word_embeddings": True,
                                                    "max_position_embeddings": 256}))
    done = subprocess.run(
        [sys.executable, "-m", "fastserve.bench.roofline", "--model", str(folder), "--batch-sizes", "1", "2",
         "--dtypes", "float32", "--repeats", "1", "--stream-mib", "16", "--gemm-sides", "64"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(s["dtype"], s["batch"]) for s in result["steps"]] == [("float32", 1), ("float32", 2)]
    bandwidth, peak = max(result["bandwidth"].values()), result["gemm_flops"]["float32"]
    config = LlamaConfig(**shape, tie_word_embeddings=True)
    for step in result["steps"]:
        cost = decode_step_cost(config, step["batch"], result["context"], 4)
        assert (step["weight_bytes"], step["kv_bytes"], step["flops"]) == (cost.weight_bytes, cost.kv_bytes, cost.flops)
        assert step["floor_ms"] == pytest.approx(floor_s(cost, bandwidth, peak) * 1e3, rel=1e-3)
        assert step["ours_ms"] > 0 and step["hf_ms"] > 0
