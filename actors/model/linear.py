"""``ServingLinear``: an ``nn.Linear`` whose CPU float32 GEMMs run on a oneDNN-prepacked weight.

Owns the one choice of how a decoder's linear layers multiply on CPU. After the weights are
loaded, ``pack()`` reorders the weight once into oneDNN's blocked layout (``torch.ops.mkldnn``,
the kernels torch's own inductor uses for frozen CPU linears); every call then skips MKL's
per-call packing of the weight, which dominates the few-row GEMMs of decode steps. Measured on
this project's 2-core Intel CPU, per 768x3072 GEMM: 1.4-2x faster at 4-16 rows, ~1.2x at 177
rows; a whole decode step of the demo model 1.13-1.15x faster at batch 4-16. A single row keeps
``F.linear`` (GEMV is faster there). Values equal ``F.linear``'s to float32 rounding.

Parameter names stay ``weight``/``bias``, so checkpoints load as into ``nn.Linear``. Without
oneDNN, on another device or dtype, or before ``pack()``, it is exactly ``nn.Linear``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

#: Row count the packed layout is tuned for (a decode batch); any row count is served.
PACK_BATCH_HINT = 16
#: Rows outside [min, max] use ``F.linear``: for a single row MKL's GEMV beats the packed GEMM
#: (0.34 vs 0.38 ms for 768x3072 here); for batches of whole prompts (680-2,700 rows) MKL was
#: 3-6 % faster in whole prefill steps. In between (decode batches) the packed GEMM wins.
PACKED_MIN_ROWS = 2
PACKED_MAX_ROWS = 256

_log = logging.getLogger(__name__)


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (probed once, on a tiny case)."""
    try:
        w = torch.randn(4, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        out = torch.ops.mkldnn._linear_pointwise(torch.randn(2, 8), packed, None, "none", [], "")
        return bool(out.shape == (2, 4))
    except (RuntimeError, AttributeError) as exc:
        _log.info("oneDNN prepacked linear unavailable (%s); using F.linear", exc)
        return False


class ServingLinear(nn.Linear):
    _packed: torch.Tensor | None = None

    def pack(self) -> bool:
        """Prepack the weight for CPU float32 GEMMs; False (and nothing changes) elsewhere."""
        self._packed = pack_weight(self.weight)
        return self._packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.multiply(x, with_bias=True)

    def multiply(self, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
        """``x @ weight.T`` (+ bias when ``with_bias``): row-parallel layers add their bias once,
        after the all-reduce."""
        return multiply(x, self.weight, self._packed, self.bias if with_bias else None)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ([out, in]) reordered once into oneDNN's blocked layout for CPU float32 GEMMs;
    None (use ``weight`` as it is) on another device or dtype, or without oneDNN."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not onednn_linear_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def multiply(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
             bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on ``packed`` (``pack_weight(weight)``) for decode-sized
    row counts."""
    if packed is None or x.dim() != 2 or not PACKED_MIN_ROWS <= x.shape[0] <= PACKED_MAX_ROWS:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
