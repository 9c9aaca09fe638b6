"""Weight loading for any served stage: Hugging Face checkpoints, each rank reading only its slice, or
dummy weights drawn per line from ``(seed, name, line)``, so any TP/PP split holds exactly the unsplit model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from fastserve.worker.model.config import ModelConfig
from fastserve.worker.model.layout import WeightLayout
from fastserve.worker.model.shard import StageShard

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
#: HF's ``initializer_range`` for OPT/LLaMA, so dummy activations stay sane.
DUMMY_INIT_STD = 0.02
SAFETENSORS_INDEX = "model.safetensors.index.json"
_SEED_MASK = (1 << 63) - 1


class ServedStage(Protocol):

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


@dataclass(frozen=True)
class Cut:
    """The part of a full tensor a rank holds: ``length`` entries of ``dim`` from ``start``."""

    dim: int
    start: int
    length: int

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.start, self.length)

    def index(self) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.length),)

    def shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        return full_shape[:self.dim] + (self.length,) + full_shape[self.dim + 1:]


def canonical_name(name: str, layout: WeightLayout) -> str:
    for prefix in layout.prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _suffix(local: str) -> str:
    m = _LAYER.match(local)
    return m.group(2) if m else local


def _local_name(stage: ServedStage, name: str) -> str | None:
    m = _LAYER.match(name)
    if m is None:
        return name
    layer = int(m.group(1))
    if not stage.shard.layer_start <= layer < stage.shard.layer_end:
        return None
    return f"layers.{layer - stage.shard.layer_start}.{m.group(2)}"


def _global_name(stage: ServedStage, local: str) -> str:
    m = _LAYER.match(local)
    return local if m is None else f"layers.{int(m.group(1)) + stage.shard.layer_start}.{m.group(2)}"


def _chunk(total: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of ``torch.chunk(size)[rank]`` along a dimension of ``total``."""
    step = -(-total // size)
    start = min(rank * step, total)
    return start, max(0, min(step, total - start))


def tensor_cut(stage: ServedStage, local: str, full_shape: tuple[int, ...]) -> Cut | None:
    """The part of the full tensor ``local`` this rank holds; None when it holds all of it."""
    rank, size = stage.shard.tp_rank, stage.shard.tp_size
    if size == 1:
        return None
    layout, suffix = stage.weight_layout, _suffix(local)
    if suffix.startswith(layout.kv_parallel):
        rows = stage.config.num_kv_heads * stage.config.head_dim
        if full_shape[0] != rows:   # a wrong tensor's slice could fit by accident
            raise ValueError(f"checkpoint tensor {local!r} has {full_shape[0]} rows; the model's "
                             f"{stage.config.num_kv_heads} KV heads x {stage.config.head_dim} need {rows}")
        return Cut(0, *stage.kv_rows())
    if suffix.startswith(layout.column_parallel):
        return Cut(0, *_chunk(full_shape[0], size, rank))
    if suffix in layout.row_parallel:
        return Cut(1, *_chunk(full_shape[1], size, rank))
    return None


class _Filler:
    """Copies pieces into a stage's parameters, checking shapes, and reports what is missing."""

    def __init__(self, stage: ServedStage) -> None:
        self.stage = stage
        self.params = dict(stage.named_parameters())
        self.loaded: set[str] = set()

    def target(self, raw_name: str) -> str | None:
        name = canonical_name(raw_name, self.stage.weight_layout)
        if name in self.stage.weight_layout.skipped:
            return None
        local = _local_name(self.stage, name)
        return local if local is not None and local in self.params else None

    def put(self, raw_name: str, local: str, full_shape: tuple[int, ...], piece: torch.Tensor) -> None:
        target = self.params[local]
        if tuple(piece.shape) != tuple(target.shape):
            shard = self.stage.shard
            raise ValueError(
                f"checkpoint tensor {raw_name!r} has shape {tuple(full_shape)}; this stage expects "
                f"{tuple(target.shape)} for {local!r} (tp_rank {shard.tp_rank}/{shard.tp_size})"
            )
        with torch.no_grad():
            target.copy_(piece)
        self.loaded.add(local)

    def finish(self, strict: bool) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if strict and missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors this stage needs, e.g. {missing[:5]}")


def load_weights(stage: ServedStage, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
    """Copy in-memory full tensors into ``stage``, taking its slices."""
    filler = _Filler(stage)
    for raw_name, full in tensors:
        local = filler.target(raw_name)
        if local is None:
            continue
        shape = tuple(full.shape)
        cut = tensor_cut(stage, local, shape)
        filler.put(raw_name, local, shape, full if cut is None else cut.apply(full))
    filler.finish(strict)


class CheckpointReader(Protocol):

    def names(self) -> Iterable[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str, cut: Cut | None) -> torch.Tensor: ...


def load_checkpoint(stage: ServedStage, reader: CheckpointReader, strict: bool = True) -> None:
    """Fill ``stage`` from ``reader``, reading only its tensors' slices."""
    filler = _Filler(stage)
    for raw_name in reader.names():
        local = filler.target(raw_name)
        if local is None:
            continue
        shape = reader.shape(raw_name)
        cut = tensor_cut(stage, local, shape)
        filler.put(raw_name, local, shape, reader.read(raw_name, cut))
    filler.finish(strict)


class SafetensorsReader:
    """Safetensors files opened on demand (without an index every header is read). A context manager."""

    def __init__(self, files: Iterable[Path], weight_map: dict[str, str] | None = None) -> None:
        self._files = {f.name: f for f in files}
        self._map = weight_map
        self._handles: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = self._stack.enter_context(safe_open(str(self._files[file]), framework="pt"))
        return self._handles[file]

    def _weight_map(self) -> dict[str, str]:
        if self._map is None:
            self._map = {name: file for file in self._files for name in self._handle(file).keys()}  # noqa: SIM118
        return self._map

    def names(self) -> Iterable[str]:
        return list(self._weight_map())

    def _slice(self, name: str) -> Any:
        return self._handle(self._weight_map()[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, cut: Cut | None) -> torch.Tensor:
        if cut is None:
            return self._handle(self._weight_map()[name]).get_tensor(name)
        return self._slice(name)[cut.index()]


class PickleReader:
    """Torch pickles, memory-mapped so a slice reads only its own pages."""

    def __init__(self, files: Iterable[Path]) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        for f in files:
            self._tensors.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))

    def names(self) -> Iterable[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read(self, name: str, cut: Cut | None) -> torch.Tensor:
        full = self._tensors[name]
        return full if cut is None else cut.apply(full)


def _line_dim(name: str, layout: WeightLayout) -> int:
    """The dimension a dummy matrix is drawn along: the one whose whole lines a rank holds."""
    return 1 if _suffix(name) in layout.row_parallel else 0


def _line_seed(key: int, line: int) -> int:
    """A seed for line ``line`` of the tensor keyed ``key`` (splitmix64, so neighbours differ)."""
    z = (key + (line + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _SEED_MASK


def dummy_tensor(name: str, full_shape: tuple[int, ...], seed: int, layout: WeightLayout,
                 cut: Cut | None = None) -> torch.Tensor:
    """The ``cut`` part of the dummy tensor ``name``: the same values whatever the cut."""
    shape = full_shape if cut is None else cut.shape(full_shape)
    if name.endswith(layout.ones):
        return torch.ones(shape)
    if name.endswith(layout.zeros):
        return torch.zeros(shape)
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    gen = torch.Generator()
    if len(full_shape) != 2:   # vectors are small: draw whole, then cut
        full = torch.randn(full_shape, generator=gen.manual_seed(key & _SEED_MASK)) * DUMMY_INIT_STD
        return full if cut is None else cut.apply(full)
    dim = _line_dim(name, layout)
    first, count = (cut.start, cut.length) if cut is not None and cut.dim == dim else (0, full_shape[dim])
    lines = torch.empty(count, full_shape[1 - dim])
    for i in range(count):
        torch.randn(full_shape[1 - dim], generator=gen.manual_seed(_line_seed(key, first + i)), out=lines[i])
    piece = (lines if dim == 0 else lines.t()) * DUMMY_INIT_STD
    if cut is not None and cut.dim != dim:
        piece = cut.apply(piece)
    return piece


def full_shapes(stage: ServedStage) -> dict[str, tuple[int, ...]]:
    layout, config = stage.weight_layout, stage.config
    shapes: dict[str, tuple[int, ...]] = {}
    for local, p in stage.named_parameters():
        shape = list(p.shape)
        suffix = _suffix(local)
        if suffix.startswith(layout.kv_parallel):
            shape[0] = config.num_kv_heads * config.head_dim
        elif suffix.startswith(layout.column_parallel):
            shape[0] *= stage.shard.tp_size
        elif suffix in layout.row_parallel:
            shape[1] *= stage.shard.tp_size
        shapes[_global_name(stage, local)] = tuple(shape)
    return shapes


def dummy_weights(stage: ServedStage, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    layout = stage.weight_layout
    for name, shape in full_shapes(stage).items():
        yield name, dummy_tensor(name, shape, seed, layout)


def load_dummy(stage: ServedStage, seed: int) -> None:
    filler = _Filler(stage)
    for name, shape in full_shapes(stage).items():
        local = filler.target(name)
        if local is None:
            continue
        cut = tensor_cut(stage, local, shape)
        filler.put(name, local, shape, dummy_tensor(name, shape, seed, stage.weight_layout, cut))
    filler.finish(strict=True)


def _safetensors_index(path: Path) -> dict[str, str] | None:
    index = path / SAFETENSORS_INDEX
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map")
    return {str(k): str(v) for k, v in weight_map.items()}


def checkpoint_files(path: Path) -> list[Path]:
    """A local model folder's weight files: safetensors preferred, else .bin."""
    weight_map = _safetensors_index(path)
    if weight_map is not None:
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{path / SAFETENSORS_INDEX} names shards that are not in {path}: {missing[:3]}")
        return [path / s for s in shards]
    for pattern in ("*.safetensors", "pytorch_model*.bin", "*.bin", "*.pt"):
        files = sorted(path.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(f"no .safetensors or .bin weights in {path}")


def open_checkpoint(path: Path) -> SafetensorsReader | PickleReader:
    files = checkpoint_files(path)
    if files[0].suffix == ".safetensors":
        return SafetensorsReader(files, _safetensors_index(path))
    return PickleReader(files)


def iter_checkpoint(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full tensor of ``files`` (for tools; serving uses ``open_checkpoint``)."""
    files = list(files)
    reader: SafetensorsReader | PickleReader
    if files and files[0].suffix == ".safetensors":
        with SafetensorsReader(files) as reader:
            for name in reader.names():
                yield name, reader.read(name, None)
    else:
        reader = PickleReader(files)
        for name in reader.names():
            yield name, reader.read(name, None)


def resolve_model_path(model: str) -> Path:
    """A local folder, or a hub id downloaded unless ``HF_HUB_OFFLINE``."""
    path = Path(model)
    if path.exists():
        return path
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"model {model!r} is not a local folder and HF_HUB_OFFLINE=1")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.bin"]))


def load_stage_weights(stage: ServedStage, load_format: str, model_path: str | None = None, seed: int = 0) -> None:
    if load_format == "dummy":
        load_dummy(stage, seed)
        return
    if load_format != "auto":
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if model_path is None:
        raise ValueError("load_format 'auto' needs a model path or hub id")
    reader = open_checkpoint(resolve_model_path(model_path))
    if isinstance(reader, SafetensorsReader):
        with reader:
            load_checkpoint(stage, reader)
    else:
        load_checkpoint(stage, reader)
