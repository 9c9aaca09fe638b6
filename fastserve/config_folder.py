"""``fastserve serve MODEL_DIR``: the command's settings and the Serve config it writes for a folder,
with the profile grid and cache key and the GPU KV sizing (vLLM's defaults and rules where vLLM has
them). Imports no torch or ray: ``fastserve.cli`` measures the machine and hands the numbers here.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from fastserve.config import GIB
from fastserve.config_model import Device, DType, Strict
from fastserve.config_server import ToolCallParserName
from fastserve.generation_config import CONFIG_FILE
from fastserve.scheduler.config import SchedulerConfig
from fastserve.worker.messages import DEFAULT_BLOCK_SIZE

CACHE_DIR_ENV = "FASTSERVE_CACHE_DIR"
APP_NAME = "fastserve"
APP_IMPORT = "fastserve.main:build_app"


class FolderServeArgs(Strict):
    model_dir: Path
    name: str | None = Field(default=None, min_length=1)
    dtype: DType = "auto"
    device: Device = "cpu"
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    #: None: the model's own context, as vLLM.
    max_model_len: int | None = Field(default=None, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    #: CPU KV of the model copy (vLLM's ``VLLM_CPU_KVCACHE_SPACE``).
    kv_cache_space_gib: float = Field(default=4.0, gt=0)
    #: Host swap pool (vLLM's ``--swap-space``).
    swap_space_gib: float = Field(default=4.0, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    #: As vLLM V1's default; lets a context exceed the iteration's token budget.
    chunked_prefill: bool = True
    #: The profile's quick grid (clipped by ``profile_grid``); each point a median of repeats.
    profile_prompt_lens: tuple[int, ...] = (1, 16, 64, 256, 1024)
    profile_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    profile_repeats: int = Field(default=2, ge=1)
    tool_call_parser: ToolCallParserName = "auto"

    @field_validator("model_dir")
    @classmethod
    def _is_model_folder(cls, value: Path) -> Path:
        if not (value / CONFIG_FILE).is_file():
            raise ValueError(f"model folder {str(value)!r} has no {CONFIG_FILE}")
        return value.resolve()

    @property
    def served_name(self) -> str:
        return self.name or self.model_dir.name

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$FASTSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastserve``, else ``~/.cache/fastserve``."""
    env = os.environ if env is None else env
    if env.get(CACHE_DIR_ENV):
        return Path(env[CACHE_DIR_ENV])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "fastserve"


def scheduler_settings(args: FolderServeArgs) -> dict[str, Any]:
    return {"chunked_prefill": {"enabled": args.chunked_prefill}}


def profile_grid(args: FolderServeArgs) -> tuple[list[int], list[int]]:
    """The quick grid clipped to this server's limits, each limit itself measured."""
    sched = SchedulerConfig.model_validate(scheduler_settings(args))
    # A GPU's KV sizing takes the profile's peak activations: of the whole token budget, as vLLM.
    longest = (sched.max_num_batched_tokens if args.device == "cuda"
               else sched.chunk_limit() or sched.max_num_batched_tokens)
    return (_clip(args.profile_prompt_lens, longest), _clip(args.profile_batch_sizes, sched.max_batch_size))


def _clip(points: Sequence[int], limit: int) -> list[int]:
    return sorted({p for p in points if p < limit} | {limit})


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unnamed"


def hardware_key(name: str, threads: int | None = None) -> str:
    """A file-name label of the profiling machine; on a CPU with its thread count."""
    return slug(name) if threads is None else f"{slug(name)}-{threads}t"


def profile_cache_name(name: str, config_json: bytes, hardware: str, dtype: str, tp: int, pp: int,
                       block_size: int = DEFAULT_BLOCK_SIZE) -> str:
    """The cached profile's file name: times depend on the shapes (config.json's hash), not weights."""
    digest = hashlib.sha256(config_json).hexdigest()[:16]
    return f"{slug(name)}-{digest}-{hardware}-{dtype}-tp{tp}-pp{pp}-bs{block_size}.json"


def gpu_kv_blocks(total_bytes: int, free_bytes: int, utilization: float, weight_bytes: int,
                  activation_bytes: int, world_size: int, block_bytes: int) -> int:
    """Device KV blocks of one model copy, as vLLM: per GPU ``utilization × total − (total − free)
    − weights / world_size − activations``, summed over ranks, over the copy's ``block_bytes``."""
    for label, value in (("total_bytes", total_bytes), ("block_bytes", block_bytes), ("world_size", world_size)):
        if value <= 0:
            raise ValueError(f"{label} must be > 0, got {value}")
    used_by_others = total_bytes - free_bytes
    per_gpu = utilization * total_bytes - used_by_others - weight_bytes / world_size - activation_bytes
    if per_gpu < block_bytes / world_size:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization} x {total_bytes / GIB:.2f} GiB - "
            f"{used_by_others / GIB:.2f} GiB used by others - {weight_bytes / world_size / GIB:.2f} GiB of "
            f"weights - {activation_bytes / GIB:.2f} GiB of activations = {per_gpu / GIB:.2f} GiB per GPU "
            "(raise --gpu-memory-utilization, free the GPU, or add --tp ranks)")
    return int(per_gpu * world_size // block_bytes)


def app_args(args: FolderServeArgs, profile_path: Path, torch_threads: int | None,
             num_device_blocks: int | None = None) -> dict[str, Any]:
    """The Serve app's ``args`` for the folder; ``num_device_blocks`` None sizes by memory."""
    folder = str(args.model_dir)
    model: dict[str, Any] = {"name": args.served_name, "config_path": folder, "tokenizer_path": folder,
                             "model_path": folder, "load_format": "auto", "dtype": args.dtype,
                             "device": args.device}
    if args.max_model_len is not None:
        model["max_model_len"] = args.max_model_len
    parallel: dict[str, Any] = {"tensor_parallel_size": args.tensor_parallel_size,
                                "pipeline_parallel_size": args.pipeline_parallel_size,
                                "num_gpus": args.world_size if args.device == "cuda" else 0}
    if torch_threads is not None:
        parallel["torch_threads"] = torch_threads
    kv: dict[str, Any] = {"host_memory_gib": args.swap_space_gib}
    if num_device_blocks is None:
        kv["device_memory_gib"] = args.kv_cache_space_gib
    else:
        kv["num_device_blocks"] = num_device_blocks
    app: dict[str, Any] = {"model": model, "parallel": parallel, "profile": {"path": str(profile_path)},
                           "scheduler": scheduler_settings(args), "kv_cache": kv}
    server: dict[str, Any] = {}
    if not is_loopback(args.host):   # reachable from other machines: refuse to start open
        server["require_api_key"] = True
    if args.tool_call_parser != "auto":
        server["tool_call_parser"] = args.tool_call_parser
    if server:
        app["server"] = server
    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:   # a host name: it may resolve to any interface
        return False


def serve_config(args: FolderServeArgs, app: dict[str, Any]) -> dict[str, Any]:
    """The whole Serve config ``serve run`` reads: one app, bound to ``args.host:args.port``."""
    return {"proxy_location": "HeadOnly",
            "http_options": {"host": args.host, "port": args.port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": APP_IMPORT, "args": app}]}
