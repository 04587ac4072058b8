"""Converting a ``torch``-backend model version to an ONNX graph (``gpuserve export``).

The graph: ``torch.onnx.export`` (the TorchScript-based exporter, opset 17 or later) of the
module wrapped so that it takes the declared inputs in config order and returns the declared
outputs in config order, cast to their declared datatypes. Dimension 0 is a dynamic ``batch``
axis when ``max_batch_size > 0``, and every ``-1`` dimension is dynamic too. With ``fp16``
the weights and floating-point computation are half precision while the graph's inputs and
outputs keep the declared datatypes (casts at both ends), so the ONNX model's config declares
the same tensors as the torch model's. The graph is checked with ``onnx.checker`` and run
once on ONNX Runtime (CPU) against the fp32 torch module on a sample batch of 3 rows (so
the dynamic batch axis is exercised with a size other than the export's 2).

Supported sources: ``model.py`` (``nn.Module``) and ``model.pt`` (TorchScript). A
``torch.export`` program (``model.pt2``) needs the dynamo-based exporter (``onnxscript``),
which is not used here. Where the files go is the CLI's business (:mod:`gpuserve.cli.export`).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from gpuserve.backends.base import LoadContext
from gpuserve.backends.onnx_backend import import_ort
from gpuserve.backends.optional import missing_dependency, require
from gpuserve.backends.torch_backend import EXPORTED_FILENAME, TorchBackend
from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.datatypes import numpy_dtype
from gpuserve.errors import BackendError, ConfigError

#: ``torch.onnx.export`` keeps its state in module globals (``GLOBALS.in_onnx_export``), so two
#: exports at once in one process fail ("in_onnx_export must be False"), as when models load in
#: parallel. Every export in gpuserve runs under this lock (reentrant: a caller may hold it
#: around its own check-then-export).
TORCH_ONNX_EXPORT_LOCK = threading.RLock()

MIN_OPSET = 17

#: Largest |onnx - torch| accepted for an fp32 export: ATOL + RTOL * max|torch|.
FP32_ATOL = 1e-4
FP32_RTOL = 1e-3


@dataclass(slots=True)
class ExportCheck:
    """How the exported graph compares with the torch module.

    Attributes:
        max_abs_diff: Largest |ONNX Runtime - torch (fp32)| over the outputs of the check
            batch, or None when ONNX Runtime could not run the graph on the CPU.
        note: Why the comparison did not run, or "".
    """

    max_abs_diff: float | None
    note: str = ""


class _ExportWrapper(torch.nn.Module):
    """Declared inputs in, declared outputs out (config order, declared dtypes)."""

    def __init__(self, module: Any, outputs: list[TensorSpec], half: bool) -> None:
        super().__init__()
        self.module = module
        self.output_names = [spec.name for spec in outputs]
        self.output_dtypes = [_torch_dtype(spec.datatype) for spec in outputs]
        self.fp16 = half

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fp16:
            inputs = tuple(x.half() if x.is_floating_point() else x for x in inputs)
        raw = self.module(*inputs)
        if isinstance(raw, torch.Tensor):
            raw = (raw,)
        if isinstance(raw, dict):
            raw = tuple(raw[name] for name in self.output_names)
        values = tuple(raw)
        if len(values) < len(self.output_names):
            raise ConfigError(
                f"the module returns {len(values)} output(s), the config declares "
                f"{len(self.output_names)}: {self.output_names}"
            )
        return tuple(v.to(dt) for v, dt in zip(values, self.output_dtypes, strict=False))


def export_version(
    config: ModelConfig,
    version_path: Path,
    version: int,
    path: Path,
    *,
    fp16: bool = False,
    opset: int = MIN_OPSET,
) -> ExportCheck:
    """Write the ONNX graph of one torch-backend version to ``path`` and check it.

    Args:
        config: The model's config (backend torch; inputs/outputs declared).
        version_path: The version folder (``model.py`` or ``model.pt``).
        version: Its number.
        path: The ``model.onnx`` to write (its folder must exist).
        fp16: Half-precision weights and compute, declared datatypes at the boundary.
        opset: ONNX opset, at least 17.

    Raises:
        ConfigError: the model cannot be exported (backend, format, BYTES tensors, opset).
        BackendError: the fp32 graph disagrees with the torch module beyond
            ``FP32_ATOL + FP32_RTOL * max|torch|``.
    """
    if opset < MIN_OPSET:
        raise ConfigError(f"opset {opset} is too old: use {MIN_OPSET} or later")
    if config.backend != "torch":
        raise ConfigError(
            f"model '{config.name}' has backend '{config.backend}'; export converts backend "
            "'torch' models (model.py or model.pt)"
        )
    if (version_path / EXPORTED_FILENAME).is_file():
        raise ConfigError(
            f"{version_path / EXPORTED_FILENAME}: exporting a torch.export program to ONNX "
            "needs the dynamo exporter (onnxscript), which gpuserve export does not use; "
            "export model.py or model.pt instead"
        )
    config = TorchBackend.complete_config(config, version_path)
    for spec in [*config.inputs, *config.outputs]:
        if spec.datatype == "BYTES":
            raise ConfigError(
                f"model '{config.name}': tensor '{spec.name}' is BYTES; only numeric tensors "
                "can be exported to ONNX"
            )
    module = _load_module(config, version_path, version)
    check_inputs = _sample_inputs(config, rows=3)
    expected = _run_torch(_ExportWrapper(module, config.outputs, half=False), check_inputs)
    if fp16:
        module = module.half()
    wrapper = _ExportWrapper(module, config.outputs, half=fp16).eval()
    _write_graph(wrapper, config, path, opset)
    check = _compare_with_ort(path, config, check_inputs, expected)
    if check.max_abs_diff is not None and not fp16:
        scale = max((float(np.max(np.abs(e))) for e in expected if e.size), default=0.0)
        allowed = FP32_ATOL + FP32_RTOL * scale
        if check.max_abs_diff > allowed:
            raise BackendError(
                "the exported graph disagrees with the torch module: max |diff| "
                f"{check.max_abs_diff:.3g} (allowed {allowed:.3g})"
            )
    return check


def exported_config_yaml(config: ModelConfig, source: str, fp16: bool) -> str:
    """``config.yaml`` text of the ONNX model: the torch model's tensors, batching, instances.

    Precision, optimisation options, parameters and the version policy are torch-model
    matters and are not carried over.
    """
    data = config.model_dump(
        mode="json",
        exclude_defaults=True,
        include={"inputs", "outputs", "dynamic_batching", "instance_group"},
    )
    data = {"backend": "onnx", "max_batch_size": config.max_batch_size, **data}
    note = "fp16 weights and compute; inputs/outputs as declared" if fp16 else "fp32"
    header = f"# Exported by `gpuserve export` from {source} ({note}).\n"
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None)


def _torch_dtype(datatype: str) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=numpy_dtype(datatype))).dtype


def _load_module(config: ModelConfig, version_path: Path, version: int) -> Any:
    """The torch module of one version, on the CPU in fp32 (the backend's own loader)."""
    backend = TorchBackend()
    fp32 = config.model_copy(update={"precision": "fp32"})
    backend.load(LoadContext(config=fp32, version_path=version_path, version=version))
    return backend.module


def _sample_inputs(config: ModelConfig, rows: int) -> list[torch.Tensor]:
    """One tensor per declared input: ``rows`` rows (if batched), -1 dims as 2.

    Floats are standard normal (seeded); integers and booleans are ones (valid token ids,
    attention masks and indices for most models).
    """
    generator = torch.Generator().manual_seed(0)
    batch = [min(rows, config.max_batch_size)] if config.max_batch_size > 0 else []
    tensors = []
    for spec in config.inputs:
        shape = batch + [2 if d == -1 else d for d in spec.shape]
        dtype = _torch_dtype(spec.datatype)
        if dtype.is_floating_point:
            tensors.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            tensors.append(torch.ones(shape, dtype=dtype))
    return tensors


def _run_torch(wrapper: _ExportWrapper, inputs: list[torch.Tensor]) -> list[np.ndarray]:
    with torch.inference_mode():
        return [out.numpy() for out in wrapper(*inputs)]


def _write_graph(wrapper: _ExportWrapper, config: ModelConfig, path: Path, opset: int) -> None:
    batched = config.max_batch_size > 0
    axes: dict[str, dict[int, str]] = {}
    for spec in [*config.inputs, *config.outputs]:
        dims = {0: "batch"} if batched else {}
        offset = 1 if batched else 0
        for index, dim in enumerate(spec.shape):
            if dim == -1:
                dims[index + offset] = f"{spec.name}_dim{index}"
        if dims:
            axes[spec.name] = dims
    # Export on a batch of 2: the exporter specialises dimensions of size 1.
    sample = _sample_inputs(config, rows=2)
    with TORCH_ONNX_EXPORT_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
        # Trace first: the exporter cannot trace a wrapper around a loaded TorchScript module
        # ("not part of the active trace"), but it exports the traced wrapper fine.
        traced = torch.jit.trace(wrapper, tuple(sample), check_trace=False)
        try:
            torch.onnx.export(
                traced,
                tuple(sample),
                str(path),
                input_names=[spec.name for spec in config.inputs],
                output_names=[spec.name for spec in config.outputs],
                dynamic_axes=axes or None,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
        except Exception as err:  # torch wraps a missing onnx in its own exporter error
            missing = missing_dependency(err, "exporting to ONNX")
            if missing is not None:
                raise missing from None
            raise
    onnx = require("onnx", "exporting to ONNX", ("checker",))
    onnx.checker.check_model(str(path), full_check=True)


def _compare_with_ort(
    path: Path, config: ModelConfig, inputs: list[torch.Tensor], expected: list[np.ndarray]
) -> ExportCheck:
    """Max |ORT - torch| over every output (None, with why, when ORT on CPU cannot run it)."""
    ort = import_ort()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        feeds = {spec.name: t.numpy() for spec, t in zip(config.inputs, inputs, strict=True)}
        got = session.run([spec.name for spec in config.outputs], feeds)
    except Exception as err:  # e.g. fp16 kernels the CPU provider lacks
        return ExportCheck(None, f"ONNX Runtime (CPU) could not run the graph: {err}")
    diff = 0.0
    for g, e in zip(got, expected, strict=True):
        if e.size:
            diff = max(diff, float(np.max(np.abs(g.astype(np.float64) - e.astype(np.float64)))))
    return ExportCheck(diff)
