"""The tiny random OPT and its job set that the pipeline tests and the engine's end-to-end test
share: eight prompts of 2 to 21 tokens with their output lengths, a block size and pool sizes
that force swaps. Imports no ray.
"""

from __future__ import annotations

from fastserve.worker.model.config import OPTConfig

TINY = OPTConfig(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 ffn_dim=128, max_position_embeddings=256, name="tiny")
SEED = 0
BLOCK_SIZE = 4
#: No single job needs more than 8 blocks at its longest; 16 forces swaps under load.
SMALL_DEVICE_POOL = 16
HOST_POOL = 64
PROMPTS = [[2, 11, 57, 100, 7], [2, 300, 4], [2, *range(20, 40)], [2, 99, 98, 97, 96, 95, 94, 93],
           [2, 5], [2, *range(150, 162)], [2, 42, 43], [2, *range(60, 70)]]
MAX_TOKENS = [14, 20, 10, 16, 18, 12, 17, 13]
