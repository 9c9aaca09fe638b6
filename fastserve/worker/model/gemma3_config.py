"""Gemma 3 text-model hyper-parameters (``model_type: gemma3_text``) from a ``config.json``: sliding or
global layers, each with its rotary base; fields we do not honour are refused by name. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastserve.worker.model.llama_config import GroupedKVHeads, RopeScaling, token_ids

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
#: transformers' Gemma 3 defaults where a config leaves the field out.
DEFAULT_LOCAL_THETA = 10_000.0
DEFAULT_GLOBAL_THETA = 1_000_000.0
DEFAULT_SLIDING_PATTERN = 6
GELU_TANH = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class Gemma3Config(GroupedKVHeads):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    query_pre_attn_scalar: int
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    local_rope_theta: float = DEFAULT_LOCAL_THETA
    global_rope_theta: float = DEFAULT_GLOBAL_THETA
    local_rope_scaling: RopeScaling | None = None
    global_rope_scaling: RopeScaling | None = None
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    hidden_activation: str = GELU_TANH
    bos_token_id: int = 2
    #: The first of the config's end tokens (the server stops on all of them).
    eos_token_id: int = 1
    model_type: str = "gemma3_text"
    name: str = "gemma3"

    def __post_init__(self) -> None:
        if self.hidden_activation != GELU_TANH:
            raise ValueError(f"Gemma 3's MLP is {GELU_TANH!r}; got hidden_activation {self.hidden_activation!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers; the model has "
                             f"{self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not served (known: {list(LAYER_TYPES)})")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ValueError(f"final_logit_softcapping must be > 0 or null, got {self.final_logit_softcapping}")

    @property
    def architecture(self) -> str:
        return "gemma3"

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s (whole-model index) window, or None (full attention)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "gemma3") -> Gemma3Config:
        model_type = raw.get("model_type", "gemma3_text")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window")
        missing = [f for f in required if raw.get(f) is None]
        if missing:
            raise ValueError(f"{model_type} config {name!r} lacks required fields {missing}")
        refused = {"attn_logit_softcapping": raw.get("attn_logit_softcapping"),
                   "use_bidirectional_attention": raw.get("use_bidirectional_attention") or None}
        set_fields = {k: v for k, v in refused.items() if v is not None}
        if set_fields:
            raise ValueError(f"{model_type} config {name!r} sets fields this server does not honour: {set_fields}")
        layers = int(raw["num_hidden_layers"])
        local, global_ = _rope(raw)
        values: dict[str, Any] = {
            k: raw[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                                "max_position_embeddings", "rms_norm_eps", "final_logit_softcapping",
                                "attention_bias", "tie_word_embeddings", "hidden_activation")
            if raw.get(k) is not None}
        values.update(
            layer_types=_layer_types(raw, layers),
            query_pre_attn_scalar=int(raw.get("query_pre_attn_scalar") or raw["head_dim"]),
            local_rope_theta=local[0], local_rope_scaling=local[1],
            global_rope_theta=global_[0], global_rope_scaling=global_[1],
            name=raw.get("_name_or_path") or name, model_type=model_type)
        values.update(token_ids(raw))
        return cls(**values)

    def to_hf_dict(self) -> dict[str, Any]:
        """Fields transformers' ``Gemma3TextConfig`` accepts."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                SLIDING: _rope_dict(self.local_rope_theta, self.local_rope_scaling),
                FULL: _rope_dict(self.global_rope_theta, self.global_rope_scaling),
            },
            "final_logit_softcapping": self.final_logit_softcapping,
            "attn_logit_softcapping": None,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_activation": self.hidden_activation,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "model_type": self.model_type,
        }


def _layer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    listed = raw.get("layer_types")
    if listed is not None:
        return tuple(str(t) for t in listed)
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
                  or DEFAULT_SLIDING_PATTERN)
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers))


def _rope(raw: dict[str, Any]) -> tuple[tuple[float, RopeScaling | None], tuple[float, RopeScaling | None]]:
    """((local theta, scaling), (global theta, scaling)) from either spelling of the settings."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        local, global_ = params.get(SLIDING) or {}, params.get(FULL) or {}
        return ((float(local.get("rope_theta", DEFAULT_LOCAL_THETA)), RopeScaling.parse(local)),
                (float(global_.get("rope_theta", DEFAULT_GLOBAL_THETA)), RopeScaling.parse(global_)))
    global_theta = float(raw.get("rope_theta") or DEFAULT_GLOBAL_THETA)
    local_theta = float(raw.get("rope_local_base_freq") or DEFAULT_LOCAL_THETA)
    return (local_theta, None), (global_theta, RopeScaling.parse(raw.get("rope_scaling") or params))


def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    out: dict[str, Any] = scaling.to_hf_dict() if scaling else {"rope_type": "default"}
    out["rope_theta"] = theta
    return out
