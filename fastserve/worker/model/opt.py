"""OPT decoder as one served stage and tensor-parallel shard. Megatron-style TP: q/k/v and fc1
column-parallel, out_proj and fc2 row-parallel then all-reduced (bias added once). Embeddings and the
tied LM head are replicated where needed, not vocab-parallel (OPT-175B's table is 1.2 GB in fp16).
Module names mirror HF's ``OPTDecoder``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastserve.worker.model.attention import paged_self_attention
from fastserve.worker.model.batch import ForwardBatch
from fastserve.worker.model.config import POSITION_OFFSET, OPTConfig
from fastserve.worker.model.gemm_choice import GemmPolicy
from fastserve.worker.model.layout import WeightLayout
from fastserve.worker.model.linear import (
    MergedLinear,
    PackedWeight,
    ServingLinear,
    multiply_widened,
    pack_linears,
    place_on_huge_pages,
)
from fastserve.worker.model.shard import StageShard

__all__ = ["AllReduce", "OPTStage", "StageShard"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]

OPT_WEIGHTS = WeightLayout(
    prefixes=("model.decoder.", "decoder.", "model."),
    column_parallel=("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "fc1."),
    row_parallel=("self_attn.out_proj.weight", "fc2.weight"),
    skipped=("lm_head.weight",),
    ones=("layer_norm.weight",),
)


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class Attention(nn.Module):
    def __init__(self, config: OPTConfig, shard: StageShard, all_reduce: AllReduce) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // shard.tp_size
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        local = self.num_heads * self.head_dim
        bias = config.enable_bias
        self.q_proj = ServingLinear(config.hidden_size, local, bias=bias)
        self.k_proj = ServingLinear(config.hidden_size, local, bias=bias)
        self.v_proj = ServingLinear(config.hidden_size, local, bias=bias)
        # Row-parallel: the bias is added once, after the all-reduce.
        self.out_proj = ServingLinear(local, config.hidden_size, bias=bias)
        self.qkv = MergedLinear(self.q_proj, self.k_proj, self.v_proj)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer_cache: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.qkv(x))
        attn = paged_self_attention(q, k, v, layer_cache, batch, self.scale)
        out = self.out_proj.multiply(attn.reshape(n, -1), with_bias=False)
        out = self.all_reduce(out)
        return out if self.out_proj.bias is None else out + self.out_proj.bias


class DecoderLayer(nn.Module):
    def __init__(self, config: OPTConfig, shard: StageShard, all_reduce: AllReduce) -> None:
        super().__init__()
        self.pre_norm = config.do_layer_norm_before
        affine = config.layer_norm_elementwise_affine
        self.self_attn = Attention(config, shard, all_reduce)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        ffn_local = config.ffn_dim // shard.tp_size
        self.fc1 = ServingLinear(config.hidden_size, ffn_local, bias=config.enable_bias)
        self.fc2 = ServingLinear(ffn_local, config.hidden_size, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer_cache: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, batch, layer_cache)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        h = self.fc2.multiply(F.relu(self.fc1(h)), with_bias=False)
        h = self.all_reduce(h)
        x = x + (h if self.fc2.bias is None else h + self.fc2.bias)
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTStage(nn.Module):
    """One pipeline stage × one tensor-parallel rank of an OPT model."""

    #: The tied LM head packed for CPU GEMMs (last stage, after ``pack_linear_weights``).
    _head_packed: PackedWeight | None = None

    def __init__(self, config: OPTConfig, shard: StageShard | None = None,
                 all_reduce: AllReduce = no_reduce) -> None:
        super().__init__()
        shard = shard or StageShard.whole(config)
        shard.check(config)
        self.config = config
        self.shard = shard
        if shard.is_first or shard.is_last:  # the last stage's tied LM head
            self.embed_tokens = nn.Embedding(config.vocab_size, config.proj_dim)
        if shard.is_first:
            self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET,
                                                config.hidden_size)
            if config.proj_dim != config.hidden_size:
                self.project_in = nn.Linear(config.proj_dim, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(config, shard, all_reduce) for _ in range(shard.num_layers))
        if shard.is_last:
            if config.has_final_layer_norm:
                self.final_layer_norm = nn.LayerNorm(
                    config.hidden_size, elementwise_affine=config.layer_norm_elementwise_affine)
            if config.proj_dim != config.hidden_size:
                self.project_out = nn.Linear(config.hidden_size, config.proj_dim, bias=False)

    @property
    def num_local_heads(self) -> int:
        return self.config.num_attention_heads // self.shard.tp_size

    @property
    def num_local_kv_heads(self) -> int:
        return self.num_local_heads

    @property
    def weight_layout(self) -> WeightLayout:
        return OPT_WEIGHTS

    def kv_rows(self) -> tuple[int, int]:
        rows = self.num_local_heads * self.config.head_dim
        return self.shard.tp_rank * rows, rows

    def pack_linear_weights(self, policy: GemmPolicy | None = None) -> int:
        """Prepack the decoder linears and head for CPU GEMMs; how many were packed."""
        head = self.embed_tokens.weight if self.shard.is_last else None
        packed, self._head_packed = pack_linears(self.layers, policy, head)
        place_on_huge_pages(self.layers, self._head_packed)
        return packed

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        if hasattr(self, "project_in"):
            x = self.project_in(x)
        return x + self.embed_positions(batch.positions + POSITION_OFFSET)

    def forward(self, batch: ForwardBatch, cache: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's layers over ``hidden`` (None: embed the tokens); layer ``i`` uses ``cache[:, i]``."""
        x = self.embed(batch) if hidden is None else hidden
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, cache[:, i])
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, projection and tied LM head: float32 logits."""
        if hasattr(self, "final_layer_norm"):
            hidden = self.final_layer_norm(hidden)
        if hasattr(self, "project_out"):
            hidden = self.project_out(hidden)
        return multiply_widened(hidden, self.embed_tokens.weight, self._head_packed)
