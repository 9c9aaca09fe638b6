"""``ServingLinear``: an ``nn.Linear`` whose CPU GEMMs run on the path measured fastest for its shape,
its weight packed once for that path (MKL's per-call packing dominates decode's few-row GEMMs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastserve.kernels import cpu_linear, cpu_step, huge_pages
from fastserve.kernels.cpu_features import cpu_has_bf16
from fastserve.worker.model import gemm_choice as G
from fastserve.worker.model.gemm_choice import GemmChoice, GemmPolicy, GemmRole

#: Row count oneDNN's packed layout is tuned for (a decode batch); any count is served.
PACK_BATCH_HINT = 16
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
#: Our kernel's paths, by name, as ``cpu_linear`` numbers them.
OUR_PATHS = {G.DPBF16: cpu_linear.DPBF16, G.UNIFORM: cpu_linear.UNIFORM, G.AMX: cpu_linear.AMX}

_log = logging.getLogger(__name__)


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's prepacked linear runs ``dtype`` here (probed once; bf16 needs native bf16)."""
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


def candidate_paths(weight: torch.Tensor, batch_invariant: bool = False) -> list[str]:
    """The paths that can multiply ``weight`` here, ``FIXED`` mode's first: our kernel (AMX, else
    ``vdpbf16ps``), oneDNN, torch. Empty on another device or dtype (``F.linear`` alone)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        return []
    paths: list[str] = []
    if weight.dtype == torch.bfloat16 and cpu_linear.fits(weight):
        amx = cpu_linear.amx_available() and weight.shape[1] % cpu_linear.AMX_K_MULTIPLE == 0
        if batch_invariant:
            paths = [G.AMX, G.UNIFORM] if amx else [G.UNIFORM]
        else:
            paths = [G.AMX, G.DPBF16] if amx else [G.DPBF16]
    if batch_invariant:
        return paths
    if onednn_linear_available(weight.dtype):
        paths.append(G.ONEDNN)
    return [*paths, G.TORCH] if paths else []


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight packed once for the paths ``choice`` runs; a layout is kept only where read."""

    choice: GemmChoice
    ours: torch.Tensor | None = None
    onednn: torch.Tensor | None = None
    plain: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, widened: bool = False) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for a 2-d ``x`` on its row count's path; ``widened``: float32."""
        path = self.choice.path(x.shape[0])
        if path in OUR_PATHS:
            assert self.ours is not None
            return cpu_linear.linear(x, self.ours, bias, widened, OUR_PATHS[path])
        if path == G.ONEDNN:
            assert self.onednn is not None
            out = torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        else:
            assert self.plain is not None
            out = F.linear(x, self.plain, bias)
        return out.float() if widened else out

    def step_gemm(self) -> cpu_step.StepGemm:
        """This weight for ``cpu_step`` (no bias): our paths by number, the others called back."""
        ranges = tuple((rows, OUR_PATHS.get(path, cpu_step.OTHER)) for rows, path in self.choice.ranges)
        return cpu_step.StepGemm(self.ours, self.matmul, ranges)


def pack_weight(weight: torch.Tensor, choice: GemmChoice) -> PackedWeight | None:
    """``weight`` packed for ``choice``'s layouts; None unless a CPU float32/bf16 weight."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        return None
    w = weight.detach()
    ours = cpu_linear.pack(w) if choice.paths & set(OUR_PATHS) else None
    onednn = (torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
              if G.ONEDNN in choice.paths else None)
    return PackedWeight(choice, ours, onednn, w if G.TORCH in choice.paths else None)


def _packed_for(weight: torch.Tensor, choice: GemmChoice | None) -> PackedWeight | None:
    return None if choice is None else pack_weight(weight, choice)


def candidates(paths: Sequence[str]) -> G.Candidates:
    """Each path's GEMM on each of some weights, for ``gemm_choice`` to time."""
    def ours(path: int, weights: Sequence[torch.Tensor]) -> list[G.Call]:
        return [functools.partial(_ours_call, cpu_linear.pack(w), path) for w in weights]

    def onednn(weights: Sequence[torch.Tensor]) -> list[G.Call]:
        return [functools.partial(_onednn_call, torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT))
                for w in weights]

    def plain(weights: Sequence[torch.Tensor]) -> list[G.Call]:
        return [functools.partial(_plain_call, w) for w in weights]

    made: G.Candidates = {}
    for path in paths:
        if path in OUR_PATHS:
            made[path] = functools.partial(ours, OUR_PATHS[path])
        elif path == G.ONEDNN:
            made[path] = onednn
        else:
            made[path] = plain
    return made


def _ours_call(packed: torch.Tensor, path: int, x: torch.Tensor) -> torch.Tensor:
    return cpu_linear.linear(x, packed, None, path=path)


def _onednn_call(packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _plain_call(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def choose_for(role: GemmRole, policy: GemmPolicy) -> GemmChoice | None:
    """The path per row count for ``role`` (None: nothing to pack here)."""
    paths = candidate_paths(role.weights[0], policy.batch_invariant)
    if not paths:
        if policy.batch_invariant and role.weights[0].device.type == "cpu":
            G.choose(role, {}, policy, "")   # raises, naming what is missing
        return None
    return G.choose(role, candidates(paths), policy, paths[0])


class ServingLinear(nn.Linear):
    _packed: PackedWeight | None = None

    def pack(self, policy: GemmPolicy | None = None) -> bool:
        """Pack this linear alone; False (it stays ``nn.Linear``) on another device or dtype."""
        choice = choose_for(GemmRole("linear", (self.weight,)), policy or GemmPolicy())
        self._packed = _packed_for(self.weight, choice)
        return self._packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.multiply(x, with_bias=True)

    def step_gemm(self) -> cpu_step.StepGemm | None:
        return self._packed.step_gemm() if self._packed is not None and self.bias is None else None

    def kernel_weight(self) -> torch.Tensor | None:
        return None if self._packed is None else self._packed.ours

    def multiply(self, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
        """``x @ weight.T`` (+ bias): row-parallel layers add it once, after the all-reduce."""
        return multiply(x, self.weight, self._packed, self.bias if with_bias else None)


def multiply(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None,
             bias: torch.Tensor | None) -> torch.Tensor:
    if packed is None or x.dim() != 2:
        return F.linear(x, weight, bias)
    return packed.matmul(x, bias)


def multiply_widened(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor:
    """``multiply(x, weight, packed, None).float()`` bit for bit, without a widening pass where ours runs."""
    if packed is None or x.dim() != 2:
        return F.linear(x, weight).float()
    return packed.matmul(x, None, widened=True)


class MergedLinear:
    """Linears that read the same input (q/k/v; gate/up), multiplied as one GEMM; the members stay
    modules so checkpoints load and shard by name. Not a module itself: a plain attribute.
    """

    def __init__(self, *members: ServingLinear) -> None:
        self.members = members
        self.widths = [m.out_features for m in members]
        self._packed: PackedWeight | None = None
        self._bias: torch.Tensor | None = None
        self._fused: torch.Tensor | None = None

    def mergeable(self) -> bool:
        with_bias = [m.bias is not None for m in self.members]
        return all(with_bias) or not any(with_bias)

    def merged_weight(self) -> torch.Tensor:
        return torch.cat([m.weight.detach() for m in self.members])

    def pack(self, policy: GemmPolicy | None = None) -> bool:
        """Pack the merged weight; False (members used one by one) where packing does not apply."""
        if not self.mergeable():
            return False
        if self.members[0].weight.is_cuda:
            return self.fuse(self.members[0].bias is not None)
        weight = self.merged_weight()
        return self.pack_for(choose_for(GemmRole("merged", (weight,)), policy or GemmPolicy()), weight)

    def pack_for(self, choice: GemmChoice | None, weight: torch.Tensor | None = None) -> bool:
        if choice is None or not self.mergeable():
            return False
        self._packed = pack_weight(self.merged_weight() if weight is None else weight, choice)
        if self._packed is None:
            return False
        if self.members[0].bias is not None:
            self._bias = torch.cat([m.bias.detach() for m in self.members if m.bias is not None])
        return True

    def step_gemm(self) -> cpu_step.StepGemm | None:
        if self._packed is None or self._bias is not None:
            return None
        return self._packed.step_gemm()

    def fuse(self, with_bias: bool) -> bool:
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
        return None if self._packed is None else self._packed.ours

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each member's ``F.linear(x, weight, bias)``, in order."""
        if self._fused is not None:
            return list(F.linear(x, self._fused, self._bias).split(self.widths, dim=-1))
        if self._packed is None or x.dim() != 2:
            return [m(x) for m in self.members]
        return list(self._packed.matmul(x, self._bias).split(self.widths, dim=-1))


def place_on_huge_pages(root: nn.Module, *extra: PackedWeight | None) -> int:
    """Move our kernel's packed weights under ``root`` (and ``extra``) onto one huge-page mapping in
    place; the bytes moved (oneDNN's opaque packed weights stay put)."""
    found = [m._packed for m in root.modules() if isinstance(m, ServingLinear)]
    found += [v._packed for m in root.modules() for v in vars(m).values() if isinstance(v, MergedLinear)]
    data = {id(d): d for d in (p.ours for p in (*found, *extra) if p is not None) if d is not None}
    return huge_pages.relocate(list(data.values()))


@dataclass(frozen=True)
class _Unit:
    """One GEMM weight to pack: a merged group, a lone linear, or a head."""

    label: str
    weight: torch.Tensor
    target: MergedLinear | ServingLinear | None


def _units(root: nn.Module) -> list[_Unit]:
    """Every GEMM weight under ``root``: each mergeable ``MergedLinear`` as one, other linears alone."""
    units: list[_Unit] = []
    covered: set[int] = set()
    for name, module in root.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, MergedLinear) and value.mergeable():
                units.append(_Unit(f"{name}.{key}" if name else key, value.merged_weight(), value))
                covered.update(id(member) for member in value.members)
    units += [_Unit(name, m.weight, m) for name, m in root.named_modules()
              if isinstance(m, ServingLinear) and id(m) not in covered]
    return units


def _role_label(names: Sequence[str]) -> str:
    """``*.self_attn.qkv x30`` for the names of one shape's units (layer numbers as ``*``)."""
    patterns = [".".join("*" if part.isdigit() else part for part in name.split(".")) for name in names]
    return ", ".join(f"{pattern} x{patterns.count(pattern)}" for pattern in sorted(set(patterns)))


def pack_linears(root: nn.Module, policy: GemmPolicy | None = None,
                 head: torch.Tensor | None = None) -> tuple[int, PackedWeight | None]:
    """Pack every linear under ``root`` for CPU GEMMs on the paths chosen per shape, and ``head``
    (timed at decode row counts: one row per sampled sequence). Returns (weights packed, the head's)."""
    if any(p.is_cuda for p in root.parameters()):
        # A GPU runs F.linear (cuBLAS): merged groups are fused in place, nothing packed.
        fused = [v for m in root.modules() for v in vars(m).values() if isinstance(v, MergedLinear)]
        return sum(group.pack() for group in fused), None
    policy = policy or GemmPolicy()
    units = _units(root)
    by_shape: dict[tuple[tuple[int, ...], torch.dtype], list[_Unit]] = {}
    for unit in units:
        by_shape.setdefault((tuple(unit.weight.shape), unit.weight.dtype), []).append(unit)
    count = 0
    for group in by_shape.values():
        role = GemmRole(_role_label([u.label for u in group]), tuple(u.weight for u in group))
        choice = choose_for(role, policy)
        for unit in group:
            if isinstance(unit.target, MergedLinear):
                count += unit.target.pack_for(choice, unit.weight)
            elif isinstance(unit.target, ServingLinear):
                unit.target._packed = _packed_for(unit.weight, choice)
                count += unit.target._packed is not None
    head_packed = None
    if head is not None:
        head_packed = _packed_for(head, choose_for(GemmRole("lm_head", (head,), G.DECODE_ROWS[-1]), policy))
        count += head_packed is not None
    return count, head_packed
