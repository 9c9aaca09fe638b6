"""Model hyper-parameters from a Hugging Face ``config.json``: the architecture-agnostic
``ModelConfig``, the factory that picks an architecture by ``model_type``, and ``OPTConfig``.
Only what the forward pass needs. No torch: the control plane imports this to validate settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

#: OPT's learned position table is offset by 2 rows (a fairseq legacy of the padding index).
POSITION_OFFSET = 2


@runtime_checkable
class ModelConfig(Protocol):
    """What the executor, the KV store sizing and the serving code need to know of any model."""

    @property
    def name(self) -> str: ...
    @property
    def architecture(self) -> str:
        """The model family (``"opt"``, ``"llama"``, ``"gemma3"``)."""
        ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int:
        """K/V heads per layer (< query heads under GQA)."""
        ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def bos_token_id(self) -> int: ...
    @property
    def eos_token_id(self) -> int: ...

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers and KV heads."""
        ...

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads each tensor-parallel rank stores."""
        ...

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ``ValueError`` naming the first dimension ``tp_size`` cannot split."""
        ...

    def to_hf_dict(self) -> dict[str, Any]: ...


def _check_divisible(tp_size: int, dims: tuple[tuple[str, int], ...]) -> None:
    for what, n in dims:
        if n % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {what}={n}")


@dataclass(frozen=True)
class OPTConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    ffn_dim: int
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    remove_final_layer_norm: bool = False
    activation_function: str = "relu"
    bos_token_id: int = 2
    eos_token_id: int = 2
    pad_token_id: int = 1
    name: str = "opt"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.activation_function != "relu":
            raise ValueError(f"only OPT's relu activation is supported, got {self.activation_function!r}")

    @property
    def architecture(self) -> str:
        return "opt"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_attention_heads  # OPT has no grouped-query attention

    def kv_heads_per_rank(self, tp_size: int) -> int:
        return self.num_kv_heads // tp_size

    def check_tensor_parallel(self, tp_size: int) -> None:
        _check_divisible(tp_size, (("num_attention_heads", self.num_attention_heads),
                                   ("ffn_dim", self.ffn_dim)))

    @property
    def proj_dim(self) -> int:
        """Width of the token embedding (differs from hidden_size only for opt-350m)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def has_final_layer_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers (the paper's 4·l·h for fp16)."""
        return 2 * self.num_hidden_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "opt") -> OPTConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        if "_remove_final_layer_norm" in raw:
            values["remove_final_layer_norm"] = bool(raw["_remove_final_layer_norm"])
        values.setdefault("name", raw.get("_name_or_path", name) or name)
        missing = [f for f in ("vocab_size", "hidden_size", "num_hidden_layers",
                               "num_attention_heads", "ffn_dim") if f not in values]
        if missing:
            raise ValueError(f"OPT config {name!r} lacks required fields {missing}")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> OPTConfig:
        raw, name = read_config_json(path)
        return cls.from_dict(raw, name=name)

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent Hugging Face config fields."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "ffn_dim": self.ffn_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "word_embed_proj_dim": self.proj_dim,
            "do_layer_norm_before": self.do_layer_norm_before,
            "enable_bias": self.enable_bias,
            "layer_norm_elementwise_affine": self.layer_norm_elementwise_affine,
            "_remove_final_layer_norm": self.remove_final_layer_norm,
            "activation_function": self.activation_function,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }


#: ``model_type`` values of config.json, by the architecture that serves them.
OPT_MODEL_TYPES = frozenset({"opt"})
LLAMA_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
#: Gemma 3's text model (the multimodal ``gemma3`` wraps one in a vision model: not served).
GEMMA3_MODEL_TYPES = frozenset({"gemma3_text"})


def read_config_json(path: str | Path) -> tuple[dict[str, Any], str]:
    """The parsed ``config.json`` at ``path`` (file or folder) and its folder's name."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no model config.json at {path}")
    return json.loads(path.read_text()), path.parent.name


def model_config_from_dict(raw: dict[str, Any], name: str = "model") -> ModelConfig:
    """The config of the architecture ``raw["model_type"]`` names; none is OPT."""
    model_type = raw.get("model_type", "opt")
    if model_type in OPT_MODEL_TYPES:
        return OPTConfig.from_dict(raw, name=name)
    if model_type in LLAMA_MODEL_TYPES:
        from fastserve.worker.model.llama_config import LlamaConfig

        return LlamaConfig.from_dict(raw, name=name)
    if model_type in GEMMA3_MODEL_TYPES:
        from fastserve.worker.model.gemma3_config import Gemma3Config

        return Gemma3Config.from_dict(raw, name=name)
    known = sorted(OPT_MODEL_TYPES | LLAMA_MODEL_TYPES | GEMMA3_MODEL_TYPES)
    raise ValueError(f"unsupported model_type {model_type!r} in config {name!r}: supported are {known}")


def load_model_config(path: str | Path) -> ModelConfig:
    raw, name = read_config_json(path)
    return model_config_from_dict(raw, name=name)


def as_model_config(model: str | Path | ModelConfig) -> ModelConfig:
    return load_model_config(model) if isinstance(model, (str, Path)) else model
