"""Rotary position embeddings for the LLaMA family (``linear`` and ``llama3`` scaling), in the
half-split form HF checkpoints use: dimension ``i`` pairs with ``i + head_dim/2``. Frequencies are
float32; cos/sin are computed per batch in float32 and cast to the activations' dtype."""

from __future__ import annotations

import math

import torch

from fastserve import kernels
from fastserve.worker.model.llama_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """``[head_dim / 2]`` float32 rotation frequencies (radians per position)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    return _llama3_frequencies(inv_freq, scaling)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths (low frequencies) are divided by ``factor``, short ones
    kept, and the band between the two cut-offs interpolated smoothly."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class Rotary:
    """The rotation of one model; ``cos_sin`` once per batch, ``apply`` to q and k of each layer."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        # A plain attribute, not a buffer: ``module.to(float16)`` must not round the frequencies.
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        # One copy per device: a per-forward copy syncs and cannot be captured in a CUDA graph.
        self._on_device: dict[torch.device, torch.Tensor] = {self.inv_freq.device: self.inv_freq}

    def frequencies_on(self, device: torch.device) -> torch.Tensor:
        freq = self._on_device.get(device)
        if freq is None:
            freq = self._on_device[device] = self.inv_freq.to(device)
        return freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and signed ``sin`` (first half negated), each ``[T, 1, head_dim]``, for ``positions [T]``."""
        inv_freq = self.frequencies_on(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        sin = angles.sin()
        return torch.cat((angles, angles), dim=-1)[:, None, :].cos().to(dtype), \
            torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]``: ``x * cos + rotate_half(x) * sin``."""
        return kernels.rotate(x, cos, signed_sin)
