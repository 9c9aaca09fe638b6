"""Whether a pipeline's activations travel over Ray's NCCL channels, and whether this process can
build them: CuPy's NCCL binding, checked in each stage worker as it starts, after torch (whose
wheel ships the libnccl CuPy finds) and before any weight (docs/engine.md says why not in the
Engine replica).
"""

from __future__ import annotations

import importlib

#: The module Ray's NCCL channels import (``ray.experimental.channel.nccl_group``,
#: ``ray.util.collective``'s ``nccl_util``): CuPy's binding of libnccl.
NCCL_BINDING = "cupy.cuda.nccl"


def uses_nccl_channels(kind: str, device: str, num_stages: int) -> bool:
    """Whether a ``kind`` transport over ``num_stages`` stages on ``device`` sends activations
    over Ray's NCCL channels (a compiled graph between GPU stages)."""
    return kind == "compiled" and device == "cuda" and num_stages > 1


def check_nccl_binding() -> None:
    """Fail now, naming what is missing, if Ray's NCCL channels could not be built here: Ray
    imports ``cupy.cuda.nccl`` only when it compiles the graph, and its error then says neither
    which module nor how to get it. CuPy's module imports even without libnccl, with
    ``available`` false and none of the functions Ray calls."""
    fix = ("install the gpu extra (pip install -e '.[gpu]', which brings cupy-cuda13x) in every "
           "node's image, or set parallel.transport: actor (plain actor calls, no NCCL channels)")
    try:
        nccl = importlib.import_module(NCCL_BINDING)
    except ImportError as exc:
        raise RuntimeError(f"a GPU pipeline's compiled graph sends activations over Ray's NCCL channels, "
                           f"which need {NCCL_BINDING} (CuPy's NCCL binding); importing it failed: {exc}. "
                           f"Fix: {fix}") from exc
    if not getattr(nccl, "available", False) or not hasattr(nccl, "get_unique_id"):
        raise RuntimeError(f"{NCCL_BINDING} is installed but could not load libnccl (its `available` is "
                           "false), and Ray's NCCL channels need it: install NCCL for CUDA 13 on the node "
                           "(e.g. the nvidia-nccl-cu13 wheel torch ships with, or "
                           "`python -m cupyx.tools.install_library --library nccl --cuda 13.x`), "
                           "or set parallel.transport: actor")


def check_worker_can_use_nccl_channels(needed: bool) -> None:
    """In a stage worker as it starts, when its pipeline sends activations over NCCL channels:
    torch is loaded first (the libnccl its wheel ships is what CuPy's binding finds), then the
    binding is checked (``check_nccl_binding``)."""
    if not needed:
        return
    import torch  # noqa: F401

    check_nccl_binding()
