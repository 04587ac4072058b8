"""The ``onnx`` backend: ``model.onnx`` on ONNX Runtime.

Version folder: ``model.onnx`` (external-data files beside it are found by ONNX Runtime).
Needs the ``onnx`` extra (``pip install 'gpuserve[onnx]'``; for GPUs ``onnxruntime-gpu``).

Execution providers: ``config.onnx.execution_providers`` is a preference order among
``tensorrt``, ``cuda`` and ``cpu``. An instance on ``cuda:N`` gets the GPU providers that the
installed ONNX Runtime offers (``onnxruntime.get_available_providers()``), with
``device_id=N``, then the CPU provider as ONNX Runtime's fallback for unsupported nodes; an
instance on the CPU gets the CPU provider only. A GPU instance with no GPU provider available
runs on the CPU and says so in the log.

Data path: the CPU stage arranges each declared input (contiguous, in its declared dtype;
BYTES as ``str`` elements, as ONNX Runtime wants). On a GPU provider it also uploads them as
device ``OrtValue``s bound through I/O binding, with outputs bound on the device too, so
nothing crosses PCIe during the run; the outputs come back to the host in the CPU
postprocess stage. Models with BYTES tensors skip I/O binding (strings live on the host).
Inputs are fed by declared name; outputs are fetched by declared name and cast to the
declared datatypes at the boundary.

Precision: the graph runs in the precision it was exported in, and ``precision`` is ``fp32``
(an fp16 graph with FP32 inputs/outputs comes from ``gpuserve export --fp16``) or, on CPU
instances, ``int8``: the graph quantised with ONNX Runtime's tools, cached, and checked
against fp32 at load (:mod:`gpuserve.backends.onnx_precision`). The config's datatypes must
equal the graph's (see :mod:`gpuserve.backends.signature`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from gpuserve.backends.base import Backend, LoadContext
from gpuserve.backends.optional import MissingDependencyError, first_use, require
from gpuserve.backends.signature import ModelSignature, ModelTensor, complete_config
from gpuserve.config import CONFIG_FILENAME, ModelConfig, OnnxConfig
from gpuserve.datatypes import numpy_dtype
from gpuserve.errors import ConfigError, InvalidInputError

logger = logging.getLogger(__name__)

MODEL_FILENAME = "model.onnx"

#: ONNX Runtime type strings -> V2 datatypes.
ORT_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}

_PROVIDERS = {
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
_GPU_PROVIDERS = frozenset({"TensorrtExecutionProvider", "CUDAExecutionProvider"})


#: The names of ``onnxruntime`` this backend uses, resolved under the import lock.
_ORT_NAMES = (
    "InferenceSession",
    "SessionOptions",
    "GraphOptimizationLevel",
    "ExecutionMode",
    "OrtValue",
    "get_available_providers",
)


def import_ort() -> Any:
    """``onnxruntime`` (thread-safe, see :mod:`gpuserve.backends.optional`).

    Raises:
        MissingDependencyError: ONNX Runtime is not installed (the message names the extra).
    """
    try:
        return require("onnxruntime", "backend 'onnx'", _ORT_NAMES)
    except MissingDependencyError as err:
        raise MissingDependencyError(
            f"{err.message} (or onnxruntime-gpu for CUDA/TensorRT)", err.module, err.extra
        ) from None


def _provider_names(providers: list[str | tuple[str, dict[str, Any]]]) -> tuple[str, ...]:
    return tuple(p if isinstance(p, str) else p[0] for p in providers)


def device_id(device: str) -> int | None:
    """The CUDA ordinal of a torch device string (``cuda:1`` -> 1, ``cuda`` -> 0), else None."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    return int(index) if index else 0


def choose_providers(
    preference: list[str], available: list[str], device: str
) -> list[str | tuple[str, dict[str, Any]]]:
    """The provider list for a session on ``device`` (see the module docstring).

    Args:
        preference: ``config.onnx.execution_providers`` (``tensorrt``, ``cuda``, ``cpu``).
        available: ``onnxruntime.get_available_providers()``.
        device: ``cpu`` or ``cuda:N``.

    Raises:
        ConfigError: no preferred provider can run on this device.
    """
    gpu = device_id(device)
    chosen: list[str | tuple[str, dict[str, Any]]] = []
    for name in preference:
        provider = _PROVIDERS[name]
        if provider not in available:
            continue
        if provider in _GPU_PROVIDERS:
            if gpu is not None:
                chosen.append((provider, {"device_id": gpu}))
        else:
            chosen.append(provider)
    if not chosen:
        raise ConfigError(
            f"onnx.execution_providers {preference}: none of them can run on {device} "
            f"(ONNX Runtime offers {available}); add 'cpu' or install onnxruntime-gpu"
        )
    return chosen


def session_options(options: OnnxConfig, ort: Any) -> Any:
    """``onnxruntime.SessionOptions`` from the config's ``onnx`` section."""
    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    result = ort.SessionOptions()
    result.intra_op_num_threads = options.intra_op_threads
    result.inter_op_num_threads = options.inter_op_threads
    result.graph_optimization_level = levels[options.graph_optimization_level]
    result.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL
        if options.execution_mode == "parallel"
        else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    result.log_severity_level = 3  # errors only: ORT's warnings go to stderr, not our logs
    return result


def read_signature(path: Path) -> ModelSignature:
    """The inputs and outputs of an ONNX file (names, V2 datatypes, dynamic dims as None).

    Raises:
        ConfigError: the file cannot be opened by ONNX Runtime.
    """
    ort = import_ort()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        with first_use("onnxruntime", ("CPUExecutionProvider",)):
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # ORT raises its own classes for corrupt or unsupported graphs
        raise ConfigError(f"{path}: ONNX Runtime cannot load it: {err}") from None
    return signature_of_session(session, path.name)


def signature_of_session(session: Any, source: str) -> ModelSignature:
    """A :class:`ModelSignature` from an ``InferenceSession``'s inputs and outputs."""

    def tensor(arg: Any) -> ModelTensor:
        shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in (arg.shape or ()))
        return ModelTensor(arg.name, ORT_DATATYPES.get(arg.type, arg.type), shape)

    return ModelSignature(
        source=source,
        inputs=[tensor(arg) for arg in session.get_inputs()],
        outputs=[tensor(arg) for arg in session.get_outputs()],
    )


class OnnxBackend(Backend):
    """Runs ``model.onnx`` in one ONNX Runtime session on one device."""

    def __init__(self) -> None:
        self.session: Any = None
        self.ort: Any = None
        self.device = "cpu"
        self.device_id: int | None = None
        self.inputs: list[tuple[str, np.dtype]] = []
        self.outputs: list[tuple[str, np.dtype]] = []
        #: Device type of I/O binding ("cuda"), or None to run with numpy feeds.
        self.bind: str | None = None
        self.config: ModelConfig | None = None

    @classmethod
    def complete_config(
        cls, config: ModelConfig, version_path: Path, *, auto_complete: bool = True
    ) -> ModelConfig:
        config_path = version_path.parent / CONFIG_FILENAME
        if config.precision not in ("fp32", "int8"):
            raise ConfigError(
                f"{config_path}: field 'precision': {config.precision!r} is not applied by "
                "backend 'onnx' (the graph runs in the precision it was exported in); use "
                "precision: fp32 (an fp16 graph from `gpuserve export --fp16`) or int8"
            )
        path = version_path / MODEL_FILENAME
        if not path.is_file():
            raise ConfigError(f"{version_path}: backend 'onnx' needs {MODEL_FILENAME}")
        return complete_config(config, read_signature(path), config_path)

    def load(self, context: LoadContext) -> None:
        ort = import_ort()
        config = context.config
        path = context.version_path / MODEL_FILENAME
        if not path.is_file():
            raise ConfigError(f"{context.version_path}: backend 'onnx' needs {MODEL_FILENAME}")
        providers = choose_providers(
            list(config.onnx.execution_providers), ort.get_available_providers(), context.device
        )
        # The first session of a provider set loads the provider libraries and initialises
        # ONNX Runtime's environment: alone, as Triton's ONNX Runtime backend does; later
        # sessions are created in parallel.
        if config.precision == "int8":
            if not context.device.startswith("cpu"):
                raise ConfigError(
                    f"model {config.name}: precision int8 on backend 'onnx' runs on CPU "
                    f"instances; this one is on {context.device}"
                )
            from gpuserve.backends.cpu_features import require_cpu_precision
            from gpuserve.backends.onnx_precision import open_int8

            require_cpu_precision(config.precision)  # warns on a core without int8 products
            with first_use("onnxruntime", ("CPUExecutionProvider",)):
                self.session = open_int8(
                    ort, path, session_options(config.onnx, ort), config, context.version_path
                )
        else:
            with first_use("onnxruntime", _provider_names(providers)):
                self.session = ort.InferenceSession(
                    str(path), session_options(config.onnx, ort), providers=providers
                )
        self.ort = ort
        self.config = config
        self.device = context.device
        self.device_id = device_id(context.device)
        self.inputs = [(spec.name, numpy_dtype(spec.datatype)) for spec in config.inputs]
        self.outputs = [(spec.name, numpy_dtype(spec.datatype)) for spec in config.outputs]
        active = self.session.get_providers()
        has_bytes = any(dt.kind == "O" for _, dt in self.inputs + self.outputs)
        on_gpu = any(p in _GPU_PROVIDERS for p in active)
        self.bind = "cuda" if on_gpu and self.device_id is not None and not has_bytes else None
        if self.device_id is not None and not on_gpu:
            logger.warning(
                "model %s: instance on %s, but ONNX Runtime runs it on %s "
                "(install onnxruntime-gpu for the CUDA/TensorRT providers)",
                config.name,
                context.device,
                active,
            )
        logger.info(
            "model %s: ONNX Runtime %s session on %s with providers %s (I/O binding: %s)",
            config.name,
            ort.__version__,
            context.device,
            active,
            self.bind,
        )

    def warmup(self) -> None:
        """Run one row of zeros (dynamic dims as 1), so TensorRT/CUDA set up before traffic.

        Best effort: a model that refuses zeros is logged, not failed.
        """
        assert self.config is not None
        feeds: dict[str, np.ndarray] = {}
        for spec in self.config.inputs:
            shape = [1] if self.config.max_batch_size > 0 else []
            model_shape = spec.shape if spec.reshape is None else spec.reshape
            shape += [1 if d < 0 else d for d in model_shape]
            dtype = numpy_dtype(spec.datatype)
            if dtype.kind == "O":
                feeds[spec.name] = np.full(shape, b"", dtype=object)
            else:
                feeds[spec.name] = np.zeros(shape, dtype=dtype)
        try:
            self.postprocess(self.forward(self.preprocess(feeds)))
        except Exception as err:  # warmup only: the first request will show a real failure
            logger.warning("model %s: warmup failed (ignored): %s", self.config.name, err)

    def preprocess(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        prepared: dict[str, Any] = {}
        for name, dtype in self.inputs:
            array = inputs.get(name)
            if array is None:
                continue  # an optional input the request left out
            if dtype.kind == "O":
                array = _to_str_array(array, name)
            else:
                array = np.ascontiguousarray(array, dtype=dtype)
            if self.bind:
                prepared[name] = self.ort.OrtValue.ortvalue_from_numpy(
                    array, self.bind, self.device_id
                )
            else:
                prepared[name] = array
        return prepared

    def forward(self, prepared: dict[str, Any]) -> Any:
        names = [name for name, _ in self.outputs]
        if not self.bind:
            return self.session.run(names, prepared)
        binding = self.session.io_binding()
        for name, value in prepared.items():
            binding.bind_ortvalue_input(name, value)
        for name in names:
            binding.bind_output(name, self.bind, self.device_id)
        self.session.run_with_iobinding(binding)
        return binding

    def postprocess(self, raw: Any) -> dict[str, np.ndarray]:
        arrays = raw if isinstance(raw, list) else raw.copy_outputs_to_cpu()
        result: dict[str, np.ndarray] = {}
        for (name, dtype), array in zip(self.outputs, arrays, strict=True):
            if dtype.kind == "O":
                array = np.vectorize(_to_bytes, otypes=[object])(array)
            elif array.dtype != dtype:
                array = array.astype(dtype)
            result[name] = array
        return result

    def unload(self) -> None:
        self.session = None


def _to_str_array(array: np.ndarray, name: str) -> np.ndarray:
    """BYTES elements (``bytes``) as ``str``, which ONNX Runtime needs for string tensors."""

    def decode(value: Any) -> str:
        if isinstance(value, bytes):
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInputError(
                    f"input '{name}': string tensors of this model must be UTF-8"
                ) from None
        return str(value)

    return np.vectorize(decode, otypes=[object])(array) if array.size else array.astype(object)


def _to_bytes(value: Any) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)
