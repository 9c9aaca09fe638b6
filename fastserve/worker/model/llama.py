"""LLaMA-family decoder (LLaMA 2/3, Mistral, Qwen2) as one served stage and tensor-parallel shard, with
Megatron-style TP (q/gate/up by columns, o/down by rows, then all-reduced). K/V heads split when ``tp``
divides them, else each rank keeps the one its query heads share. Names mirror HF's ``LlamaModel``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import nn

from fastserve import kernels
from fastserve.kernels import cpu_step
from fastserve.worker.model.attention import paged_self_attention
from fastserve.worker.model.batch import ForwardBatch
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
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.model.opt import AllReduce, no_reduce
from fastserve.worker.model.rope import Rotary
from fastserve.worker.model.shard import StageShard

LLAMA_WEIGHTS = WeightLayout(
    prefixes=("model.",),
    column_parallel=("self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj."),
    row_parallel=("self_attn.o_proj.weight", "mlp.down_proj.weight"),
    kv_parallel=("self_attn.k_proj.", "self_attn.v_proj."),
    ones=("norm.weight", "layernorm.weight"),
)
#: For a tied head: a saved ``lm_head.weight`` is the embedding, skipped.
LLAMA_TIED_WEIGHTS = replace(LLAMA_WEIGHTS, skipped=("lm_head.weight",))


class RMSNorm(nn.Module):
    """RMSNorm in float32, cast back before the scale (as HF does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)[1]

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``x + delta``, its norm) in one pass."""
        return kernels.rms_norm(x, self.weight, self.eps, delta)


def reduce_then_bias(out: torch.Tensor, layer: ServingLinear, all_reduce: AllReduce) -> torch.Tensor:
    """A row-parallel layer's partial sums reduced over the ranks; its bias added once."""
    out = all_reduce(out)
    return out if layer.bias is None else out + layer.bias


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, shard: StageShard, all_reduce: AllReduce) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // shard.tp_size
        self.num_kv_heads = config.kv_heads_per_rank(shard.tp_size)
        self.scale = self.head_dim**-0.5
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = ServingLinear(config.hidden_size, q_width, bias=config.qkv_bias)
        self.k_proj = ServingLinear(config.hidden_size, kv_width, bias=config.qkv_bias)
        self.v_proj = ServingLinear(config.hidden_size, kv_width, bias=config.qkv_bias)
        self.o_proj = ServingLinear(q_width, config.hidden_size, bias=config.o_proj_bias)
        self.qkv = MergedLinear(self.q_proj, self.k_proj, self.v_proj)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer_cache: torch.Tensor,
                cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x)
        q = Rotary.apply(q.view(n, self.num_heads, self.head_dim), cos, signed_sin)
        k = Rotary.apply(k.view(n, self.num_kv_heads, self.head_dim), cos, signed_sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        attn = paged_self_attention(q, k, v, layer_cache, batch, self.scale)
        out = self.o_proj.multiply(attn.reshape(n, -1), with_bias=False)
        return reduce_then_bias(out, self.o_proj, self.all_reduce)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, shard: StageShard, all_reduce: AllReduce) -> None:
        super().__init__()
        local = config.intermediate_size // shard.tp_size
        self.gate_proj = ServingLinear(config.hidden_size, local, bias=config.mlp_bias)
        self.up_proj = ServingLinear(config.hidden_size, local, bias=config.mlp_bias)
        self.down_proj = ServingLinear(local, config.hidden_size, bias=config.mlp_bias)
        self.gate_up = MergedLinear(self.gate_proj, self.up_proj)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        h = kernels.silu_mul(gate, up)
        return reduce_then_bias(self.down_proj.multiply(h, with_bias=False), self.down_proj, self.all_reduce)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, shard: StageShard, all_reduce: AllReduce) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard, all_reduce)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, shard, all_reduce)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer_cache: torch.Tensor,
                cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(self.input_layernorm(x), batch, layer_cache, cos, signed_sin))
        return x + self.mlp(h)


class LlamaStage(nn.Module):
    """One pipeline stage × one tensor-parallel rank of a LLaMA-family model."""

    #: The LM head packed for CPU GEMMs (last stage, after ``pack_linear_weights``).
    _head_packed: PackedWeight | None = None
    #: The layers as ``cpu_step`` runs them (where ``_step_run_layers`` allows).
    _step_run: tuple[cpu_step.LayerDims, tuple[cpu_step.StepLayer, ...]] | None = None

    def __init__(self, config: LlamaConfig, shard: StageShard | None = None,
                 all_reduce: AllReduce = no_reduce) -> None:
        super().__init__()
        shard = shard or StageShard.whole(config)
        shard.check(config)
        self.config = config
        self.shard = shard
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        if shard.is_first or (shard.is_last and config.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, shard, all_reduce) for _ in range(shard.num_layers))
        if shard.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def num_local_heads(self) -> int:
        return self.config.num_attention_heads // self.shard.tp_size

    @property
    def num_local_kv_heads(self) -> int:
        return self.config.kv_heads_per_rank(self.shard.tp_size)

    @property
    def weight_layout(self) -> WeightLayout:
        return LLAMA_TIED_WEIGHTS if self.config.tie_word_embeddings else LLAMA_WEIGHTS

    def kv_rows(self) -> tuple[int, int]:
        return self.config.kv_rows(self.shard.tp_rank, self.shard.tp_size)

    def pack_linear_weights(self, policy: GemmPolicy | None = None) -> int:
        """Prepack the decoder linears and head for CPU GEMMs; how many were packed."""
        head = self._head_weight() if self.shard.is_last else None
        packed, self._head_packed = pack_linears(self.layers, policy, head)
        place_on_huge_pages(self.layers, self._head_packed)
        self._step_run = self._step_run_layers()
        return packed

    def _step_run_layers(self) -> tuple[cpu_step.LayerDims, tuple[cpu_step.StepLayer, ...]] | None:
        """The layers' weights for ``cpu_step``; None under tensor parallelism (no all-reduce there), a
        linear unpacked or with a bias, shapes the kernels do not take, or kernels not built."""
        decoder_layers = [cast(DecoderLayer, m) for m in self.layers]
        if self.shard.tp_size != 1 or not decoder_layers or not cpu_step.available():
            return None
        layers = []
        for layer in decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o = attn.qkv.step_gemm(), attn.o_proj.step_gemm()
            gate_up, down = mlp.gate_up.step_gemm(), mlp.down_proj.step_gemm()
            if qkv is None or o is None or gate_up is None or down is None:
                return None
            layers.append(cpu_step.StepLayer(layer.input_layernorm.weight.detach(),
                                                 layer.post_attention_layernorm.weight.detach(),
                                                 qkv, o, gate_up, down))
        first = decoder_layers[0].self_attn
        dims = cpu_step.LayerDims(self.config.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                                     self.config.intermediate_size, self.config.rms_norm_eps, first.scale)
        return (dims, tuple(layers)) if cpu_step.fits(dims, layers) else None

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, batch: ForwardBatch, cache: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's layers over ``hidden`` (None: embed the tokens); layer ``i`` uses ``cache[:, i]``."""
        x = self.embed_tokens(batch.input_ids) if hidden is None else hidden
        cos, signed_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        run = self._step_run
        # The run's prefill attention needs the prefill rows' block tables.
        if (run is not None and x.dtype == cache.dtype == torch.bfloat16 and kernels.cpu_step_allowed()
                and (batch.num_prefill_tokens == 0 or batch.prefill_block_tables is not None)):
            prefill = None
            if batch.num_prefill_tokens and batch.prefill_block_tables is not None:
                prefill = cpu_step.PrefillRows.of(batch.prefill_cu_seqlens, batch.prefill_start_pos,
                                                  batch.prefill_block_tables)
            return cpu_step.run_layers(x.contiguous(), run[1], run[0], cache, cos, signed_sin, batch.slot_mapping,
                                       batch.decode_block_tables, batch.decode_context_lens, prefill)
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, cache[:, i], cos, signed_sin)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: float32 logits."""
        return multiply_widened(self.norm(hidden), self._head_weight(), self._head_packed)
