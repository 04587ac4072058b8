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

import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

#: Values of parameter ``int8_scheme``.
INT8_SCHEMES = ("blockwise", "dynamic")
#: Bumped whenever a scheme's settings change (part of the cached file's name).
INT8_VERSION = 1
BLOCK_SIZE = 32


def quantize_file(source: Path, target: Path, scheme: str) -> None:
    """Write the int8 form of the fp32 graph ``source`` to ``target`` (see module docstring).

    Raises:
        ValueError: unknown ``scheme``.
        MissingDependencyError: onnxruntime's quantisation tools (the ``onnx`` extra).
    """
    if scheme not in INT8_SCHEMES:
        raise ValueError(
            f"parameter 'int8_scheme': {scheme!r}; expected one of {', '.join(INT8_SCHEMES)}"
        )
    # onnxruntime.quantization logs through the root logger at import and per call
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        if scheme == "dynamic":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(
                str(source),
                str(target),
                weight_type=QuantType.QInt8,
                per_channel=True,
                op_types_to_quantize=["MatMul"],
            )
            return
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(
            str(source), bits=8, block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=4
        )
        quantizer.process()
        quantizer.model.save_model_to_file(str(target))
    finally:
        root.setLevel(level)


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
    try:
        fd, tmp = tempfile.mkstemp(dir=source.parent, prefix=".int8-", suffix=".onnx")
    except OSError as err:
        target = scratch / name
        quantize_file(source, target, scheme)
        return target, f"quantised in memory ({err})"
    os.close(fd)
    try:
        quantize_file(source, Path(tmp), scheme)
        os.replace(tmp, cached)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return cached, f"quantised to {cached}"
