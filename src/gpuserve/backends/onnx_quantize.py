"""int8 forms of ONNX graphs with ONNX Runtime's quantisation tools, cached on disk.

Used by ``backend: onnx`` models with ``precision: int8`` (CPU) and by the built-in text
model's exported graph (:mod:`gpuserve.models.bert_onnx_int8`, where the schemes' accuracy
is measured). Schemes (parameter ``int8_scheme``):

* ``blockwise`` (default): ``MatMulNBits``, 8-bit symmetric weights in blocks of
  :data:`BLOCK_SIZE` along the reduction axis, int8 compute with activations quantised per
  block at run time (``accuracy_level`` 4). Quantises ``MatMul`` nodes with constant weights.
* ``dynamic``: ``quantize_dynamic``, per-channel int8 weights and uint8 activations quantised
  per tensor at run time (``MatMul``, ``Gemm``, ``Conv``, ...).

Nothing else is quantised: embedding lookups, normalisation, softmax and elementwise
operators stay fp32.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from gpuserve.backends.optional import require

logger = logging.getLogger(__name__)

#: Values of parameter ``int8_scheme``.
INT8_SCHEMES = ("blockwise", "dynamic")
#: Bumped whenever a scheme's settings change (part of a cached file's name).
INT8_VERSION = 1
BLOCK_SIZE = 32
#: Operators whose presence shows a graph was quantised.
INT8_OPS = frozenset({"MatMulNBits", "MatMulInteger", "ConvInteger", "DynamicQuantizeLinear"})


def cache_root() -> Path:
    """The cache folder: ``$GPUSERVE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/gpuserve``
    or ``~/.cache/gpuserve``; not created here."""
    explicit = os.environ.get("GPUSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "gpuserve"


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
            quantization = require(
                "onnxruntime.quantization", "precision int8", ["QuantType", "quantize_dynamic"]
            )
            quantization.quantize_dynamic(
                str(source),
                str(target),
                weight_type=quantization.QuantType.QInt8,
                per_channel=True,
                op_types_to_quantize=["MatMul"],
            )
            return
        nbits = require(
            "onnxruntime.quantization.matmul_nbits_quantizer",
            "precision int8",
            ["MatMulNBitsQuantizer"],
        )
        quantizer = nbits.MatMulNBitsQuantizer(
            str(source), bits=8, block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=4
        )
        quantizer.process()
        quantizer.model.save_model_to_file(str(target))
    finally:
        root.setLevel(level)


def quantize_into(source: Path, target: Path, scheme: str) -> OSError | None:
    """Quantise ``source`` into ``target`` through a temporary file in ``target``'s folder,
    renamed when complete (a reader never sees half a graph). Returns the error when that
    folder cannot be written (nothing is written then), else None."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".int8-", suffix=".onnx")
    except OSError as err:
        return err
    os.close(fd)
    try:
        quantize_file(source, Path(tmp), scheme)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return None


def quantised_copy(source: Path, scheme: str, cache: Path | None, scratch: Path) -> Path:
    """The int8 form of the graph file ``source``, cached as ``cache/onnx/int8/<sha256 of the
    file>-<scheme>-v<N>.onnx`` (written to a temporary name, then renamed), or written into
    ``scratch`` where the cache is None or not writable.

    Raises:
        ValueError: unknown ``scheme``.
    """
    digest = hashlib.sha256()
    with source.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    name = f"{digest.hexdigest()[:32]}-{scheme}-v{INT8_VERSION}.onnx"
    if cache is not None:
        folder = cache / "onnx" / "int8"
        target = folder / name
        if target.is_file():
            return target
        err = quantize_into(source, target, scheme)
        if err is None:
            return target
        logger.warning("int8 cache %s not writable (%s): quantising in memory", folder, err)
    target = scratch / name
    quantize_file(source, target, scheme)
    return target
