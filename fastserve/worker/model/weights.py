"""Weight loading for any served stage (OPT, LLaMA): Hugging Face checkpoints or seeded dummy weights.

Checkpoint names map one-to-one onto our module names once the architecture's prefix
(``model.decoder.`` for OPT, ``model.`` for LLaMA; see each model's ``WeightLayout``) is stripped
and the global layer index is rebased onto the stage. Each stage and tensor-parallel rank takes
only the slices it owns: column-parallel weights (OPT q/k/v and fc1; LLaMA q, gate, up) are split
by output rows, row-parallel weights (out_proj/o_proj, fc2/down_proj) by input columns; K/V
projections under grouped-query attention take the rows of the KV heads the rank stores (a split
when TP divides the KV heads, else the one shared head, replicated); biases of row-parallel
layers and everything else are replicated. Safetensors (also sharded, with
``model.safetensors.index.json``), or torch pickles.

``load_format="dummy"`` (as vLLM's ``--load-format dummy``) draws every full tensor from a
generator seeded by ``(seed, name)`` and then slices it, so any TP/PP split of the same seed holds
exactly the same model as the unsplit one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from fastserve.worker.model.config import ModelConfig
from fastserve.worker.model.layout import WeightLayout
from fastserve.worker.model.shard import StageShard

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
#: Hugging Face's OPT/LLaMA initialisation scale (``initializer_range``), reused for dummy
#: weights so activations stay sane.
DUMMY_INIT_STD = 0.02
#: The index of a sharded safetensors checkpoint (maps each tensor to its shard file).
SAFETENSORS_INDEX = "model.safetensors.index.json"


class ServedStage(Protocol):
    """What the loader needs of a stage module (``OPTStage``, ``LlamaStage``)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def shard(self) -> StageShard: ...
    @property
    def weight_layout(self) -> WeightLayout: ...

    def kv_rows(self) -> tuple[int, int]:
        """``(first, count)`` rows of a full K/V projection this rank holds."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...


def canonical_name(name: str, layout: WeightLayout) -> str:
    for prefix in layout.prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _suffix(local: str) -> str:
    m = _LAYER.match(local)
    return m.group(2) if m else local


def _local_name(stage: ServedStage, name: str) -> str | None:
    """Our parameter name for a checkpoint tensor, or None if this stage does not hold it."""
    m = _LAYER.match(name)
    if m is None:
        return name
    layer = int(m.group(1))
    if not stage.shard.layer_start <= layer < stage.shard.layer_end:
        return None
    return f"layers.{layer - stage.shard.layer_start}.{m.group(2)}"


def _shard(stage: ServedStage, name: str, full: torch.Tensor) -> torch.Tensor:
    rank, size = stage.shard.tp_rank, stage.shard.tp_size
    if size == 1:
        return full
    layout, suffix = stage.weight_layout, _suffix(name)
    if suffix.startswith(layout.kv_parallel):
        rows = stage.config.num_kv_heads * stage.config.head_dim
        if full.shape[0] != rows:   # checked here: a wrong tensor's slice could fit by accident
            raise ValueError(f"checkpoint tensor {name!r} has {full.shape[0]} rows; the model's "
                             f"{stage.config.num_kv_heads} KV heads x {stage.config.head_dim} need {rows}")
        first, count = stage.kv_rows()
        return full.narrow(0, first, count)
    if suffix.startswith(layout.column_parallel):
        return full.chunk(size, dim=0)[rank]
    if suffix in layout.row_parallel:
        return full.chunk(size, dim=1)[rank]
    return full


def load_weights(stage: ServedStage, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
    """Copy checkpoint tensors into ``stage``, taking this stage's slices; check every shape."""
    params = dict(stage.named_parameters())
    layout = stage.weight_layout
    loaded: set[str] = set()
    for raw_name, full in tensors:
        name = canonical_name(raw_name, layout)
        if name in layout.skipped:
            continue
        local = _local_name(stage, name)
        if local is None or local not in params:
            continue
        piece = _shard(stage, local, full)
        target = params[local]
        if tuple(piece.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint tensor {raw_name!r} has shape {tuple(full.shape)}; this stage expects "
                f"{tuple(target.shape)} for {local!r} (tp_rank {stage.shard.tp_rank}/{stage.shard.tp_size})"
            )
        with torch.no_grad():
            target.copy_(piece)
        loaded.add(local)
    missing = sorted(set(params) - loaded)
    if strict and missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors this stage needs, e.g. {missing[:5]}")


def _dummy_tensor(name: str, shape: tuple[int, ...], seed: int, layout: WeightLayout) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    if name.endswith(layout.ones):
        return torch.ones(shape)
    if name.endswith(layout.zeros):
        return torch.zeros(shape)
    return torch.randn(shape, generator=gen) * DUMMY_INIT_STD


def full_shapes(stage: ServedStage) -> dict[str, tuple[int, ...]]:
    """Unsharded shapes, keyed by global checkpoint name, of every tensor this stage holds."""
    layout, config = stage.weight_layout, stage.config
    shapes: dict[str, tuple[int, ...]] = {}
    for local, p in stage.named_parameters():
        m = _LAYER.match(local)
        name = local if m is None else f"layers.{int(m.group(1)) + stage.shard.layer_start}.{m.group(2)}"
        shape = list(p.shape)
        suffix = _suffix(local)
        if suffix.startswith(layout.kv_parallel):
            shape[0] = config.num_kv_heads * config.head_dim
        elif suffix.startswith(layout.column_parallel):
            shape[0] *= stage.shard.tp_size
        elif suffix in layout.row_parallel:
            shape[1] *= stage.shard.tp_size
        shapes[name] = tuple(shape)
    return shapes


def dummy_weights(stage: ServedStage, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full (unsharded) tensor this stage holds, drawn from ``seed``, by our name."""
    layout = stage.weight_layout
    for name, shape in full_shapes(stage).items():
        yield name, _dummy_tensor(name, shape, seed, layout)


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a local Hugging Face model folder: safetensors preferred (the shards an
    index names, when there is one), else .bin."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {path}: {missing[:3]}")
        return [path / s for s in shards]
    for pattern in ("*.safetensors", "pytorch_model*.bin", "*.bin", "*.pt"):
        files = sorted(path.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(f"no .safetensors or .bin weights in {path}")


def iter_checkpoint(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, handle.get_tensor(name)
        else:
            state = torch.load(f, map_location="cpu", weights_only=True)
            yield from state.items()


def resolve_model_path(model: str) -> Path:
    """A local folder, or a hub id downloaded where the machine is online (never in tests)."""
    path = Path(model)
    if path.exists():
        return path
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"model {model!r} is not a local folder and HF_HUB_OFFLINE=1")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.bin"]))


def load_stage_weights(stage: ServedStage, load_format: str, model_path: str | None = None, seed: int = 0) -> None:
    """Fill ``stage`` from ``load_format``: ``dummy`` (seeded random) or ``auto`` (a checkpoint)."""
    if load_format == "dummy":
        load_weights(stage, dummy_weights(stage, seed))
        return
    if load_format != "auto":
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if model_path is None:
        raise ValueError("load_format 'auto' needs a model path or hub id")
    load_weights(stage, iter_checkpoint(checkpoint_files(resolve_model_path(model_path))))

