"""``triton_python_backend_utils`` (``pb_utils``): the objects a Triton Python model uses.

Registered in ``sys.modules`` under that name by :mod:`gpuserve.backends.triton_python.backend`
before a ``model.py`` is imported. Tensors live on the CPU as numpy arrays (BYTES tensors as
``object`` arrays of ``bytes``), as Triton's Python backend gives them by default.

Decoupled models (``model_transaction_policy { decoupled: true }``) get their request's
:class:`InferenceResponseSender` from ``request.get_response_sender()``: ``send(response,
flags)`` (``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` marks the last; ``send(flags=...)`` alone is
an empty final), from ``execute`` or from any thread of the model, and ``is_cancelled()``
(True once the client cancelled or went away). ``send`` blocks while the client reads slowly.

Business logic scripting: ``InferenceRequest(model_name=..., ...).exec()`` / ``async_exec()``
(see :mod:`.bls`). ``ModelConfig``: the object ``auto_complete_config`` gets (see
:mod:`.model_config`). Not provided (they raise :class:`TritonError` naming what is missing):
custom metrics.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from gpuserve.backends.triton_python.model_config import ModelConfig as ModelConfig

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


class TritonModelException(TritonError):
    """What a model raises from ``initialize``/``execute`` to report a failure."""


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

    Models may build one for business logic scripting and run it with :meth:`exec` or
    :meth:`async_exec` (``model_version`` and ``timeout``, microseconds, are keywords too);
    ``correlation_id`` and ``flags`` then call a sequence model as a client's ``sequence_id``,
    ``sequence_start`` and ``sequence_end`` would.
    """

    def __init__(
        self,
        inputs: list[Tensor] | None = None,
        requested_output_names: list[str] | None = None,
        model_name: str = "",
        request_id: str = "",
        correlation_id: int | str = 0,
        parameters: dict[str, Any] | str | None = None,
        flags: int = 0,
        **options: Any,
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
        self._options = options  # model_version, timeout (us): business logic scripting

    def inputs(self) -> list[Tensor]:
        """Every input tensor."""
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        """The outputs the client asked for (empty: all)."""
        return list(self._outputs)

    def trace(self) -> Any:
        """Triton's ``request.trace()``, for ``InferenceRequest(..., trace=request.trace())``:
        gpuserve nests a BLS call under the traced request of the running batch by itself,
        so this is only accepted (None)."""
        return self._options.get("trace")

    def request_id(self) -> str:
        """The request's id (``""`` when it names none)."""
        return self._request_id

    def correlation_id(self) -> int | str:
        """The request's sequence id (the client's ``sequence_id``): an ``int``, or a ``str``
        for a string id; 0 when the request names none."""
        return self._correlation_id

    def model_name(self) -> str:
        """The model the request is for."""
        return self._model_name

    def parameters(self) -> str:
        """The request's parameters as a JSON string."""
        return self._parameters

    def flags(self) -> int:
        """Request flags: ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` / ``_END`` bits. On a
        request ``execute`` receives, its client's ``sequence_start`` / ``sequence_end``
        (whatever path it came by); on one a model builds for BLS, those it was given."""
        return self._flags

    def is_cancelled(self) -> bool:
        """Whether the client cancelled or went away: a decoupled request's stream, or a
        request whose client left while its batch ran (a request cancelled before its batch
        formed never reaches ``execute``)."""
        sender = getattr(self, "_sender", None)
        if sender is not None:
            return bool(sender.is_cancelled())
        probe = getattr(self, "_probe", None)
        return probe is not None and bool(probe())

    def get_response_sender(self) -> InferenceResponseSender:
        """The request's response sender (decoupled models).

        Raises:
            TritonError: the model is not decoupled (it returns its responses from
                ``execute``).
        """
        sender = getattr(self, "_sender", None)
        if sender is None:
            raise TritonError(
                "get_response_sender: the model is not decoupled (set "
                "model_transaction_policy { decoupled: true } to send responses)",
                TritonError.UNSUPPORTED,
            )
        return sender

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on model ``model_name`` of the repository and wait for its
        response (business logic scripting; see :mod:`.bls`). Errors come back in the
        response (``has_error()``), they are not raised. With ``decoupled=True``: an
        iterator of its responses as they come (``for response in request.exec(
        decoupled=True)``), at once."""
        from gpuserve.backends.triton_python import bls

        return bls.exec_request(self, decoupled)

    async def async_exec(self, decoupled: bool = False) -> Any:
        """``exec`` for ``async def execute``: awaitable, several at once. With
        ``decoupled=True``: the iterator of its responses (``for`` or ``async for``)."""
        from gpuserve.backends.triton_python import bls

        return await bls.async_exec_request(self, decoupled)


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


class InferenceResponseSender:
    """Sends the responses of one request of a decoupled model (thread-safe).

    Args:
        sink: The engine's side of the stream (``gpuserve.backends.streaming.ResponseSink``).
    """

    def __init__(self, sink: Any) -> None:
        self._sink = sink
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send ``response`` (None: no response, only ``flags``); ``flags`` ==
        ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` marks the request's last. Blocks while the
        client reads slowly; does nothing once the request is cancelled.

        Raises:
            TritonError: after the final flag was sent, a response that is not an
                ``InferenceResponse``, or an unknown flag.
        """
        if self._closed:
            raise TritonError(
                "send: the final response of this request was already sent", TritonError.INTERNAL
            )
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonError(f"send: unknown flags {flags}", TritonError.INVALID_ARG)
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonError(
                f"send: expected an InferenceResponse, got {type(response).__name__}",
                TritonError.INVALID_ARG,
            )
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if final:
            self._closed = True
        if response is None:
            if final:
                self._sink.send(None, final=True)
            return
        error = response.error()
        if error is not None:
            self._sink.send(None, final=final, error=error)
            return
        outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
        self._sink.send(outputs, final=final)

    def is_cancelled(self) -> bool:
        """True once the client cancelled the request or went away: stop sending."""
        return bool(self._sink.is_cancelled())


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    """Whether a parsed ``args["model_config"]`` sets ``model_transaction_policy.decoupled``."""
    policy = model_config.get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


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
