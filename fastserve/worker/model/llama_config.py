"""LLaMA-family hyper-parameters (LLaMA 2/3, Mistral, Qwen2) from a ``config.json``: the members differ
only in fields (biases, a sliding window, rotary scaling ``default``/``linear``/``llama3``). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

ROPE_KINDS = ("linear", "llama3")
#: How transformers names plain, unscaled RoPE.
ROPE_DEFAULT = "default"
#: Llama 3.1's published defaults for the llama3 kind's optional fields.
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class _HeadShape(Protocol):
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    def kv_heads_per_rank(self, tp_size: int) -> int: ...
    def kv_head_start(self, tp_rank: int, tp_size: int) -> int: ...


class GroupedKVHeads:
    """KV sizing and tensor-parallel cuts of a grouped-query decoder (the LLaMA family, Gemma 3)."""

    def kv_bytes_per_token(self: _HeadShape, dtype_bytes: int) -> int:
        # Every layer keeps every position (sliding ones too): one paged layout for all layers.
        return 2 * self.num_hidden_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_heads_per_rank(self: _HeadShape, tp_size: int) -> int:
        """KV heads split across ranks when ``tp`` divides them; otherwise each rank holds the one
        KV head its query heads share (replicated ``tp / num_kv_heads`` times)."""
        return self.num_kv_heads // tp_size if self.num_kv_heads % tp_size == 0 else 1

    def kv_head_start(self: _HeadShape, tp_rank: int, tp_size: int) -> int:
        """The first (global) KV head rank ``tp_rank`` stores."""
        if self.num_kv_heads % tp_size == 0:
            return tp_rank * self.num_kv_heads // tp_size
        return tp_rank // (tp_size // self.num_kv_heads)

    def kv_rows(self: _HeadShape, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """The first K (or V) projection row rank ``tp_rank`` keeps, and how many."""
        return self.kv_head_start(tp_rank, tp_size) * self.head_dim, self.kv_heads_per_rank(tp_size) * self.head_dim

    def check_tensor_parallel(self: _HeadShape, tp_size: int) -> None:
        for what, n in (("num_attention_heads", self.num_attention_heads),
                        ("intermediate_size", self.intermediate_size)):
            if n % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {what}={n}")
        kv = self.num_kv_heads
        if kv % tp_size and tp_size % kv:
            raise ValueError(f"tensor_parallel_size={tp_size} and the model's num_key_value_heads={kv}: "
                             "one must divide the other (KV heads are split, or replicated whole)")


def token_ids(raw: dict[str, Any]) -> dict[str, int]:
    """``bos_token_id`` and ``eos_token_id`` where the config sets them (the first of a list)."""
    return {key: int(token[0] if isinstance(token, list) else token)
            for key in ("bos_token_id", "eos_token_id") if (token := raw.get(key)) is not None}


@dataclass(frozen=True)
class RopeScaling:
    """A rotary-frequency scaling (see ``fastserve.worker.model.rope``)."""

    kind: str
    factor: float
    low_freq_factor: float = LLAMA3_DEFAULTS["low_freq_factor"]
    high_freq_factor: float = LLAMA3_DEFAULTS["high_freq_factor"]
    original_max_position_embeddings: int = int(LLAMA3_DEFAULTS["original_max_position_embeddings"])

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope_scaling kind {self.kind!r} is not supported (supported: "
                             f"{list(ROPE_KINDS)} or none)")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
                             f"{self.high_freq_factor} <= {self.low_freq_factor}")

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> RopeScaling | None:
        """From a ``rope_scaling``/``rope_parameters`` dict (``rope_type`` or ``type``); None: unscaled."""
        if not raw:
            return None
        kind = raw.get("rope_type", raw.get("type", ROPE_DEFAULT))
        if kind == ROPE_DEFAULT:
            return None
        if kind not in ROPE_KINDS:
            raise ValueError(f"rope_scaling kind {kind!r} is not supported (supported: "
                             f"{list(ROPE_KINDS)} or none)")
        if "factor" not in raw:
            raise ValueError(f"rope_scaling of kind {kind!r} lacks 'factor'")
        known = {f.name for f in fields(cls)} - {"kind"}
        return cls(kind=kind, **{k: v for k, v in raw.items() if k in known})

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.kind, "factor": self.factor}
        if self.kind == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        return out


@dataclass(frozen=True)
class LlamaConfig(GroupedKVHeads):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    #: None = multi-head attention (as many KV heads as query heads).
    num_key_value_heads: int | None = None
    #: None = hidden_size / num_attention_heads.
    explicit_head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int = 1
    #: The first of the config's end tokens (the server stops on all of them).
    eos_token_id: int = 2
    model_type: str = "llama"
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"only the SwiGLU (silu) MLP is supported, got hidden_act {self.hidden_act!r}")
        if self.explicit_head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def architecture(self) -> str:
        return "llama"

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "llama") -> LlamaConfig:
        model_type = raw.get("model_type", "llama")
        missing = [f for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if f not in raw]
        if missing:
            raise ValueError(f"{model_type} config {name!r} lacks required fields {missing}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling")
        theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", cls.rope_theta))
        simple = {f.name for f in fields(cls)} - {"rope_scaling", "explicit_head_dim", "eos_token_id",
                                                  "bos_token_id", "name", "rope_theta"}
        values: dict[str, Any] = {k: raw[k] for k in simple if raw.get(k) is not None}
        values.update(_biases(raw, model_type), rope_theta=float(theta), rope_scaling=RopeScaling.parse(rope),
                      name=raw.get("_name_or_path") or name, model_type=model_type)
        if raw.get("head_dim") is not None:
            values["explicit_head_dim"] = int(raw["head_dim"])
        values.update(token_ids(raw))
        window = _sliding_window(raw, model_type)
        if window is not None:
            values["max_position_embeddings"] = min(values.get("max_position_embeddings",
                                                               cls.max_position_embeddings), window)
        return cls(**values)

    def to_hf_dict(self) -> dict[str, Any]:
        """Fields transformers' config class for ``model_type`` accepts."""
        out: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf_dict() if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.model_type != "qwen2":  # Qwen2's biases are fixed by the architecture
            out.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        return out


def _biases(raw: dict[str, Any], model_type: str) -> dict[str, bool]:
    if model_type == "qwen2":
        return {"qkv_bias": True, "o_proj_bias": False, "mlp_bias": False}
    attention = bool(raw.get("attention_bias", False))
    return {"qkv_bias": attention, "o_proj_bias": attention, "mlp_bias": bool(raw.get("mlp_bias", False))}


def _sliding_window(raw: dict[str, Any], model_type: str) -> int | None:
    """The attention window in force, if any (Qwen2 declares one but uses it only when asked)."""
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None
