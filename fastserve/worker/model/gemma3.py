"""Gemma 3's text decoder as one served stage and tensor-parallel shard: ``llama``'s machinery with
Gemma's layer (scaled embedding, ``1 + weight`` RMSNorms, per-head q/k norms, post-norms, gelu-tanh
MLP, sliding and global rotary bases, soft-capped logits). Names mirror transformers' ``Gemma3TextModel``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from fastserve.worker.model.attention import paged_self_attention
from fastserve.worker.model.batch import ForwardBatch
from fastserve.worker.model.gemm_choice import GemmPolicy
from fastserve.worker.model.gemma3_config import FULL, SLIDING, Gemma3Config
from fastserve.worker.model.layout import WeightLayout
from fastserve.worker.model.linear import (
    MergedLinear,
    PackedWeight,
    ServingLinear,
    multiply_widened,
    pack_linears,
    place_on_huge_pages,
)
from fastserve.worker.model.llama import LLAMA_WEIGHTS, reduce_then_bias
from fastserve.worker.model.opt import AllReduce, no_reduce
from fastserve.worker.model.rope import Rotary
from fastserve.worker.model.shard import StageShard

#: The LM head is the tied embedding. Norm weights are offsets from 1: a dummy model's are zeros.
GEMMA3_WEIGHTS = replace(LLAMA_WEIGHTS, skipped=("lm_head.weight",), ones=(),
                         zeros=(".bias", "norm.weight", "layernorm.weight"))


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight`` in float32, cast back last: transformers', bit for bit."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Gemma3Config, shard: StageShard, all_reduce: AllReduce, window: int | None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // shard.tp_size
        self.num_kv_heads = config.kv_heads_per_rank(shard.tp_size)
        self.scale = config.attention_scale
        self.window = window
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = ServingLinear(config.hidden_size, q_width, bias=bias)
        self.k_proj = ServingLinear(config.hidden_size, kv_width, bias=bias)
        self.v_proj = ServingLinear(config.hidden_size, kv_width, bias=bias)
        self.o_proj = ServingLinear(q_width, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.qkv = MergedLinear(self.q_proj, self.k_proj, self.v_proj)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer_cache: torch.Tensor,
                cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x)
        q = Rotary.apply(self.q_norm(q.view(n, self.num_heads, self.head_dim)), cos, signed_sin)
        k = Rotary.apply(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, signed_sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        attn = paged_self_attention(q, k, v, layer_cache, batch, self.scale, self.window)
        out = self.o_proj.multiply(attn.reshape(n, -1), with_bias=False)
        return reduce_then_bias(out, self.o_proj, self.all_reduce)


class MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, config: Gemma3Config, shard: StageShard, all_reduce: AllReduce) -> None:
        super().__init__()
        local = config.intermediate_size // shard.tp_size
        self.gate_proj = ServingLinear(config.hidden_size, local, bias=False)
        self.up_proj = ServingLinear(config.hidden_size, local, bias=False)
        self.down_proj = ServingLinear(local, config.hidden_size, bias=False)
        self.gate_up = MergedLinear(self.gate_proj, self.up_proj)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.all_reduce(self.down_proj.multiply(F.gelu(gate, approximate="tanh") * up, with_bias=False))


class DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, shard: StageShard, all_reduce: AllReduce, layer: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer]
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Attention(config, shard, all_reduce, config.window(layer))
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = MLP(config, shard, all_reduce)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer_cache: torch.Tensor,
                cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), batch, layer_cache, cos, signed_sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Stage(nn.Module):
    """One pipeline stage × one tensor-parallel rank of a Gemma 3 text model."""

    #: The LM head packed for CPU GEMMs (last stage, after ``pack_linear_weights``).
    _head_packed: PackedWeight | None = None

    def __init__(self, config: Gemma3Config, shard: StageShard | None = None,
                 all_reduce: AllReduce = no_reduce) -> None:
        super().__init__()
        shard = shard or StageShard.whole(config)
        shard.check(config)
        if not config.tie_word_embeddings:
            raise ValueError("Gemma 3's LM head is its embedding; tie_word_embeddings=false is not served")
        self.config = config
        self.shard = shard
        self.rotary = {SLIDING: Rotary(config.head_dim, config.local_rope_theta, config.local_rope_scaling),
                       FULL: Rotary(config.head_dim, config.global_rope_theta, config.global_rope_scaling)}
        # Rounded to the weights' dtype at use, as transformers does.
        self.embed_scale = torch.tensor(config.hidden_size**0.5)
        if shard.is_first or shard.is_last:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, shard, all_reduce, i)
                                    for i in range(shard.layer_start, shard.layer_end))
        if shard.is_last:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def num_local_heads(self) -> int:
        return self.config.num_attention_heads // self.shard.tp_size

    @property
    def num_local_kv_heads(self) -> int:
        return self.config.kv_heads_per_rank(self.shard.tp_size)

    @property
    def weight_layout(self) -> WeightLayout:
        return GEMMA3_WEIGHTS

    def kv_rows(self) -> tuple[int, int]:
        return self.config.kv_rows(self.shard.tp_rank, self.shard.tp_size)

    def pack_linear_weights(self, policy: GemmPolicy | None = None) -> int:
        """Prepack the decoder linears and the tied head for CPU GEMMs; how many were packed."""
        head = self.embed_tokens.weight if self.shard.is_last else None
        packed, self._head_packed = pack_linears(self.layers, policy, head)
        place_on_huge_pages(self.layers, self._head_packed)
        return packed

    def forward(self, batch: ForwardBatch, cache: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's layers over ``hidden`` (None: embed the tokens); layer ``i`` uses ``cache[:, i]``."""
        if hidden is None:
            weight = self.embed_tokens.weight
            x = self.embed_tokens(batch.input_ids) * self.embed_scale.to(device=weight.device, dtype=weight.dtype)
        else:
            x = hidden
        angles = {kind: rotary.cos_sin(batch.positions, x.dtype) for kind, rotary in self.rotary.items()}
        for i, layer in enumerate(cast(list[DecoderLayer], self.layers)):
            x = layer(x, batch, cache[:, i], *angles[layer.layer_type])
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, tied LM head and soft cap: float32 logits."""
        logits = multiply_widened(self.norm(hidden), self.embed_tokens.weight, self._head_packed)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
