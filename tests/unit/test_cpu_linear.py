"""Our CPU bf16 linear kernel (``fastserve.kernels.cpu_linear``) against ``F.linear`` in bf16.

Both sum bf16 products in float32 and round once; the summation order differs, so an output
may differ by one bf16 step where the float32 sum lies near a rounding boundary. Skipped where
the kernel did not build with AVX-512 BF16 (the model then stays on oneDNN).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastserve.kernels import cpu_linear
from fastserve.worker.model.linear import BF16_KERNEL, PackedWeight, multiply, multiply_widened

pytestmark = pytest.mark.skipif(not cpu_linear.available(),
                                reason="the C compiler does not target AVX-512 BF16 on this machine")


def one_bf16_step(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at each element of ``t`` (8 significant bits)."""
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32),
                       torch.frexp(t.float().abs().clamp_min(1e-30)).exponent - 8)


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 300, 600])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_f_linear_to_one_bf16_step(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 70).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 70).to(torch.bfloat16)
    ours = cpu_linear.linear(x, cpu_linear.pack(weight), bias)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    ref = F.linear(x, weight, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, 96)
    # Within one bf16 step of F.linear, and as close to the exact sum as F.linear is.
    assert bool(((ours.float() - ref.float()).abs() <= one_bf16_step(ref)).all())
    assert float((ours.double() - exact).abs().max()) <= float((ref.double() - exact).abs().max()) + \
        float(one_bf16_step(exact).max())


def test_kernel_reads_strided_rows_and_refuses_what_does_not_fit() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 32).to(torch.bfloat16)
    wide = torch.randn(5, 48).to(torch.bfloat16)
    x = wide[:, 8:40]                                  # rows 48 elements apart
    packed = cpu_linear.pack(weight)
    assert torch.equal(cpu_linear.linear(x, packed, None), cpu_linear.linear(x.contiguous(), packed, None))
    assert cpu_linear.linear(x[:0], packed, None).shape == (0, 64)
    assert not cpu_linear.fits(torch.randn(48, 32).to(torch.bfloat16))    # out not a multiple of 32
    assert not cpu_linear.fits(torch.randn(64, 33).to(torch.bfloat16))    # odd in features
    assert not cpu_linear.fits(weight.float())
    with pytest.raises(ValueError, match="not the bf16 kernel's"):
        cpu_linear.pack(weight.float())
    with pytest.raises(ValueError, match="does not fit a bf16 CPU weight of 32 in features"):
        cpu_linear.linear(torch.randn(2, 30).to(torch.bfloat16), packed, None)


@pytest.mark.parametrize("rows", [1, 9, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_widened_output_is_the_bf16_output_as_float32_bit_for_bit(rows: int, with_bias: bool) -> None:
    """Logits straight from the kernel in float32 are the bf16 results ``.float()`` gives, and
    the model's head call (``multiply_widened``) takes that path for a packed bf16 weight."""
    torch.manual_seed(rows)
    weight = torch.randn(160, 64).to(torch.bfloat16)
    bias = torch.randn(160).to(torch.bfloat16) if with_bias else None
    wide = (torch.randn(rows, 70) * 3).to(torch.bfloat16)
    x = wide[:, 2:66]
    packed = cpu_linear.pack(weight)
    widened = cpu_linear.linear(x, packed, bias, widened=True)
    assert widened.dtype == torch.float32 and widened.shape == (rows, 160)
    assert torch.equal(widened, cpu_linear.linear(x, packed, bias).float())
    head = PackedWeight(packed, BF16_KERNEL)
    assert torch.equal(multiply_widened(x, weight, head), multiply(x, weight, head, None).float())
    assert torch.equal(multiply_widened(x, weight, None), F.linear(x, weight).float())


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32, 300])
def test_fused_swiglu_is_linear_then_silu_mul_bit_for_bit(rows: int) -> None:
    """``linear_bf16_swiglu`` (the step's MLP first half) gives exactly what the gate/up linear
    followed by the elementwise kernels' ``silu_mul`` gives, on rows of a wider matrix, with
    gates large enough in both signs to reach exp's clamp."""
    from fastserve.kernels import cpu_elementwise

    if not cpu_elementwise.available():
        pytest.skip("the elementwise kernels did not build here")
    torch.manual_seed(rows)
    inter, hidden = 48, 70
    weight = (torch.randn(2 * inter, hidden) * 3).to(torch.bfloat16)   # gate rows, then up rows
    wide = (torch.randn(rows, hidden + 6) * 4).to(torch.bfloat16)
    x = wide[:, 6:]
    packed = cpu_linear.pack(weight)
    gate_up = cpu_linear.linear(x, packed, None)
    want = cpu_elementwise.silu_mul(gate_up[:, :inter], gate_up[:, inter:])
    act = torch.full((rows, inter), 9.0, dtype=torch.bfloat16)
    cpu_linear.library().linear_bf16_swiglu(x.data_ptr(), rows, hidden, x.stride(0), packed.data_ptr(), inter,
                                            act.data_ptr(), 2)
    assert torch.equal(act, want)
    assert float(gate_up[:, :inter].float().min()) < -104        # exp's clamp (EXP_ARG_MAX) was reached
