"""The profiler's GPU memory figures, which ``fastserve serve MODEL_DIR`` sizes a GPU's KV pool from
(``fastserve.config_folder.gpu_kv_blocks``): the weights' bytes and one iteration's peak activations.

Runs only where CUDA exists (skipped otherwise), no Ray: a small random LLaMA config, dummy weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastserve.engine.profiler import profile
from fastserve.worker.model.llama_config import LlamaConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TINY = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                   eos_token_id=2, name="tiny-llama-profile")
BF16_BYTES = 2


def parameter_count(c: LlamaConfig) -> int:
    """LLaMA's parameters: embeddings and an untied head, per layer q/k/v/o, gate/up/down and two
    norms, the final norm."""
    attention = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return 2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * (attention + mlp + 2 * c.hidden_size) \
        + c.hidden_size


def test_a_gpu_profile_records_the_weights_and_the_peak_activations(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY.to_hf_dict(), "model_type": "llama"}))
    result = profile(str(tmp_path), "bfloat16", "cuda", 16, prompt_lens=[1, 256], batch_sizes=[1, 4], repeats=1)
    memory = result["memory"]
    # At least every parameter in bf16 (buffers such as rotary tables may add to it).
    assert memory["weight_bytes"] >= parameter_count(TINY) * BF16_BYTES
    # A 256-token prefill holds at least its hidden states in bf16 beyond the weights.
    assert memory["activation_bytes"] >= 256 * TINY.hidden_size * BF16_BYTES
