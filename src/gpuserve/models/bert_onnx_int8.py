"""int8 forms of the embedding graph (:mod:`gpuserve.models.bert_onnx`), with ONNX Runtime's
quantisation tools, cached beside the fp32 export.

Only the encoder's weight matrix products are quantised (per layer: the fused QKV
projection, the attention output, the two FFN projections; 24 for all-MiniLM-L6-v2). What
quantises badly stays fp32 because it is never touched: the embedding lookups (``Gather``),
``LayerNormalization``, the attention score and value products with their softmax (both
operands are activations), pooling and the L2 norm. Two schemes (parameter ``int8_scheme``):

* ``blockwise`` (default): ``MatMulNBits`` with 8-bit symmetric weights in blocks of 32
  along the reduction axis and int8 compute (``accuracy_level`` 4): activations are
  quantised per block of 32 values at run time, so a few large activations cost only their
  block. Keeps the answer: on 300 held-out sentences cosine to fp32 min 0.999, recall@10
  0.976 (``gpuserve models accuracy text_embedding --precision int8``).
* ``dynamic``: ``quantize_dynamic`` with per-channel int8 weights and uint8 activations
  quantised per tensor (``MatMulInteger``). Faster, but one scale per activation tensor
  costs BERT's outlier channels: cosine min 0.983, recall@10 0.90 on the same set (the
  default ``precision_check`` refuses it). Measured variants, same set: leaving the six
  ``ffn_out`` projections fp32 gives min 0.989 / recall 0.92, the six ``ffn_in`` 0.988 /
  0.92, the QKV or attention-output projections no better than none (0.982-0.983); no
  exclusion reached min 0.99 and recall 0.95, so ``dynamic`` quantises all 24.

Static quantisation with a calibration set is not offered: activation ranges fixed per
tensor from calibration have the same per-tensor weakness as ``dynamic``, without its
per-batch ranges.
"""

from __future__ import annotations

from pathlib import Path

from gpuserve.backends.onnx_quantize import (
    INT8_SCHEMES,
    INT8_VERSION,
    quantize_file,
    quantize_into,
)

__all__ = ["INT8_SCHEMES", "int8_graph", "quantize_file"]


def int8_graph(source: Path, scheme: str, scratch: Path) -> tuple[Path, str]:
    """The int8 graph of the fp32 graph ``source``: read from beside it when cached, else
    quantised there (temporary name, then renamed) or, where that folder is not writable,
    in ``scratch``.

    Returns:
        ``(path, where)`` as :func:`gpuserve.models.bert_onnx.graph_file` says it.
    """
    name = f"{source.stem}-int8-{scheme}-v{INT8_VERSION}.onnx"
    cached = source.parent / name
    if cached.is_file():
        return cached, f"cached {cached}"
    err = quantize_into(source, cached, scheme)
    if err is not None:
        target = scratch / name
        quantize_file(source, target, scheme)
        return target, f"quantised in memory ({err})"
    return cached, f"quantised to {cached}"
