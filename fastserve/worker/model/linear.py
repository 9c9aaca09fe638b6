"""``ServingLinear``: an ``nn.Linear`` whose CPU GEMMs run on a weight packed once for them.

Owns the one choice of how a decoder's linear layers multiply on CPU. After the weights are
loaded, ``pack()`` reorders the weight once (``PackedWeight``): into oneDNN's blocked layout
(``torch.ops.mkldnn``, the kernels torch's own inductor uses for frozen CPU linears), or, for
bfloat16 off Intel, into the layout of our own AVX-512 BF16 kernel (``fastserve.kernels.cpu_linear``:
oneDNN streamed a decode step's bf16 weights at 11-17 GB/s on the AMD EPYC Zen 4, ours at
20-26). Every call then skips MKL's per-call packing of the weight, which dominates the few-row
GEMMs of decode steps. Values equal ``F.linear``'s to the dtype's rounding.

Which rows go where is measured per CPU (``packed_row_bounds``):

* float32 on Intel (the 2-core Xeon with AMX, per 768x3072 GEMM): packed 1.4-2x faster at 4-16
  rows, ~1.2x at 177; a single row is faster on MKL's GEMV (0.34 vs 0.38 ms) and whole prompts
  (680-2,700 rows) 3-6 % faster on MKL. So packed for 2-256 rows only.
* float32 elsewhere (2-core AMD EPYC Zen 4): MKL takes its slow generic path on a non-Intel CPU,
  and packed wins at every row count: SmolLM2's LM head (49,152x576) 6.9 vs 13.9 ms at 1 row,
  328 vs 564 ms at 1,024; its MLP up-projection (3,072x576) 0.07 vs 0.14 ms at 1 row, 17.5 vs
  21.2 ms at 1,024. So packed for every row count.
* bfloat16 where the CPU has native bf16 (``fastserve.kernels.cpu_features``): packed at every row count
  (AMD EPYC: oneDNN's LM head 3.4 ms at 1 row against 5.2 for ``F.linear`` in bf16, 6.9 in
  packed fp32; our kernel below that: ``bf16_kernel_chosen``). Without native bf16 a bf16 weight
  is not packed (oneDNN would emulate it).

Parameter names stay ``weight``/``bias``, so checkpoints load as into ``nn.Linear``. Without
oneDNN, on another device or dtype, or before ``pack()``, it is exactly ``nn.Linear``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastserve.kernels import cpu_linear, huge_pages
from fastserve.kernels.cpu_features import cpu_has_bf16, cpu_vendor

#: Row count the packed layout is tuned for (a decode batch); any row count is served.
PACK_BATCH_HINT = 16
#: float32 rows outside [min, max] use ``F.linear`` on Intel CPUs (MKL's own ground; see above).
INTEL_PACKED_MIN_ROWS = 2
INTEL_PACKED_MAX_ROWS = 256
#: Intel's ``vendor_id``: the CPUs whose MKL paths the bounds above were measured against.
INTEL_VENDOR = "GenuineIntel"
#: No upper bound on the rows of a packed GEMM.
UNBOUNDED = 1 << 62
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
#: Which kernel a packed weight runs on: oneDNN's blocked GEMM, or ours for bf16 (fastserve.kernels.cpu_linear).
ONEDNN = "onednn"
BF16_KERNEL = "bf16_kernel"

_log = logging.getLogger(__name__)


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN's prepacked linear for ``dtype`` (probed once per dtype,
    on a tiny case); bfloat16 only on a CPU with native bf16."""
    if dtype == torch.bfloat16 and not cpu_has_bf16():
        return False
    try:
        w = torch.randn(4, 8).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        out = torch.ops.mkldnn._linear_pointwise(torch.randn(2, 8).to(dtype), packed, None, "none", [], "")
        return bool(out.shape == (2, 4))
    except (RuntimeError, AttributeError) as exc:
        _log.info("oneDNN prepacked linear unavailable for %s (%s); using F.linear", dtype, exc)
        return False


@functools.cache
def packed_row_bounds(dtype: torch.dtype) -> tuple[int, int]:
    """Row counts ``[min, max]`` of the GEMMs that run packed on this CPU (see the module note)."""
    if dtype == torch.float32 and cpu_vendor() == INTEL_VENDOR:
        return INTEL_PACKED_MIN_ROWS, INTEL_PACKED_MAX_ROWS
    return 1, UNBOUNDED


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight reordered once for this CPU's GEMM, and the kernel that reads it."""

    data: torch.Tensor
    kernel: str   # ONEDNN or BF16_KERNEL

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for a 2-d ``x``."""
        if self.kernel == BF16_KERNEL:
            return cpu_linear.linear(x, self.data, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")


def _kernel_data(packed: PackedWeight | None) -> torch.Tensor | None:
    return packed.data if packed is not None and packed.kernel == BF16_KERNEL else None


class ServingLinear(nn.Linear):
    _packed: PackedWeight | None = None

    def pack(self) -> bool:
        """Prepack the weight for CPU GEMMs; False (and nothing changes) elsewhere."""
        self._packed = pack_weight(self.weight)
        return self._packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.multiply(x, with_bias=True)

    def kernel_weight(self) -> torch.Tensor | None:
        """The weight as ``fastserve.kernels.cpu_linear`` packed it, where it is so and has no bias."""
        return _kernel_data(self._packed) if self.bias is None else None

    def multiply(self, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
        """``x @ weight.T`` (+ bias when ``with_bias``): row-parallel layers add their bias once,
        after the all-reduce."""
        return multiply(x, self.weight, self._packed, self.bias if with_bias else None)


@functools.cache
def bf16_kernel_chosen() -> bool:
    """Whether bf16 weights go to our kernel (``fastserve.kernels.cpu_linear``) rather than oneDNN: where it
    built, off Intel. On the AMD EPYC Zen 4 it beat oneDNN's packed bf16 GEMM at 1-256 rows
    (0.65-0.90x) and matched it on whole prompts (0.93-1.08x per weight at 256-2,048 rows); Intel
    CPUs with AMX keep oneDNN, whose AMX path was not measured against it."""
    return cpu_vendor() != INTEL_VENDOR and cpu_linear.available()


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` ([out, in]) reordered once for CPU GEMMs: bf16 for our kernel where it is
    chosen and the shape fits it, else oneDNN's blocked layout (float32, or bfloat16 on a CPU with
    native bf16); None (use ``weight`` as it is) on another device or dtype, or without oneDNN."""
    if weight.dtype == torch.bfloat16 and bf16_kernel_chosen() and cpu_linear.fits(weight):
        return PackedWeight(cpu_linear.pack(weight), BF16_KERNEL)
    if (weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES
            or not onednn_linear_available(weight.dtype)):
        return None
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT), ONEDNN)


def multiply(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None,
             bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on ``packed`` (``pack_weight(weight)``) for the row counts
    where this CPU runs it faster (``packed_row_bounds``)."""
    if packed is None or x.dim() != 2:
        return F.linear(x, weight, bias)
    low, high = packed_row_bounds(weight.dtype)
    if not low <= x.shape[0] <= high:
        return F.linear(x, weight, bias)
    return packed.matmul(x, bias)


def multiply_widened(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor:
    """``multiply(x, weight, packed, None).float()``, bit for bit (a model's logits): where our bf16
    kernel runs the product it writes the float32 values itself, with no pass to widen them."""
    if packed is not None and packed.kernel == BF16_KERNEL and x.dim() == 2:
        low, high = packed_row_bounds(weight.dtype)
        if low <= x.shape[0] <= high:
            return cpu_linear.linear(x, packed.data, None, widened=True)
    return multiply(x, weight, packed, None).float()


class MergedLinear:
    """Linears that read the same input (q/k/v; gate/up), multiplied as one GEMM.

    vLLM merges them at load time (``QKVParallelLinear``, ``MergedColumnParallelLinear``); here
    the members stay separate ``ServingLinear`` modules, so checkpoints load and shard by their
    own names, and ``pack()`` packs their concatenated weight (and biases) once. A decode step
    then makes one GEMM call where it made two or three: on the 2-core AMD EPYC Zen 4, bf16 on
    oneDNN, 30 layers of SmolLM2-135M's linears with cold weights took 20.4 ms at 1 row as 7 GEMMs
    per layer and 15.9 ms as 4 (fewer calls, each streaming a longer weight).

    Not a module (its members are the layer's own, registered there): a plain attribute made with
    the layer and packed after the weights are loaded. Before ``pack()``, or where packing does
    not apply (another device or dtype, no oneDNN, or a row count this CPU runs on ``F.linear``),
    each member multiplies on its own, exactly as without the merge.

    On a GPU ``pack()`` concatenates the members' weights (and biases) into one tensor and makes
    each member's parameter a view of its rows, so the merged GEMM costs no extra memory and a
    checkpoint loaded afterwards still lands in it; every call is then one ``F.linear``.
    """

    def __init__(self, *members: ServingLinear) -> None:
        self.members = members
        self.widths = [m.out_features for m in members]
        self._packed: PackedWeight | None = None
        self._bias: torch.Tensor | None = None
        self._fused: torch.Tensor | None = None

    def pack(self) -> bool:
        """Pack the members' concatenated weight (on a GPU: fuse them in place, ``fuse``); False
        (members used one by one) where packing does not apply or the members disagree on having
        a bias."""
        with_bias = [m.bias is not None for m in self.members]
        if any(with_bias) and not all(with_bias):
            return False
        if self.members[0].weight.is_cuda:
            return self.fuse(all(with_bias))
        self._packed = pack_weight(torch.cat([m.weight.detach() for m in self.members]))
        if self._packed is not None and all(with_bias):
            self._bias = torch.cat([m.bias.detach() for m in self.members if m.bias is not None])
        return self._packed is not None

    def fuse(self, with_bias: bool) -> bool:
        """One weight (and bias) tensor for all members, each member's parameter a view of it."""
        weight = torch.cat([m.weight.detach() for m in self.members])
        bias = torch.cat([m.bias.detach() for m in self.members if m.bias is not None]) if with_bias else None
        for m, rows in zip(self.members, weight.split(self.widths), strict=True):
            m.weight.data = rows
        if bias is not None:
            for m, part in zip(self.members, bias.split(self.widths), strict=True):
                assert m.bias is not None
                m.bias.data = part
        self._fused, self._bias = weight, bias
        return True

    def kernel_weight(self) -> torch.Tensor | None:
        """The merged weight as ``fastserve.kernels.cpu_linear`` packed it, where it is so and has no bias."""
        return _kernel_data(self._packed) if self._bias is None else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each member's ``F.linear(x, weight, bias)``, in order (views of one output when merged)."""
        if self._fused is not None:
            return list(F.linear(x, self._fused, self._bias).split(self.widths, dim=-1))
        if self._packed is None or x.dim() != 2:
            return [m(x) for m in self.members]
        low, high = packed_row_bounds(self.members[0].weight.dtype)
        if not low <= x.shape[0] <= high:
            return [m(x) for m in self.members]
        return list(self._packed.matmul(x, self._bias).split(self.widths, dim=-1))


def place_on_huge_pages(root: nn.Module, *extra: PackedWeight | None) -> int:
    """Move the weights packed for ``fastserve.kernels.cpu_linear`` under ``root`` (and ``extra``: a head
    packed apart) onto one huge-page mapping, in place (``fastserve.kernels.huge_pages.relocate``: why);
    returns the bytes moved (0 where huge pages are not available)."""
    found = [m._packed for m in root.modules() if isinstance(m, ServingLinear)]
    found += [v._packed for m in root.modules() for v in vars(m).values() if isinstance(v, MergedLinear)]
    data = {id(d): d for d in (_kernel_data(p) for p in (*found, *extra)) if d is not None}
    return huge_pages.relocate(list(data.values()))


def pack_linears(root: nn.Module) -> int:
    """Prepack every linear under ``root`` for CPU GEMMs: each ``MergedLinear`` (an attribute of a
    module under ``root``) as one weight, every other ``ServingLinear`` alone; a member of a merge
    that could not pack is packed alone. Returns how many GEMM weights were packed."""
    merged = [v for m in root.modules() for v in vars(m).values() if isinstance(v, MergedLinear)]
    covered: set[int] = set()
    count = 0
    for group in merged:
        if group.pack():
            count += 1
            covered.update(id(m) for m in group.members)
    for m in root.modules():
        if isinstance(m, ServingLinear) and id(m) not in covered:
            count += m.pack()
    return count
