"""The ``model`` and ``profile`` sections of a config, and where their relative paths point.

``ModelArgs`` names the model a replica serves (config, tokenizer, weights, dtype, device, context
cap) and refuses a path that does not exist or a tokenizer that does not load; ``ProfileArgs`` is
the job profiler's output the scheduler interpolates. Relative paths are resolved against the
project root (``resolve_path``), not the working directory: Serve replicas and the application
builder run in Ray worker processes with their own cwd. ``Strict`` is every section's base.
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
#: Validation-context key that lets a check away from the serving nodes (the planner, the schema
#: tests) skip the tokenizer folder, which lives beside the checkpoint on a mounted volume.
REQUIRE_MODEL_FILES_CONTEXT = "require_model_files"

Device = Literal["cpu", "cuda"]
#: ``auto``: bfloat16 where the device computes it natively (CPU: AVX-512 BF16 or AMX, read from
#: /proc/cpuinfo), float32 on other CPUs (``fastserve.worker.executor.resolve_dtype``).
DType = Literal["auto", "float32", "float16", "bfloat16"]
LoadFormat = Literal["dummy", "auto"]
#: Where a request's omitted sampling values come from (vLLM's ``--generation-config``): ``auto``,
#: the model folder's ``generation_config.json``; ``vllm``, the OpenAI defaults only.
GenerationConfigSource = Literal["auto", "vllm"]


def cpu_has_bf16() -> bool:
    """``fastserve.kernels.cpu_features.cpu_has_bf16``, imported when first asked: the kernels
    package loads torch, which reading a GPU config (the planner) does not need."""
    from fastserve.kernels.cpu_features import cpu_has_bf16 as detect

    return detect()


def resolve_path(path: str | Path) -> Path:
    """An absolute path as is; a relative one under the project root."""
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p


class Strict(BaseModel):
    """A config section: every key known (a misspelt one fails naming itself), frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelArgs(Strict):
    """Which model a replica serves and how its weights are made."""

    #: The id clients put in ``model`` and that ``/v1/models`` lists.
    name: str = Field(min_length=1)
    #: A Hugging Face ``config.json`` (or the directory holding it).
    config_path: str
    tokenizer_path: str = "config/tokenizers/opt"
    load_format: LoadFormat = "dummy"
    #: Checkpoint directory or hub id; required by ``load_format: auto``.
    model_path: str | None = None
    dtype: DType = "float32"
    device: Device = "cpu"
    seed: int = Field(default=0, ge=0)
    #: Cap on prompt + generated tokens; None = the model's ``max_position_embeddings``.
    max_model_len: int | None = Field(default=None, ge=1)
    generation_config: GenerationConfigSource = "auto"
    #: On ``device: cuda``, decode steps replay CUDA graphs (one per batch-size bucket, vLLM's
    #: capture sizes up to ``cuda_graph_max_batch``; contexts up to ``cuda_graph_max_context``,
    #: vLLM's ``max_seq_len_to_capture``); larger steps and every CPU step run eagerly.
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
        """Refuse at start a folder whose tokenizer (or chat template) cannot be loaded; waived
        where the model's folder is not mounted (``REQUIRE_MODEL_FILES_CONTEXT``)."""
        if not (info.context or {}).get(REQUIRE_MODEL_FILES_CONTEXT, True):
            return value
        cls._exists(value)
        load_tokenizer(resolve_path(value))   # TokenizerLoadError names the path and reason
        return value

    @model_validator(mode="after")
    def _weights(self) -> ModelArgs:
        if self.load_format == "auto" and not self.model_path:
            raise ValueError("load_format 'auto' needs model_path (a checkpoint directory or hub id)")
        return self

    def hf_config(self) -> ModelConfig:
        """The model's config, of the architecture its ``config.json`` names (OPT or LLaMA)."""
        return load_model_config(resolve_path(self.config_path))

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (loaded once per process)."""
        return load_tokenizer(resolve_path(self.tokenizer_path))

    def model_folders(self) -> list[Path]:
        """Where ``generation_config.json`` may be: the config's folder, then the checkpoint's."""
        config = resolve_path(self.config_path)
        folders = [config] if config.is_dir() else ([config.parent] if config.name == CONFIG_FILE else [])
        if self.model_path and resolve_path(self.model_path).is_dir():
            folders.append(resolve_path(self.model_path))
        return folders

    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a job: generation_config.json (in the config or model folder),
        else config.json's eos_token_id, else the tokenizer's eos_token."""
        config = resolve_path(self.config_path)
        config_file = config / CONFIG_FILE if config.is_dir() else config
        return eos_token_ids(self.model_folders(), config_file, self.tokenizer().eos_token_id)

    def sampling_defaults(self) -> SamplingDefaults:
        """The sampling values a request that omits them gets (``generation_config``)."""
        return sampling_defaults(self.model_folders()) if self.generation_config == "auto" else SamplingDefaults()

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block of ``block_size`` tokens takes over all layers, in the dtype this
        machine runs the model in (``auto``: bf16 where the CPU has it natively, as
        ``fastserve.worker.executor.resolve_dtype`` picks; 2 bytes on a GPU)."""
        return block_size * self.hf_config().kv_bytes_per_token(self.dtype_bytes())

    def dtype_bytes(self) -> int:
        if self.dtype == "auto":
            return 2 if self.device == "cuda" or cpu_has_bf16() else 4
        return 4 if self.dtype == "float32" else 2

    def context_len(self) -> int:
        """The longest prompt + output a request may have."""
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
