"""Linear layers with their epilogue fused, on oneDNN's prepacked CPU kernels.

A BERT layer's four projections are most of its arithmetic. At bf16 on a CPU, torch's
``F.linear`` lays the weight out anew for the AVX-512 BF16 / AMX kernel on every call,
copies the broadcast bias into the output before the product, and runs the GELU and the
residual add as separate passes over memory. :class:`FusedLinear` does what torch's own
compiler does on a CPU (the mkldnn lowering of ``torch.compile``): the weight is reordered
once, at load, into oneDNN's blocked layout (:meth:`FusedLinear.prepack`), and the GELU
(exact, erf) or the residual add runs inside the product's epilogue. oneDNN compiles a
kernel per input shape and caches it; a server's batches come in every token count, so the
rows are padded to a multiple of :data:`ROW_MULTIPLE` (a few hundred shapes instead of
thousands, which thrashed the cache: 1.38x on batches of random sizes, one core).

In-process on one core here (``python benchmarks/precision.py --inprocess-only``), bf16
all-MiniLM-L6-v2 went from 1.4x to 2.7x the tokens/s of fp32 on short sentences.

Until :meth:`FusedLinear.prepack` succeeds the layer is a plain ``nn.Linear``, and
:meth:`~FusedLinear.forward_gelu` / :meth:`~FusedLinear.forward_add` compose the same
operations unfused: callers run one code path on every device and dtype.

The kernels are ``torch.ops.mkldnn._linear_pointwise`` and its ``binary`` overload, the
operators torch's compiler emits; :func:`prepack_all` checks each on the layer it packs
(against ``F.linear`` on a seeded input) and leaves the layers unpacked, with the reason,
where the operators are missing or disagree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FusedLinear", "prepack_all", "prepack_refusal", "row_padded"]

#: dtypes whose CPU products gain from prepacking (fp32 gains ~8%, within noise: left out).
PREPACK_DTYPES = (torch.bfloat16,)
#: Rows the reorder is tuned for (a batch of short sentences); any row count runs.
ROWS_HINT = 512
#: Row counts are padded up to a multiple of this (see :func:`_rounded`).
ROW_MULTIPLE = 32


class FusedLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint keys) with fused epilogues.

    Shapes: ``x`` [..., in_features] -> [..., out_features], in the weight's dtype.
    """

    _packed: torch.Tensor | None = None

    @classmethod
    def sharing(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> FusedLinear:
        """A layer over existing parameters (another module's), without a copy.

        Args:
            weight: [out_features, in_features].
            bias: [out_features], or None.
        """
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return layer

    @property
    def packed(self) -> bool:
        """Whether the oneDNN kernels run this layer (after :meth:`prepack`)."""
        return self._packed is not None

    def prepack(self) -> None:
        """Reorder the weight once into oneDNN's layout; later calls use the fused kernels.

        The dense ``weight`` stays (checkpoint export, ``state_dict``); a later ``.to()`` of
        the module leaves the packed copy stale, so move or cast before packing.

        Raises:
            RuntimeError: the operators are missing from this torch build or fail here.
        """
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        rows, flat = _rounded(x)
        y = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")
        return y[:rows].view(*x.shape[:-1], self.out_features)

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(linear(x))`` with the exact (erf) GELU."""
        if self._packed is None:
            return F.gelu(F.linear(x, self.weight, self.bias))
        rows, flat = _rounded(x)
        y = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "gelu", [], "none")
        return y[:rows].view(*x.shape[:-1], self.out_features)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + linear(x)``; ``residual`` has the output's shape and dtype."""
        if self._packed is None:
            return residual + F.linear(x, self.weight, self.bias)
        rows, flat = _rounded(x)
        _, other = _rounded(residual)
        y = torch.ops.mkldnn._linear_pointwise.binary(flat, other, self._packed, self.bias, "add")
        return y[:rows].view(*x.shape[:-1], self.out_features)


def _rounded(x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``x`` as 2-d rows padded with zeros to a multiple of :data:`ROW_MULTIPLE`, and its
    real row count. oneDNN builds (JIT-compiles) a kernel per input shape and keeps it in a
    cache: a batch of every new token count would pay for a new one."""
    x = x.reshape(-1, x.shape[-1])
    rows = x.shape[0]
    extra = -rows % ROW_MULTIPLE
    return rows, (F.pad(x, (0, 0, 0, extra)) if extra else x)


def row_padded(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H] with zero rows appended up to a multiple of :data:`ROW_MULTIPLE`
    (``x`` itself when T is one). An encoder that pads its packed tokens once, before its
    first layer, spares each packed projection the copy :meth:`FusedLinear.forward` would
    make (six per layer); the extra rows are computed and thrown away at the end."""
    extra = -x.shape[0] % ROW_MULTIPLE
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def prepack_refusal(weight: torch.Tensor) -> str | None:
    """Why a layer with this weight stays on ``F.linear``, or None when it can be packed."""
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type}, the oneDNN kernels run on the CPU"
    if weight.dtype not in PREPACK_DTYPES:
        return f"dtype {weight.dtype} is not among {[str(d) for d in PREPACK_DTYPES]}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


def prepack_all(module: nn.Module) -> str | None:
    """Prepack every :class:`FusedLinear` in ``module``; None when all are packed, else why
    none is (the layers then stay on ``F.linear``, results unchanged).

    Each packed layer is checked once on a seeded input of 3 rows against ``F.linear`` in
    float32 (tolerance: 4 bf16 rounding steps of the output's scale) for its plain, GELU and
    residual forms; a disagreement unpacks every layer.
    """
    layers = [m for m in module.modules() if isinstance(m, FusedLinear)]
    if not layers:
        return "no FusedLinear layer"
    reason = prepack_refusal(layers[0].weight)
    if reason is not None:
        return reason
    try:
        for layer in layers:
            layer.prepack()
            problem = _disagreement(layer)
            if problem is not None:
                raise RuntimeError(problem)
    except RuntimeError as err:
        for layer in layers:
            layer._packed = None
        return f"oneDNN linear kernels unusable: {err}"
    return None


def _disagreement(layer: FusedLinear) -> str | None:
    generator = torch.Generator().manual_seed(0)
    dtype = layer.weight.dtype
    x = torch.randn(3, layer.in_features, generator=generator).to(dtype)
    residual = torch.randn(3, layer.out_features, generator=generator).to(dtype)
    weight, bias = layer.weight.float(), None if layer.bias is None else layer.bias.float()
    with torch.inference_mode():
        plain = F.linear(x.float(), weight, bias)
        cases = {
            "linear": (layer(x), plain),
            "linear+gelu": (layer.forward_gelu(x), F.gelu(plain)),
            "linear+add": (layer.forward_add(x, residual), plain + residual.float()),
        }
    for name, (got, want) in cases.items():
        scale = float(want.abs().max()) or 1.0
        error = float((got.float() - want).abs().max())
        if not error <= 4 * scale * 2.0**-8:  # NaN fails too
            return f"{name} differs from F.linear by {error:.3g} (output scale {scale:.3g})"
    return None
