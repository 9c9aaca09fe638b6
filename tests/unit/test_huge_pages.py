"""fastserve.kernels.huge_pages: the step's large tensors on advised huge-page mappings, values unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fastserve.kernels import cpu_linear, huge_pages
from fastserve.kernels.cpu_features import cpu_has_bf16
from fastserve.worker.model.gemm_choice import CACHE_DIR_ENV, FIXED, MEASURE, GemmPolicy
from fastserve.worker.model.linear import ServingLinear, place_on_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="transparent huge pages are off here")


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``address``: its range and fields."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if entry is not None:
                return entry
            if int(head.group(1), 16) <= address < int(head.group(2), 16):
                entry = {"range": line.split()[0]}
        elif entry is not None and ":" in line:
            key, value = line.split(":", 1)
            entry[key] = value.strip()
    assert entry is not None, f"no mapping holds {address:#x}"
    return entry


@needs_thp
def test_zeros_are_zero_aligned_and_advised_for_huge_pages() -> None:
    pool = huge_pages.zeros((3, 1024, 1024), torch.bfloat16)   # 6 MiB
    assert pool.shape == (3, 1024, 1024) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert pool.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert int(pool.count_nonzero()) == 0
    pool[2, 1023, 1023] = 5.0
    assert float(pool.sum()) == 5.0
    assert mapping_of(pool.data_ptr())["THPeligible"] == "1"


def test_small_or_unadvisable_zeros_are_torch_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    small = huge_pages.zeros((4, 8), torch.float32)
    assert small.shape == (4, 8) and int(small.count_nonzero()) == 0
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    big = huge_pages.zeros((2, 1024, 1024), torch.float32)
    assert big.shape == (2, 1024, 1024) and int(big.count_nonzero()) == 0


@needs_thp
def test_relocate_moves_tensors_in_place_onto_one_mapping() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(700, 1000).to(torch.bfloat16), torch.randn(33).to(torch.bfloat16),
               torch.randn(600, 900)]
    values = [t.clone() for t in tensors]
    holders = {"first": tensors[0]}   # another owner of the same tensor object
    moved = huge_pages.relocate(tensors)
    sizes = [t.numel() * t.element_size() for t in tensors]
    assert moved == 1_400_128 + 2_160_000   # the second's 66 bytes padded to 128: the third starts aligned
    starts = [t.data_ptr() for t in tensors]
    assert starts[0] % huge_pages.HUGE_PAGE_BYTES == 0
    assert starts[1] == starts[0] + sizes[0] and starts[2] == starts[1] + 128
    assert all(torch.equal(t, v) for t, v in zip(tensors, values, strict=True))
    assert holders["first"].data_ptr() == starts[0]
    assert mapping_of(starts[0])["range"] == mapping_of(starts[2])["range"]
    assert mapping_of(starts[0])["THPeligible"] == "1"


def test_relocate_leaves_what_it_cannot_place(monkeypatch: pytest.MonkeyPatch) -> None:
    small = torch.ones(1000)
    before = small.data_ptr()
    assert huge_pages.relocate([small]) == 0 and small.data_ptr() == before   # under one huge page
    with pytest.raises(ValueError, match=r"not a contiguous CPU tensor"):
        huge_pages.relocate([torch.ones(2048, 2048).t()])
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    big = torch.ones(1024, 1024)
    before = big.data_ptr()
    assert huge_pages.relocate([big]) == 0 and big.data_ptr() == before


def _two_linears() -> torch.nn.Sequential:
    torch.manual_seed(1)
    return torch.nn.Sequential(ServingLinear(1024, 1024, bias=False),
                               ServingLinear(1024, 512, bias=False)).to(torch.bfloat16).requires_grad_(False)


@needs_thp
@pytest.mark.skipif(not cpu_linear.available(), reason="the bf16 linear kernel did not build here (no AVX-512 BF16)")
def test_packed_linears_multiply_the_same_on_huge_pages() -> None:
    """Weights packed for our kernel (``fixed``: ours where it builds), moved after
    packing, give the same products, bit for bit."""
    root = _two_linears()
    assert all(m.pack(GemmPolicy(FIXED)) for m in root)
    x = torch.randn(5, 1024).to(torch.bfloat16)
    before = [m(x) for m in root]
    assert place_on_huge_pages(root) == 2 * 1024 * 1024 + 1024 * 512 * 2
    weights = [m.kernel_weight() for m in root]
    assert all(w is not None and mapping_of(w.data_ptr())["THPeligible"] == "1" for w in weights)
    assert all(torch.equal(m(x), b) for m, b in zip(root, before, strict=True))


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16: nothing is packed in bf16")
def test_the_measured_paths_move_what_is_in_our_layout_and_multiply_the_same(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this CPU's timing chose: the weights in our kernel's layout move (oneDNN's
    packed weights are opaque tensors and stay), and every product is unchanged."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    root = _two_linears()
    for m in root:
        m.pack(GemmPolicy(MEASURE))
    x = torch.randn(5, 1024).to(torch.bfloat16)
    before = [m(x) for m in root]
    ours = [w for w in (m.kernel_weight() for m in root) if w is not None]
    expected = sum(w.numel() * 2 for w in ours)
    moved = place_on_huge_pages(root)
    assert moved == (expected if huge_pages.available() and expected >= huge_pages.HUGE_PAGE_BYTES else 0)
    assert all(torch.equal(m(x), b) for m, b in zip(root, before, strict=True))
