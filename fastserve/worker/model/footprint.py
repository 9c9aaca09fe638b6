"""What one rank of a served stage holds, from the config alone: parameter shapes (named as the
stage modules build them; ``tests/unit/test_plan.py`` checks them against the real modules), weight
bytes and KV block bytes. No torch: the dry-run planner reads it without building a model.
"""

from __future__ import annotations

from math import prod

from fastserve.worker.model.config import POSITION_OFFSET, ModelConfig, OPTConfig
from fastserve.worker.model.shard import StageShard

Shapes = dict[str, tuple[int, ...]]


def _linear(name: str, rows: int, cols: int, bias: bool) -> Shapes:
    out: Shapes = {f"{name}.weight": (rows, cols)}
    if bias:
        out[f"{name}.bias"] = (rows,)
    return out


def _opt_shapes(config: OPTConfig, shard: StageShard) -> Shapes:
    h, tp, bias = config.hidden_size, shard.tp_size, config.enable_bias
    local = config.num_attention_heads // tp * config.head_dim
    norm = (h,) if config.layer_norm_elementwise_affine else None
    layer: Shapes = {}
    for proj in ("q_proj", "k_proj", "v_proj"):
        layer |= _linear(f"self_attn.{proj}", local, h, bias)
    layer |= _linear("self_attn.out_proj", h, local, bias)
    if norm:
        layer |= {"self_attn_layer_norm.weight": norm, "self_attn_layer_norm.bias": norm}
    layer |= _linear("fc1", config.ffn_dim // tp, h, bias) | _linear("fc2", h, config.ffn_dim // tp, bias)
    if norm:
        layer |= {"final_layer_norm.weight": norm, "final_layer_norm.bias": norm}
    shapes: Shapes = {}
    if shard.is_first or shard.is_last:   # the last stage holds it as the tied LM head
        shapes["embed_tokens.weight"] = (config.vocab_size, config.proj_dim)
    if shard.is_first:
        shapes["embed_positions.weight"] = (config.max_position_embeddings + POSITION_OFFSET, h)
        if config.proj_dim != h:
            shapes["project_in.weight"] = (h, config.proj_dim)
    shapes |= {f"layers.{i}.{k}": v for i in range(shard.num_layers) for k, v in layer.items()}
    if shard.is_last:
        if config.has_final_layer_norm and norm:
            shapes |= {"final_layer_norm.weight": norm, "final_layer_norm.bias": norm}
        if config.proj_dim != h:
            shapes["project_out.weight"] = (config.proj_dim, h)
    return shapes


def _llama_shapes(config: ModelConfig, shard: StageShard) -> Shapes:
    from fastserve.worker.model.llama_config import LlamaConfig

    assert isinstance(config, LlamaConfig)
    h, tp = config.hidden_size, shard.tp_size
    q = config.num_attention_heads // tp * config.head_dim
    kv = config.kv_heads_per_rank(tp) * config.head_dim
    mlp = config.intermediate_size // tp
    layer: Shapes = {"input_layernorm.weight": (h,)}
    layer |= _linear("self_attn.q_proj", q, h, config.qkv_bias)
    layer |= _linear("self_attn.k_proj", kv, h, config.qkv_bias)
    layer |= _linear("self_attn.v_proj", kv, h, config.qkv_bias)
    layer |= _linear("self_attn.o_proj", h, q, config.o_proj_bias)
    layer["post_attention_layernorm.weight"] = (h,)
    layer |= _linear("mlp.gate_proj", mlp, h, config.mlp_bias) | _linear("mlp.up_proj", mlp, h, config.mlp_bias)
    layer |= _linear("mlp.down_proj", h, mlp, config.mlp_bias)
    shapes: Shapes = {}
    if shard.is_first or (shard.is_last and config.tie_word_embeddings):
        shapes["embed_tokens.weight"] = (config.vocab_size, h)
    shapes |= {f"layers.{i}.{k}": v for i in range(shard.num_layers) for k, v in layer.items()}
    if shard.is_last:
        shapes["norm.weight"] = (h,)
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def stage_weight_shapes(config: ModelConfig, shard: StageShard) -> Shapes:
    """Every parameter one rank of ``shard`` holds, by its name in the stage module."""
    if config.architecture == "opt":
        assert isinstance(config, OPTConfig)
        return _opt_shapes(config, shard)
    if config.architecture == "llama":
        return _llama_shapes(config, shard)
    raise ValueError(f"no weight layout for architecture {config.architecture!r}")


def stage_weight_bytes(config: ModelConfig, shard: StageShard, dtype_bytes: int) -> int:
    """Replicated pieces included."""
    return sum(prod(s) for s in stage_weight_shapes(config, shard).values()) * dtype_bytes


def rank_kv_bytes_per_block(config: ModelConfig, shard: StageShard, block_size: int, dtype_bytes: int) -> int:
    """K and V of the rank's layers and of the KV heads it stores."""
    return 2 * shard.num_layers * config.kv_heads_per_rank(shard.tp_size) * config.head_dim * block_size * dtype_bytes


#: Logits are sampled in float32 whatever the model's dtype.
LOGIT_BYTES = 4
#: Live logit-sized tensors while sampling: the logits and their softmax.
LOGIT_COPIES = 2
#: Hidden-width tensors live in a layer: the residual, its normed copy, the output to add.
HIDDEN_COPIES = 3


def rank_activation_bytes(config: ModelConfig, shard: StageShard, tokens: int, max_seqs: int,
                          dtype_bytes: int) -> int:
    """Peak activations estimate: one layer's live tensors (layers free their predecessor's), plus
    on the last stage the float32 logits of ``max_seqs`` sampling jobs."""
    shapes = stage_weight_shapes(config, StageShard(0, 1, config.num_hidden_layers,
                                                    shard.tp_rank, shard.tp_size))
    proj = ("q_proj", "k_proj", "v_proj")
    qkv = sum(s[0] for n, s in shapes.items() if n.endswith(".weight") and any(p in n for p in proj))
    up = ("fc1.weight", "gate_proj.weight", "up_proj.weight")
    mlp = sum(s[0] for n, s in shapes.items() if n.endswith(up))
    per_token = (HIDDEN_COPIES * config.hidden_size + qkv + mlp) * dtype_bytes
    logits = LOGIT_COPIES * max_seqs * config.vocab_size * LOGIT_BYTES if shard.is_last else 0
    return tokens * per_token + logits
