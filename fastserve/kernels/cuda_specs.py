"""What the CUDA kernels in ``cuda/`` are built for, shared by the dispatcher (which must not import
cupy) and ``cupy_ops``."""

from __future__ import annotations

import torch

# Kernel-name suffix of each dtype the .cu sources are instantiated for.
CUDA_KERNEL_SUFFIX: dict[torch.dtype, str] = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
}
# MAX_HEAD_DIM in fastserve/kernels/cuda/paged_attention.cu.
PAGED_ATTENTION_MAX_HEAD_DIM = 256
