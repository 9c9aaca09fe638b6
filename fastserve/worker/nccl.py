"""Whether a pipeline's activations travel over Ray's NCCL channels, and whether this process can
build them (CuPy's NCCL binding, checked in each stage worker after torch, before any weight).
"""

from __future__ import annotations

import importlib

#: CuPy's binding of libnccl, which Ray's NCCL channels import.
NCCL_BINDING = "cupy.cuda.nccl"


def uses_nccl_channels(kind: str, device: str, num_stages: int) -> bool:
    """Whether activations go over Ray's NCCL channels: a compiled graph between GPU stages."""
    return kind == "compiled" and device == "cuda" and num_stages > 1


def check_nccl_binding() -> None:
    """Fail now, naming what is missing (Ray's error at compile time names neither)."""
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
    """Load torch first (CuPy finds the libnccl its wheel ships), then ``check_nccl_binding``."""
    if not needed:
        return
    import torch  # noqa: F401

    check_nccl_binding()
