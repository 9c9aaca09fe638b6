"""OPT architecture hyper-parameters, read from a Hugging Face ``config.json``.

Only what the forward pass needs; everything else in the JSON is ignored. Owned here so that the
model, the weight loader, the KV store sizing and the profiler agree on one definition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

#: OPT's learned position table is offset by 2 rows (a fairseq legacy of the padding index).
POSITION_OFFSET = 2


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
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def proj_dim(self) -> int:
        """Width of the token embedding (differs from hidden_size only for opt-350m)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def has_final_layer_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers (the paper's 4·l·h for fp16)."""
        return 2 * self.num_hidden_layers * self.hidden_size * dtype_bytes

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
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no OPT config.json at {path}")
        return cls.from_dict(json.loads(path.read_text()), name=path.parent.name)

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent Hugging Face config fields (used to build a reference model in tests)."""
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
