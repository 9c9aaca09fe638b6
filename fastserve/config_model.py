"""The ``model`` and ``profile`` sections of a config (``Strict`` is every section's base), and
``resolve_path``: relative paths point under the project root, since Ray workers have their own cwd.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from fastserve.generation_config import CONFIG_FILE, SamplingDefaults, eos_token_ids, sampling_defaults
from fastserve.tokenizer import Tokenizer, load_tokenizer
from fastserve.worker.model.config import ModelConfig, load_model_config

PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: Validation-context key that lets the schema test skip the profile file check.
REQUIRE_PROFILE_CONTEXT = "require_profile"
#: Validation-context key that skips the tokenizer folder away from the serving nodes.
REQUIRE_MODEL_FILES_CONTEXT = "require_model_files"

Device = Literal["cpu", "cuda"]
#: ``auto``: bfloat16 where the device computes it natively, else float32.
DType = Literal["auto", "float32", "float16", "bfloat16"]
LoadFormat = Literal["dummy", "auto"]
#: vLLM's ``--generation-config``: ``auto`` reads the folder's file, ``vllm`` the OpenAI defaults.
GenerationConfigSource = Literal["auto", "vllm"]


def cpu_has_bf16() -> bool:
    """Imported late: the kernels package loads torch."""
    from fastserve.kernels.cpu_features import cpu_has_bf16 as detect

    return detect()


def resolve_path(path: str | Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p


class Strict(BaseModel):
    """A config section: frozen, every key known."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelArgs(Strict):
    name: str = Field(min_length=1)
    config_path: str
    tokenizer_path: str = "config/tokenizers/opt"
    load_format: LoadFormat = "dummy"
    #: Checkpoint directory or hub id; required by ``load_format: auto``.
    model_path: str | None = None
    dtype: DType = "float32"
    device: Device = "cpu"
    seed: int = Field(default=0, ge=0)
    #: None: the model's ``max_position_embeddings``.
    max_model_len: int | None = Field(default=None, ge=1)
    generation_config: GenerationConfigSource = "auto"
    #: CUDA decode steps within these bounds replay graphs; others run eagerly.
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = Field(default=256, ge=1)
    cuda_graph_max_context: int = Field(default=8192, ge=1)

    @field_validator("config_path")
    @classmethod
    def _exists(cls, value: str) -> str:
        if not resolve_path(value).exists():
            raise ValueError(f"path {value!r} does not exist (resolved to {resolve_path(value)})")
        return value

    @field_validator("tokenizer_path")
    @classmethod
    def _loads(cls, value: str, info: ValidationInfo) -> str:
        """Refuse at start a tokenizer (or chat template) that does not load."""
        if not (info.context or {}).get(REQUIRE_MODEL_FILES_CONTEXT, True):
            return value
        cls._exists(value)
        load_tokenizer(resolve_path(value))
        return value

    @model_validator(mode="after")
    def _weights(self) -> ModelArgs:
        if self.load_format == "auto" and not self.model_path:
            raise ValueError("load_format 'auto' needs model_path (a checkpoint directory or hub id)")
        return self

    def hf_config(self) -> ModelConfig:
        return load_model_config(resolve_path(self.config_path))

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(resolve_path(self.tokenizer_path))

    def model_folders(self) -> list[Path]:
        config = resolve_path(self.config_path)
        folders = [config] if config.is_dir() else ([config.parent] if config.name == CONFIG_FILE else [])
        if self.model_path and resolve_path(self.model_path).is_dir():
            folders.append(resolve_path(self.model_path))
        return folders

    def eos_token_ids(self) -> frozenset[int]:
        """generation_config.json's EOS ids, else config.json's, else the tokenizer's."""
        config = resolve_path(self.config_path)
        config_file = config / CONFIG_FILE if config.is_dir() else config
        return eos_token_ids(self.model_folders(), config_file, self.tokenizer().eos_token_id)

    def sampling_defaults(self) -> SamplingDefaults:
        return sampling_defaults(self.model_folders()) if self.generation_config == "auto" else SamplingDefaults()

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one KV block over all layers, in the dtype this machine resolves."""
        return block_size * self.hf_config().kv_bytes_per_token(self.dtype_bytes())

    def dtype_bytes(self) -> int:
        if self.dtype == "auto":
            return 2 if self.device == "cuda" or cpu_has_bf16() else 4
        return 4 if self.dtype == "float32" else 2

    def context_len(self) -> int:
        limit = self.hf_config().max_position_embeddings
        return limit if self.max_model_len is None else self.max_model_len


class ProfileArgs(Strict):
    """The job profiler's output the scheduler interpolates (``python -m fastserve.engine.profiler``)."""

    path: str

    @field_validator("path")
    @classmethod
    def _exists(cls, value: str, info: ValidationInfo) -> str:
        required = (info.context or {}).get(REQUIRE_PROFILE_CONTEXT, True)
        if required and not resolve_path(value).is_file():
            raise ValueError(
                f"profile file {value!r} not found (resolved to {resolve_path(value)}); "
                "write it with `python -m fastserve.engine.profiler`"
            )
        return value
