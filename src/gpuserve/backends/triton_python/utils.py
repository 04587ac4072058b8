"""``triton_python_backend_utils`` (``pb_utils``): the objects a Triton Python model uses.

Registered in ``sys.modules`` under that name by :mod:`gpuserve.backends.triton_python.backend`
before a ``model.py`` is imported. Tensors live on the CPU as numpy arrays (BYTES tensors as
``object`` arrays of ``bytes``), as Triton's Python backend gives them by default.

Not provided (they raise :class:`TritonError` naming what is missing): business logic
scripting (``InferenceRequest.exec``), decoupled response senders, custom metrics.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

_logger = logging.getLogger("gpuserve.triton_python")

#: Triton's ``TYPE_*`` names -> numpy dtypes (``TYPE_STRING`` is an ``object`` array of bytes).
_NUMPY = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


def triton_string_to_numpy(triton_type: str) -> Any:
    """The numpy dtype of a ``TYPE_*`` name (``TYPE_FP32`` -> ``numpy.float32``).

    Raises:
        KeyError: not a Triton data type name.
    """
    return _NUMPY[triton_type]


def numpy_to_triton_type(dtype: Any) -> str | None:
    """The ``TYPE_*`` name of a numpy dtype, or None."""
    kind = np.dtype(dtype)
    if kind.kind in ("O", "S", "U"):
        return "TYPE_STRING"
    for name, numpy_type in _NUMPY.items():
        if numpy_type is not np.object_ and np.dtype(numpy_type) == kind:
            return name
    return None


class TritonError(Exception):
    """An error a model reports, for one response (``InferenceResponse(error=...)``) or
    raised from ``execute`` (then every request of the call fails).

    Args:
        message: The text the client sees.
        code: One of the class's codes (default ``INTERNAL``).
    """

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        """The error's text."""
        return self._message

    def code(self) -> int:
        """The error's code."""
        return self._code


class Tensor:
    """A named tensor (CPU, numpy).

    Args:
        name: Input or output name.
        array: The data; BYTES tensors as an ``object`` array of ``bytes``.
    """

    def __init__(self, name: str, array: Any) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def as_numpy(self) -> np.ndarray:
        """The data as a numpy array (no copy)."""
        return self._array

    def shape(self) -> list[int]:
        """The shape."""
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        """Always True: gpuserve hands Python models CPU tensors."""
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the data (``torch.from_dlpack`` takes it without a copy).

        Raises:
            TritonError: BYTES tensors have no DLPack form.
        """
        if self._array.dtype == np.object_:
            raise TritonError(
                "to_dlpack: BYTES tensors have no DLPack form", TritonError.UNSUPPORTED
            )
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor from a DLPack capsule, or an object with ``__dlpack__`` (a torch tensor);
        device tensors are copied to the CPU."""
        if hasattr(capsule, "__dlpack__"):
            try:
                return Tensor(name, np.from_dlpack(capsule))
            except (RuntimeError, TypeError, BufferError):
                pass  # a device tensor: through torch below
        import torch.utils.dlpack

        tensor = torch.utils.dlpack.from_dlpack(capsule)
        return Tensor(name, tensor.detach().cpu().numpy())


class InferenceRequest:
    """One request handed to ``execute``: its inputs and what it asks for.

    Models may build one for business logic scripting; :meth:`exec` is not supported.
    """

    def __init__(
        self,
        inputs: list[Tensor] | None = None,
        requested_output_names: list[str] | None = None,
        model_name: str = "",
        request_id: str = "",
        correlation_id: int = 0,
        parameters: dict[str, Any] | str | None = None,
        flags: int = 0,
        **_: Any,
    ) -> None:
        self._inputs = list(inputs or [])
        self._outputs = list(requested_output_names or [])
        self._model_name = model_name
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._parameters = (
            parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        )
        self._flags = flags

    def inputs(self) -> list[Tensor]:
        """Every input tensor."""
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        """The outputs the client asked for (empty: all)."""
        return list(self._outputs)

    def request_id(self) -> str:
        """The request's id (``""`` when it names none)."""
        return self._request_id

    def correlation_id(self) -> int:
        """0: gpuserve has no sequence batching yet."""
        return self._correlation_id

    def model_name(self) -> str:
        """The model the request is for."""
        return self._model_name

    def parameters(self) -> str:
        """The request's parameters as a JSON string."""
        return self._parameters

    def flags(self) -> int:
        """Request flags (0)."""
        return self._flags

    def is_cancelled(self) -> bool:
        """False: a cancelled request never reaches ``execute``."""
        return False

    def get_response_sender(self) -> Any:
        """Raises: decoupled models are not supported by gpuserve yet."""
        raise TritonError("decoupled response senders are not supported by gpuserve yet", 5)

    def exec(self, *_: Any, **__: Any) -> Any:
        """Raises: business logic scripting is not supported by gpuserve yet."""
        raise TritonError("business logic scripting (BLS) is not supported by gpuserve yet", 5)

    async_exec = exec


class InferenceResponse:
    """The answer to one request: its output tensors, or an error that fails that request.

    Args:
        output_tensors: The outputs.
        error: A :class:`TritonError` (or message) failing this request alone.
    """

    def __init__(
        self, output_tensors: list[Tensor] | None = None, error: TritonError | str | None = None
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = TritonError(error) if isinstance(error, str) else error

    def output_tensors(self) -> list[Tensor]:
        """The output tensors."""
        return list(self._outputs)

    def has_error(self) -> bool:
        """Whether the response carries an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The response's error, or None."""
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    """``request``'s input called ``name``, or None (an optional input not sent)."""
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    """``response``'s output called ``name``, or None."""
    return next((t for t in response.output_tensors() if t.name() == name), None)


def _by_name(model_config: dict[str, Any], key: str, name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get(key, []) if t.get("name") == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The input ``name`` of a parsed ``args["model_config"]``, or None."""
    return _by_name(model_config, "input", name)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The output ``name`` of a parsed ``args["model_config"]`` (``data_type``, ``dims``, ...),
    or None."""
    return _by_name(model_config, "output", name)


class Logger:
    """Triton's ``pb_utils.Logger``: lines go to the server log."""

    @staticmethod
    def log_info(message: str) -> None:
        _logger.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        _logger.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        _logger.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _logger.debug("%s", message)

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        _logger.info("%s", message)
