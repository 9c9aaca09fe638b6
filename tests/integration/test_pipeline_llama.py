"""The Ray pipeline serving a LLaMA-family model: stage workers size their KV store by the KV heads
they hold, and TP/PP splits of the seeded dummy weights hold the very model the in-process
executor runs — the same greedy tokens for the same plans, with swaps on every worker.

Two layouts: TP 2 × PP 2 with 2 KV heads (split, one per rank) and TP 2 with 1 KV head
(replicated on both ranks). Reuses ``tests/integration/test_pipeline.py``'s plan driver.
"""

from __future__ import annotations

import asyncio

import pytest

from fastserve.worker.model.llama_config import LlamaConfig, RopeScaling
from fastserve.worker.spec import EngineSpec, ModelSpec, ParallelSpec
from tests.harness.pipeline import (
    BLOCK_SIZE,
    HOST_POOL,
    SEED,
    SMALL_DEVICE_POOL,
    WORKER_THREADS,
    in_process_run,
    pipeline_run,
    wait_no_live_actors,
)

pytestmark = [pytest.mark.slow]

ROPE = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64)
GQA = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=500000.0, rope_scaling=ROPE, name="tiny-llama-gqa")
MQA = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                  qkv_bias=True, tie_word_embeddings=True, model_type="qwen2", name="tiny-qwen2-mqa")


@pytest.mark.parametrize(("config", "tp", "pp"), [(GQA, 2, 2), (MQA, 2, 1)], ids=["gqa-tp2-pp2", "mqa-tp2"])
def test_llama_pipeline_matches_in_process_with_swaps(ray_local: None, config: LlamaConfig, tp: int, pp: int) -> None:
    reference = in_process_run(SMALL_DEVICE_POOL, config)
    assert reference.swaps["out"] > 0 and reference.swaps["in"] > 0, "the small pool should force swaps"
    spec = EngineSpec(ModelSpec(config, SMALL_DEVICE_POOL, HOST_POOL, block_size=BLOCK_SIZE, seed=SEED,
                                torch_threads=WORKER_THREADS),
                      ParallelSpec(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    run = asyncio.run(pipeline_run(spec))
    assert wait_no_live_actors() == [], "shutdown left actors behind"
    assert run.plans == reference.plans
    assert run.tokens == reference.tokens
    assert len(run.stats) == tp * pp
    for s in run.stats:
        assert s["swapped_out_blocks"] > 0 and s["swapped_in_blocks"] > 0, s
