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
from fastserve.worker.model import gemm_choice as G
from fastserve.worker.model.gemm_choice import GemmChoice
from fastserve.worker.model.linear import PackedWeight, multiply, multiply_widened

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
    head = PackedWeight(GemmChoice.single(G.DPBF16), ours=packed)
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
                                            act.data_ptr(), 2, cpu_linear.DPBF16)
    assert torch.equal(act, want)
    assert float(gate_up[:, :inter].float().min()) < -104        # exp's clamp (EXP_ARG_MAX) was reached


#: Our kernel's paths; AMX's own arithmetic only where the CPU has AMX (else it runs UNIFORM's).
PATHS = [cpu_linear.DPBF16, cpu_linear.UNIFORM, cpu_linear.AMX]


@pytest.mark.parametrize("path", PATHS, ids=[cpu_linear.PATH_NAMES[p] for p in PATHS])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 300])
def test_every_path_equals_f_linear_to_one_bf16_step(path: int, rows: int) -> None:
    """Each path rounds one float32 sum per output, as ``F.linear`` does: within one bf16 step,
    on strided rows, with a bias, in features a multiple of AMX's 32 (AMX's tiles) and not."""
    torch.manual_seed(rows)
    for in_features in (96, 70):
        weight = torch.randn(64, in_features).to(torch.bfloat16)
        bias = torch.randn(64).to(torch.bfloat16)
        x = torch.randn(rows, in_features + 4).to(torch.bfloat16)[:, 4:]
        ours = cpu_linear.linear(x, cpu_linear.pack(weight), bias, path=path)
        ref = F.linear(x, weight, bias)
        assert bool(((ours.float() - ref.float()).abs() <= one_bf16_step(ref)).all())
    with pytest.raises(ValueError, match="path must be one of"):
        cpu_linear.linear(x, cpu_linear.pack(weight), None, path=7)


@pytest.mark.parametrize("path", [cpu_linear.UNIFORM, cpu_linear.AMX], ids=["dpbf16_uniform", "amx"])
def test_the_invariant_paths_give_a_row_the_same_bits_whatever_shares_the_call(path: int) -> None:
    """Batch-invariant mode's GEMMs: a row alone, among 12, among 300 (AMX's padded tail tiles
    and its whole ones; the row panels) gives the same bits, as does the fused SwiGLU."""
    torch.manual_seed(0)
    weight = torch.randn(128, 576).to(torch.bfloat16)
    packed = cpu_linear.pack(weight)
    x = torch.randn(300, 576).to(torch.bfloat16)
    whole = cpu_linear.linear(x, packed, None, path=path)
    for lo, hi in ((0, 1), (5, 6), (0, 12), (7, 19), (256, 300), (299, 300)):
        assert torch.equal(cpu_linear.linear(x[lo:hi], packed, None, path=path), whole[lo:hi]), (lo, hi)
    act = cpu_linear.swiglu(x, packed, path)
    assert torch.equal(cpu_linear.swiglu(x[17:18], packed, path), act[17:18])
    assert torch.equal(cpu_linear.swiglu(x[:29], packed, path), act[:29])


def test_the_split_path_gives_a_lone_row_its_own_order() -> None:
    """DPBF16 sums a lone row on four chains (its fastest), so only UNIFORM and AMX are
    invariant; at two rows or more DPBF16 is UNIFORM's arithmetic."""
    torch.manual_seed(1)
    weight = torch.randn(64, 576).to(torch.bfloat16)
    packed = cpu_linear.pack(weight)
    x = torch.randn(9, 576).to(torch.bfloat16)
    assert torch.equal(cpu_linear.linear(x, packed, None, path=cpu_linear.DPBF16),
                       cpu_linear.linear(x, packed, None, path=cpu_linear.UNIFORM))


@pytest.mark.skipif(cpu_linear.amx_available(), reason="this CPU runs AMX tiles: AMX is its own arithmetic here")
def test_without_amx_the_amx_path_is_the_uniform_one() -> None:
    torch.manual_seed(2)
    weight = torch.randn(64, 96).to(torch.bfloat16)
    x = torch.randn(20, 96).to(torch.bfloat16)
    packed = cpu_linear.pack(weight)
    assert torch.equal(cpu_linear.linear(x, packed, None, path=cpu_linear.AMX),
                       cpu_linear.linear(x, packed, None, path=cpu_linear.UNIFORM))
    assert cpu_linear.paths() == (cpu_linear.DPBF16,)
