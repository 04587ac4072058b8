"""``precision: int8`` for ``backend: onnx`` (CPU): the quantised graph and its load-time gate.

The version's ``model.onnx`` is quantised (:mod:`gpuserve.backends.onnx_quantize`; scheme:
parameter ``int8_scheme``) and cached; before it serves, the int8 session and an fp32 session
of the original graph run the same reference rows and each output is held to the
``precision_check`` bounds (rows of an output compared as flat vectors). Reference rows:
``precision_check.reference_file``, an ``.npz`` file in the version folder with one array
per input (first axis: rows); without one, 64 seeded standard-normal rows for a model whose
inputs are all floating point (a weaker test than real data: give a file where you can).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from gpuserve.backends.onnx_quantize import INT8_OPS, INT8_SCHEMES, quantised_copy
from gpuserve.backends.optional import require
from gpuserve.backends.precision_gate import compare, gate_problem
from gpuserve.config import ModelConfig
from gpuserve.datatypes import numpy_dtype
from gpuserve.errors import ConfigError

logger = logging.getLogger(__name__)

REFERENCE_ROWS = 64


def int8_scheme(config: ModelConfig) -> str:
    """The ``int8_scheme`` parameter, checked.

    Raises:
        ConfigError: not one of :data:`INT8_SCHEMES`.
    """
    scheme = str(config.parameters.get("int8_scheme", "blockwise")).lower()
    if scheme not in INT8_SCHEMES:
        raise ConfigError(
            f"parameter 'int8_scheme': {scheme!r}; expected one of {', '.join(INT8_SCHEMES)}"
        )
    return scheme


def reference_inputs(config: ModelConfig, version_path: Path) -> tuple[dict[str, np.ndarray], str]:
    """The gate's input rows and where they came from (see the module docstring).

    Raises:
        ConfigError: the file is unreadable or lacks an input, or no file and an input is
            not floating point.
    """
    name = config.precision_check.reference_file
    if name is not None:
        path = version_path / name
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {spec.name: np.asarray(data[spec.name]) for spec in config.inputs}
        except (OSError, KeyError, ValueError) as err:
            raise ConfigError(
                f"precision_check.reference_file: {path}: {err} (expected an .npz file with "
                f"arrays {[s.name for s in config.inputs]})"
            ) from None
        return arrays, str(path)
    rng = np.random.default_rng(0)
    arrays = {}
    for spec in config.inputs:
        dtype = numpy_dtype(spec.datatype)
        if dtype.kind != "f":
            raise ConfigError(
                f"precision int8: input {spec.name} is {spec.datatype}; the precision check "
                "needs precision_check.reference_file (an .npz file of reference rows) for a "
                "model with non-floating-point inputs"
            )
        dims = [
            8 if d < 0 else d for d in (spec.reshape if spec.reshape is not None else spec.shape)
        ]
        rows = [REFERENCE_ROWS] if config.max_batch_size > 0 else []
        arrays[spec.name] = rng.standard_normal(rows + dims).astype(dtype)
    return arrays, f"{REFERENCE_ROWS} seeded random rows"


def check_int8(fp32: Any, int8: Any, config: ModelConfig, version_path: Path) -> None:
    """Hold the int8 session to the bounds against the fp32 session, output by output.

    Raises:
        ValueError: a bound is broken (naming the output, the measured value and the bound).
    """
    bounds = config.precision_check
    if not bounds.enabled:
        return
    feeds, source = reference_inputs(config, version_path)
    names = [spec.name for spec in config.outputs]
    want = fp32.run(names, feeds)
    got = int8.run(names, feeds)
    for name, expected, actual in zip(names, want, got, strict=True):
        rows = expected.shape[0] if config.max_batch_size > 0 else 1
        if rows < 2:
            continue  # one row: nothing to compare neighbours in; cosine alone would mislead
        report = compare(
            "int8",
            np.asarray(actual, dtype=np.float64).reshape(rows, -1),
            np.asarray(expected, dtype=np.float64).reshape(rows, -1),
            bounds.neighbours,
        )
        problem = gate_problem(report, bounds)
        if problem is not None:
            raise ValueError(f"output {name}: {problem} ({source}); raise the bounds or use fp32")
        logger.info("model %s: precision_check passed (%s), %s %s", config.name, source, name,
                    report.line())  # fmt: skip


def open_int8(ort: Any, path: Path, options: Any, config: ModelConfig, version_path: Path) -> Any:
    """The int8 session of ``path`` (quantised and cached), checked against fp32.

    Raises:
        ConfigError: bad ``int8_scheme``, or reference rows unavailable.
        ValueError: the gate refused it.
    """
    from gpuserve.backends.onnx_quantize import cache_root

    scheme = int8_scheme(config)
    with tempfile.TemporaryDirectory(prefix="gpuserve-int8-") as scratch:
        quantised = quantised_copy(path, scheme, cache_root(), Path(scratch))
        _warn_if_unchanged(quantised, config, scheme)
        providers = ["CPUExecutionProvider"]
        session = ort.InferenceSession(str(quantised), options, providers=providers)
    reference = ort.InferenceSession(str(path), options, providers=providers)
    check_int8(reference, session, config, version_path)
    return session


def _warn_if_unchanged(path: Path, config: ModelConfig, scheme: str) -> None:
    onnx = require("onnx", "precision int8", ["load"])
    ops = {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}
    if not ops & INT8_OPS:
        logger.warning(
            "model %s: int8_scheme %s quantised no node of this graph (it runs fp32)%s",
            config.name,
            scheme,
            "; blockwise quantises MatMul only: try int8_scheme dynamic"
            if scheme == "blockwise"
            else "",
        )
