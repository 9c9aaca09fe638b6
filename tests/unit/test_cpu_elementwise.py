"""Our CPU bf16 elementwise kernels (``fastserve.kernels.cpu_elementwise``) against the torch reference.

The rotary embedding and the residual add are torch's bits exactly (bf16 products are exact in
float32, and each rounding is torch's). The norm's sum of squares runs in another order and
silu's exp is our polynomial, so an output may sit one bf16 step from torch's where the float32
value lies near a rounding boundary, and silu may give -0 where torch gives a value below 1e-30
(exp's overflow threshold). Skipped where the kernels did not build with AVX-512 BF16.
"""

from __future__ import annotations

import pytest
import torch

from fastserve import kernels
from fastserve.kernels import cpu_elementwise, reference
from fastserve.worker.model.rope import Rotary

pytestmark = pytest.mark.skipif(not cpu_elementwise.available(),
                                reason="the C compiler does not target AVX-512 BF16 on this machine")

HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 64, 1536
#: Below this, silu(x) for x < -88 is exp's overflow threshold, not a value (torch: tiny, ours: -0).
TINY = 1e-30


def one_bf16_step(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at each element of ``t`` (8 significant bits)."""
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32),
                       torch.frexp(t.float().abs().clamp_min(TINY)).exponent - 8)


def within_one_step(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(((ours.float() - ref.float()).abs() <= one_bf16_step(ref)).all())


@pytest.mark.parametrize("rows, magnitude", [(1, 0.1), (7, 1.0), (33, 40.0), (300, 3.0)])
def test_rms_norm_with_and_without_the_residual_add(rows: int, magnitude: float) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, HIDDEN) * magnitude).bfloat16()
    delta = (torch.randn(rows, HIDDEN) * magnitude).bfloat16()
    weight = torch.randn(HIDDEN).bfloat16()
    total, normed = cpu_elementwise.rms_norm(x, weight, 1e-5, delta)
    ref_total, ref_normed = reference.rms_norm(x, weight, 1e-5, delta)
    assert torch.equal(total, ref_total)
    assert normed.shape == (rows, HIDDEN) and normed.dtype == torch.bfloat16
    assert within_one_step(normed, ref_normed)
    alone, alone_normed = cpu_elementwise.rms_norm(x, weight, 1e-5)
    assert alone is x
    assert within_one_step(alone_normed, reference.rms_norm(x, weight, 1e-5)[1])


def test_rms_norm_reads_strided_rows_and_odd_widths() -> None:
    # A view with a row stride (a slice of a wider activation), and a width not a multiple of 16.
    torch.manual_seed(1)
    wide = torch.randn(5, 100).bfloat16()
    x, weight = wide[:, :90], torch.randn(90).bfloat16()
    assert within_one_step(cpu_elementwise.rms_norm(x, weight, 1e-6)[1], reference.rms_norm(x, weight, 1e-6)[1])


@pytest.mark.parametrize("rows, magnitude", [(1, 1.0), (33, 120.0), (300, 3.0)])
def test_silu_mul_on_views_of_a_merged_projection(rows: int, magnitude: float) -> None:
    torch.manual_seed(rows)
    merged = (torch.randn(rows, 2 * INTERMEDIATE) * magnitude).bfloat16()
    gate, up = merged.split(INTERMEDIATE, dim=-1)
    ours, ref = cpu_elementwise.silu_mul(gate, up), reference.silu_mul(gate, up)
    assert ours.shape == (rows, INTERMEDIATE) and ours.is_contiguous()
    close = (ours.float() - ref.float()).abs() <= one_bf16_step(ref)
    underflow = (ours.float().abs() < TINY) & (ref.float().abs() < TINY)
    assert bool((close | underflow).all())


def test_silu_at_the_edges_of_exp() -> None:
    edges = [-200.0, -100.0, -20.0, -1e-30, 0.0, 1e-30, 3.0, 20.0, 88.0, 89.0, 200.0,
             float("inf"), float("-inf"), float("nan")]
    gate = torch.tensor([edges]).bfloat16()
    ours = cpu_elementwise.silu_mul(gate, torch.ones_like(gate))
    ref = reference.silu_mul(gate, torch.ones_like(gate))
    # silu(-inf) is -inf / inf and silu(nan) nan, in torch and here.
    assert torch.equal(ours[:, :-2], ref[:, :-2])
    assert bool(ours[0, -2:].isnan().all()) and bool(ref[0, -2:].isnan().all())


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rotary_is_the_reference_bit_for_bit(tokens: int) -> None:
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, HEADS * HEAD_DIM + 2 * 3 * HEAD_DIM).bfloat16()
    q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)   # strided rows, as the model's
    cos, signed_sin = Rotary(HEAD_DIM, 10000.0, None).cos_sin(torch.randint(0, 8192, (tokens,)), torch.bfloat16)
    ours = cpu_elementwise.rotate(q, cos, signed_sin)
    assert ours.is_contiguous()
    assert torch.equal(ours, reference.rotate(q, cos, signed_sin))


def test_what_does_not_fit_goes_to_the_reference() -> None:
    x32 = torch.randn(3, HIDDEN)
    w32 = torch.ones(HIDDEN)
    assert not cpu_elementwise.fits_rms_norm(x32, w32, None)
    assert torch.equal(kernels.rms_norm(x32, w32, 1e-5)[1], reference.rms_norm(x32, w32, 1e-5)[1])
    with pytest.raises(ValueError, match="do not fit the kernel"):
        cpu_elementwise.rms_norm(x32, w32, 1e-5)
    columns = torch.randn(HIDDEN, 3).bfloat16().T          # rows not contiguous
    assert not cpu_elementwise.fits_silu_mul(columns, columns)
    odd_heads = torch.randn(2, 4, 48).bfloat16()           # half of 48 is not a whole register
    cos = torch.ones(2, 1, 48).bfloat16()
    assert not cpu_elementwise.fits_rotary(odd_heads, cos, cos)
    assert torch.equal(kernels.rotate(odd_heads, cos, cos), reference.rotate(odd_heads, cos, cos))


def test_the_dispatcher_takes_the_kernels_for_bf16_and_honours_the_forced_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight = torch.randn(2, HIDDEN).bfloat16(), torch.randn(HIDDEN).bfloat16()
    calls: list[str] = []
    real = cpu_elementwise.rms_norm
    monkeypatch.setattr(cpu_elementwise, "rms_norm", lambda *a: calls.append("c") or real(*a))
    kernels.rms_norm(x, weight, 1e-5)
    assert calls == ["c"]
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, kernels.TORCH_BACKEND)
    kernels.rms_norm(x, weight, 1e-5)
    assert calls == ["c"]
